"""Weighted mixtures (``meshwise.data.mix``): Megatron's blending order, each source's own epochs, schedules,
resume on any mesh and with other weights, exhaustion policies, per-source evaluation, and training on a real
dp=2 x tp=2 mesh equal to one process (float64), stopped and resumed at dp=4 and at one process; the same launch
runs test_stream_mixture's checks of streams resumed at another data size.

The oracles are independent: Megatron's ``build_blending_indices`` loop written out in Python, each source's
order as ``numpy.random.default_rng([seed, crc32(name), epoch]).permutation(length)``, and plain torch.
"""

from __future__ import annotations

import json
import zlib

import datasets
import numpy as np
import pytest
import torch
from test_loader_reiterate import layout_topology

from meshwise.data import ArrayDataset, Schedule, mesh_dataloader, mix
from meshwise.errors import DataError
from meshwise.testing import run_distributed

LENGTHS = {"web": 50, "code": 30, "math": 20}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
SEED = 3


def arrays(name: str, n: int) -> ArrayDataset:
    """Rows that say where they come from: x = [source * 1000 + row, row, 1.0], y = a function of them."""
    s = list(LENGTHS).index(name) if name in LENGTHS else 9
    rows = np.arange(n, dtype=np.float64)
    x = np.stack([s * 1000 + rows, np.sin(rows + s), np.ones(n)], axis=1)
    y = np.stack([np.cos(rows * 0.3 + s), 0.5 * np.sin(rows) - s, np.cos(rows) * s, rows / n], axis=1)
    return ArrayDataset({"x": x, "y": y})


def mixture(weights=None, lengths=None, **kw):
    lengths = lengths or LENGTHS
    return mix({n: arrays(n, k) for n, k in lengths.items()}, weights or WEIGHTS, seed=SEED, **kw)


def rows_of(batch) -> list[int]:
    return [int(v) for v in batch["x"][:, 0]]


def epochs(loader, n: int) -> list[list[int]]:
    return [rows_of(b) for _ in range(n) for b in loader]


def megatron(weights: list[float], size: int) -> list[int]:
    """Megatron-core's build_blending_indices (helpers.cpp) on normalised weights, line for line but for the
    target: after the sample (``sample_idx + 1``) where Megatron takes it before (``max(sample_idx, 1)``)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    current, out = [0] * len(w), []
    for sample_idx in range(size):
        x = float(sample_idx + 1)
        best, err = 0, w[0] * x - current[0]
        for d in range(1, len(w)):
            e = w[d] * x - current[d]
            if e > err:
                best, err = d, e
        out.append(best)
        current[best] += 1
    return out


def source_order(name: str, length: int, upto: int) -> list[int]:
    """A source's rows in the order it gives them: its own shuffle per epoch of its own."""
    salt, out, e = zlib.crc32(name.encode()), [], 0
    while len(out) < upto:
        out += np.random.default_rng([SEED, salt, e]).permutation(length).tolist()
        e += 1
    return out[:upto]


# ---- the order
@pytest.mark.parametrize("case", range(4))
def test_the_order_is_megatrons_and_each_source_its_own_shuffle(case):
    rng = np.random.default_rng(case)
    names = ["a", "b", "c", "d", "e"][: 2 + case]
    lengths = {n: int(rng.integers(5, 40)) for n in names}
    weights = {n: float(rng.uniform(0.05, 1)) for n in names}
    gbs = int(rng.choice([4, 6, 8]))
    m = mix({n: arrays(n, k) for n, k in lengths.items()}, weights, seed=SEED, epoch_samples=60)
    loader = mesh_dataloader(m, layout_topology({"dp": 1}, 0), global_batch_size=gbs)
    batches = [b for _ in range(3) for b in loader]
    got = [int(s) for b in batches for s in b["source"]]
    assert got == megatron([weights[n] for n in names], len(got))
    w = np.array([weights[n] for n in names]) / sum(weights.values())
    counts = np.cumsum(np.eye(len(names))[got], axis=0)
    assert np.abs(counts - np.outer(np.arange(1, len(got) + 1), w)).max() <= 1.0  # every prefix, every source
    rows = [int(r) % 1000 for b in batches for r in b["x"][:, 0]]
    for s, n in enumerate(names):  # each source gives its rows in its own order, across its epochs
        mine = [r for r, g in zip(rows, got) if g == s]
        assert mine == source_order(n, lengths[n], len(mine)), n
    assert len(loader) == 60 // gbs and loader.state_dict()["epoch"] == 3


def test_the_compiled_rule_gives_pythons_order_and_megatrons():
    """numba compiles the rule for long orders (make test installs it): the same picks as the Python loop."""
    from meshwise.data import blend as rule

    if rule._compiled() is None:
        pytest.skip("numba is not installed (pip install meshwise[fast])")
    w = rule.Weights(["a", "b", "c"], {"a": 0.5, "b": 0.3, "c": 0.2}, 1, np.ones(3))
    n = 3 * rule._COMPILED_FROM
    counts = np.zeros(3, dtype=np.int64)
    compiled = rule.blend(w, 0, 0, counts.copy(), counts, n)  # long: numba
    assert compiled.tolist() == megatron([0.5, 0.3, 0.2], n)
    schedule = Schedule([(0, {"a": 1}), (n, {"c": 1})], interpolate="linear")
    linear = rule.Weights(["a", "b", "c"], schedule, 1, np.ones(3))
    start = np.array([7, 3, 2], dtype=np.int64)
    counts = start.copy()
    compiled = rule.blend(linear, 100, 90, np.array([5, 3, 2]), counts, n)
    python, c = [0] * n, (start - np.array([5, 3, 2])).astype(np.float64).tolist()
    rule._greedy(linear.since(90, np.arange(101, 101 + n)).tolist(), c, python)
    assert compiled.tolist() == python and counts.tolist() == (np.array(c) + [5, 3, 2]).tolist()


def test_a_resume_at_another_data_size_or_batch_gives_the_unbroken_order():
    unbroken = epochs(mesh_dataloader(mixture(), layout_topology({"dp": 1}, 0), global_batch_size=8), 3)
    loader = mesh_dataloader(mixture(), layout_topology({"dp": 1}, 0), global_batch_size=8)
    it = iter(loader)
    first = [rows_of(next(it)) for _ in range(7)]
    state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint keeps
    for mesh in ({"dp": 2}, {"dp": 4}, {"dp": 2, "tp": 2}):
        size, tp = mesh["dp"], mesh.get("tp", 1)
        ranks = range(0, size * tp, tp)  # one rank of each data rank (tp peers read the same rows)
        per_rank = []
        for r in ranks:
            resumed = mesh_dataloader(mixture(), layout_topology(mesh, r), global_batch_size=8)
            resumed.load_state_dict(state)
            per_rank.append(epochs(resumed, 3))
        joined = [sum((p[i] for p in per_rank), []) for i in range(len(per_rank[0]))]
        assert len(per_rank) == size and first + joined[: len(unbroken) - 7] == unbroken, mesh
    other = mesh_dataloader(mixture(), layout_topology({"dp": 1}, 0), global_batch_size=4)  # another global batch
    other.load_state_dict(state)
    flat = sum(epochs(other, 1), [])
    assert flat == sum(unbroken[7:], [])[: len(flat)]


def test_new_weights_on_resume_continue_every_source_where_it_was():
    loader = mesh_dataloader(mixture(), layout_topology({"dp": 1}, 0), global_batch_size=8)
    it = iter(loader)
    before = sum((rows_of(next(it)) for _ in range(5)), [])
    state = loader.state_dict()
    new = {"web": 0.1, "code": 0.1, "math": 0.8}
    resumed = mesh_dataloader(mixture(new), layout_topology({"dp": 1}, 0), global_batch_size=8)
    resumed.load_state_dict(state)
    after = sum(epochs(resumed, 2), [])
    for s, (name, length) in enumerate(LENGTHS.items()):  # no repeat, no skip: each source's order goes on
        mine = [r % 1000 for r in before + after if r // 1000 == s]
        assert mine == source_order(name, length, len(mine)), name
    got = [r // 1000 for r in after]  # from the resume on, Megatron's rule on the new weights
    start = np.array([state["counts"][n] for n in LENGTHS])
    counts = start + np.cumsum(np.eye(3)[got], axis=0)
    target = start + np.outer(np.arange(1, len(got) + 1), list(new.values()))
    assert np.abs(counts - target).max() <= 1.0
    assert resumed.state_dict()["anchor"]["at"] == 40


def test_drop_and_stop_policies():
    weights = {"web": 0.2, "code": 0.3, "math": 0.5}  # math runs out first
    drop = mesh_dataloader(mixture(weights, exhausted="drop"), layout_topology({"dp": 1}, 0), global_batch_size=8)
    for epoch in range(2):  # every sample of every source once an epoch (the last partial batch dropped)
        rows = sum(epochs(drop, 1), [])
        assert len(rows) == 96 and len(set(rows)) == 96 and drop.state_dict()["epoch"] == epoch + 1
    stop = mesh_dataloader(mixture(weights, exhausted="stop"), layout_topology({"dp": 1}, 0), global_batch_size=8)
    one = sum(epochs(stop, 1), [])
    order, counts, lengths = megatron(list(weights.values()), 100), [0, 0, 0], list(LENGTHS.values())
    end = 0
    for source in order:  # Megatron's order up to the first sample a source no longer has
        if counts[source] == lengths[source]:
            break
        counts[source] += 1
        end += 1
    assert [r // 1000 for r in one] == order[: end // 8 * 8] and len(stop) == end // 8 and len(set(one)) == len(one)
    again = sum(epochs(stop, 1), [])  # the next epoch: every source anew, reshuffled
    assert len(again) == len(one) and again != one


def test_schedules_constant_in_steps_and_linear():
    constant = Schedule([(0, {"web": 1.0}), (3, {"code": 1.0}), (6, {"web": 1, "math": 1})], unit="steps")
    loader = mesh_dataloader(mixture(constant), layout_topology({"dp": 1}, 0), global_batch_size=8)
    got = [[r // 1000 for r in b] for b in epochs(loader, 1)]
    assert got[:3] == [[0] * 8] * 3 and got[3:6] == [[1] * 8] * 3
    assert all(sorted(b) == [0, 0, 0, 0, 2, 2, 2, 2] for b in got[6:])
    linear = Schedule([(0, {"web": 1.0}), (96, {"math": 1.0})], interpolate="linear")
    loader = mesh_dataloader(mixture(linear), layout_topology({"dp": 1}, 0), global_batch_size=8)
    got = [r // 1000 for r in sum(epochs(loader, 1), [])]  # 96 samples: web's share falls as math's rises
    w = np.array([[1 - j / 96, 0, j / 96] for j in range(96)])
    target = np.cumsum(w, axis=0)
    counts = np.cumsum(np.eye(3)[got], axis=0)
    assert np.abs(counts[1:] - target[np.arange(1, 96)]).max() <= 1.0 + 1e-9 and got.count(1) == 0
    with pytest.raises(DataError, match="Schedule ends at sample 96, and this step would reach sample 104"):
        epochs(loader, 1)  # the next epoch runs past the schedule's last point


def test_map_style_sources_give_the_same_order_and_eval_reads_every_sample_once():
    class Rows(torch.utils.data.Dataset):
        def __init__(self, name, n):
            self.ds = arrays(name, n)

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):
            return self.ds[i]

    topo = layout_topology({"dp": 1}, 0)
    sources = {n: Rows(n, k) for n, k in LENGTHS.items()}
    math = arrays("math", 20)  # one source as a datasets.Dataset (Arrow), the others as torch Datasets
    columns = {f: [math[i][f].tolist() for i in range(20)] for f in ("x", "y")}
    sources["math"] = datasets.Dataset.from_dict(columns).with_format("torch")
    mapped = mesh_dataloader(mix(sources, WEIGHTS, seed=SEED), topo, global_batch_size=8)
    plain = mesh_dataloader(mixture(), topo, global_batch_size=8)
    for a, b in zip(epochs(mapped, 2), epochs(plain, 2)):
        assert a == b
    evals = mesh_dataloader(mix(sources, WEIGHTS, seed=SEED), topo, global_batch_size=8, mode="eval")
    seen = [(int(s), r) for b in evals for s, r, v in zip(b["source"], rows_of(b), b["valid"]) if v]
    assert seen == [(s, s * 1000 + i) for s, n in enumerate(LENGTHS.values()) for i in range(n)]


def test_bad_input_is_refused_with_the_fix():
    topo = layout_topology({"dp": 1}, 0)
    srcs = {n: arrays(n, k) for n, k in LENGTHS.items()}
    for weights, match in [
        ({"web": 0.0, "code": 0.0}, "not a positive number"),
        ({"web": -1.0, "code": 2.0}, ">= 0"),
        ({"web": 1.0, "text": 1.0}, r"\['text'\], which are not sources"),
    ]:
        with pytest.raises(DataError, match=match):
            mix(srcs, weights)
    with pytest.raises(DataError, match=r"\['code'\] have no samples"):
        mix({"web": arrays("web", 5), "code": arrays("code", 0)}, {"web": 1, "code": 1})
    with pytest.raises(DataError, match="first point must be at 0"):
        mix(srcs, Schedule([(5, WEIGHTS)]))
    with pytest.raises(DataError, match="different lengths"):
        mix(srcs, Schedule([(0, WEIGHTS), (10, {"web": 1})]), exhausted="stop")
    with pytest.raises(DataError, match="same fields"):
        mix({"web": arrays("web", 5), "x": ArrayDataset({"x": np.zeros((5, 3))})}, {"web": 1, "x": 1})
    with pytest.raises(DataError, match="are streams"):
        mix({"web": arrays("web", 5), "s": datasets.Dataset.from_dict({"x": [1]}).to_iterable_dataset()}, {"web": 1})
    loader = mesh_dataloader(mixture(), topo, global_batch_size=8)
    next(iter(loader))
    state = loader.state_dict()
    renamed = mix({"web": srcs["web"], "code": srcs["code"], "maths": srcs["math"]}, {"web": 1}, seed=SEED)
    with pytest.raises(DataError, match=r"added: \['maths'\], removed: \['math'\]"):
        mesh_dataloader(renamed, topo, global_batch_size=8).load_state_dict(state)
    longer = mixture(lengths={**LENGTHS, "web": 51})
    with pytest.raises(DataError, match=r"changed length.*'web': \(50, 51\)"):
        mesh_dataloader(longer, topo, global_batch_size=8).load_state_dict(state)
    with pytest.raises(DataError, match="not a mixture's position"):
        mesh_dataloader(mixture(), topo, global_batch_size=8).load_state_dict(
            mesh_dataloader(srcs["web"], topo, global_batch_size=8).state_dict()
        )
    with pytest.raises(DataError, match="seed=3 to mix"):
        mesh_dataloader(mixture(), topo, global_batch_size=8, seed=5)
    with pytest.raises(DataError, match="shorter than one global batch"):
        mesh_dataloader(mixture(exhausted="drop"), topo, global_batch_size=128)


# ---- training on a real mesh, against one process
STEPS, STOP, RESUME_AT, G, LR = 12, 4, 8, 8, 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()


def _loss(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _one_process(first: int, last: int, state=None, weights=None) -> tuple[dict, dict]:
    """Plain torch on the mixture's global batches from step ``first`` to ``last``; the params and the cursor."""
    model = _model()
    if state is not None:
        model.load_state_dict(state["model"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = mesh_dataloader(mixture(weights), layout_topology({"dp": 1}, 0), global_batch_size=G)
    if state is not None:
        loader.load_state_dict(state["loader"])
    batches = (b for _ in range(10) for b in loader)
    for _ in range(first, last):
        b = next(batches)
        loss = _loss(model(b["x"]), b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, loader.state_dict()


def _train(topo, steps: int, state=None, weights=None):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import meshwise

    model = _model()
    if state is not None:
        model.load_state_dict(state["model"])
    tp = topo.sizes.get("tp", 1)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()} if tp > 1 else None
    model = meshwise.parallelize(model, topo, tp_plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = meshwise.create_trainer(model, opt, _loss, topo, input_key="x", target_key="y")
    loader = mesh_dataloader(mixture(weights), topo, global_batch_size=G)
    if state is not None:
        loader.load_state_dict(state["loader"])
    trainer.run(loader, max_iters=steps)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}
    mix_share = {k: v for k, v in trainer.state.observed.items() if k.startswith("mix/")}  # what the run logs
    return {"model": full, "loader": json.loads(json.dumps(loader.state_dict())), "mix": mix_share}, model


def _per_source_eval(topo, model) -> dict:
    from torchmetrics import MeanSquaredError

    import meshwise

    m = mixture()
    evaluator = meshwise.create_evaluator(
        model, topo, {"mse": MeanSquaredError().set_dtype(torch.float64)}, input_key="x", target_key="y", sources=m
    )
    return evaluator.run(mesh_dataloader(m, topo, global_batch_size=G, mode="eval")).metrics


def _on_the_mesh() -> dict:
    import meshwise

    out = {}
    topo = meshwise.init({"dp": 2, "tp": 2}, timeout=30)
    out["dp2tp2"], model = _train(topo, STEPS)
    out["eval"] = _per_source_eval(topo, model)
    stopped, _ = _train(topo, STOP)  # stopped at STOP ...
    meshwise.shutdown()
    topo = meshwise.init({"dp": 4}, timeout=30)
    out["dp4"], _ = _train(topo, RESUME_AT - STOP, state=stopped)  # ... resumed at dp=4 to RESUME_AT
    out["dp4 new weights"], _ = _train(topo, 2, state=stopped, weights={"web": 0.1, "code": 0.1, "math": 0.8})
    meshwise.shutdown()
    from test_stream_mixture import on_the_mesh  # streams stopped at dp=4, resumed at dp=2 x tp=2: same launch

    on_the_mesh(meshwise, out)
    return out


def test_a_mixture_trains_like_one_process_at_dp2_tp2_and_resumes_at_dp4_and_one_process():
    res = run_distributed(_on_the_mesh, 4, timeout=180)
    params, cursor = _one_process(0, STEPS)
    for r in res:
        got = r["dp2tp2"]
        assert max(float((got["model"][k] - params[k]).abs().max()) for k in params) <= 1e-12
        assert got["loader"] == cursor
        assert got["mix"] == {f"mix/{n}": c / (STEPS * G) for n, c in cursor["counts"].items()}
    # stopped at dp=2 x tp=2, resumed at dp=4, then at one process: the unbroken run's parameters
    rest, end = _one_process(RESUME_AT, STEPS, state=res[0]["dp4"])
    assert max(float((rest[k] - params[k]).abs().max()) for k in params) <= 1e-12 and end == cursor
    assert res[0]["dp4"]["loader"]["total"] == RESUME_AT * G
    # new weights at the resume: each source continues (the counts go on from the stop)
    moved = res[0]["dp4 new weights"]["loader"]
    assert moved["anchor"]["at"] == STOP * G and sum(moved["counts"].values()) == (STOP + 2) * G
    # per-source evaluation: one process's metric over each source's rows, and overall
    model = _model()
    model.load_state_dict(params)
    ds = mixture()
    total = sum(LENGTHS.values())
    x = torch.stack([ds[i]["x"] for i in range(total)])
    y = torch.stack([ds[i]["y"] for i in range(total)])
    src = torch.tensor([ds[i]["source"] for i in range(total)])
    with torch.no_grad():
        pred = model(x)
    expect = {"mse": float(((pred - y) ** 2).mean())}  # plain torch
    for s, name in enumerate(LENGTHS):
        expect[f"mse/{name}"] = float(((pred[src == s] - y[src == s]) ** 2).mean())
    for r in res:
        assert set(r["eval"]) == set(expect)
        assert all(abs(r["eval"][k] - v) <= 1e-12 for k, v in expect.items()), (r["eval"], expect)
    from test_stream_mixture import check_the_mesh

    check_the_mesh(res)  # a stream mixture and a plain stream resumed at another data size: each sample once


def test_a_dry_run_describes_the_mixture():
    from meshwise import dryrun

    loader = mesh_dataloader(mixture(), layout_topology({"dp": 2}, 0), global_batch_size=8)
    facts = dryrun._loader_facts(loader)["mixture"]
    assert facts["sources"] == LENGTHS and facts["exhausted"] == "repeat"
    assert facts["weights"] == WEIGHTS and facts["per_rank_step"] == {n: w * 4 for n, w in WEIGHTS.items()}
