"""Context parallel on the GPT example's model: balanced token parts + meshwise attention equal one process.

One launch of 4 gloo processes runs every mesh in turn (dp=4 -> dp=2 x cp=2 -> cp=2 x tp=2 -> cp=4 -> cp=2 on 2
ranks -> one process), each against a one-process fp64 reference trained on the same global batches; the
all-gather attention trains dp=2 x cp=2, the ring cp=2 x tp=2, cp=4 and cp=2. At cp=2 and cp=4 both kinds of
attention are also compared, forward and backward, with one process's SDPA over whole windows (balanced chunks
of odd length, contiguous odd chunks, shuffled tokens; causal and not). The bad inputs are checked in this
process (they fail before any collective), except unequal parts (a collective finds them, on every rank).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshwise.data import ArrayDataset, MeshSampler, Shard, mesh_dataloader
from meshwise.errors import DataError, ParallelError
from meshwise.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(ROOT / "tests"))

import model as gpt  # noqa: E402
from test_data_sampler import layout_topology  # noqa: E402

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
GLOBAL_BATCH, STEPS, LR = 8, 5, 1e-2
BALANCED = Shard(0, balanced=True)


def _windows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], (n, TINY["block_size"] + 1))


def _datasets() -> tuple[ArrayDataset, ArrayDataset]:
    train, val = _windows(64, 0), _windows(20, 1)  # 20 held-out windows: the last eval batch is padded
    return tuple(ArrayDataset({"input": w[:, :-1], "target": w[:, 1:]}) for w in (train, val))


def _model() -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(**TINY)).double()


def _reference(steps: int) -> tuple[list[float], list[dict], list[dict], tuple[float, int]]:
    """One process on the same global batches: losses, gradients and parameters of each step, held-out loss/tokens
    after ``STEPS`` steps."""
    train, val = _datasets()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    plan = MeshSampler(len(train), GLOBAL_BATCH, mode="train", seed=0).plan()  # the global batches of epoch 0
    losses, grads, params, held = [], [], [], None
    for step in range(steps):
        idx = plan[step]
        x, y = (torch.as_tensor(train.sources[f].array[idx]) for f in ("input", "target"))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if step + 1 == STEPS:
            with torch.no_grad():
                x, y = (torch.as_tensor(val.sources[f].array[:]) for f in ("input", "target"))
                per_token = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
            held = (per_token.mean().item(), per_token.numel())
    return losses, grads, params, held


def _full(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _diff(model, ref: dict, grads: bool = False) -> float:
    worst = 0.0
    for name, p in model.named_parameters():
        got = _full(p.grad if grads else p)
        worst = max(worst, (got - ref[name]).abs().max().item())
    return worst


def _build(topo, cp: bool, kind: str = "auto"):
    """The GPT example's model, context parallel when the mesh has a split dim, placed by meshwise, and its trainer."""
    from torch.distributed.tensor.parallel import loss_parallel

    import meshwise
    from meshwise.parallel.context import context_parallel

    model = _model()
    if cp:
        context_parallel(model, topo, kind=kind)
    tp = topo.sizes.get("tp", 1)
    model = meshwise.parallelize(model, topo, tp_plan=gpt.tp_plan if tp > 1 else None, fsdp_units=gpt.Block)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    trainer = meshwise.create_trainer(
        model,
        opt,
        gpt.token_loss,
        topo,
        loss_weight="tokens",
        step_context=loss_parallel if tp > 1 else None,
        forward=(lambda m, b: m(b["input"], positions=b["positions"])) if cp else None,
    )
    train, val = _datasets()
    parts = {"input": BALANCED, "target": BALANCED} if cp else None
    loader = mesh_dataloader(train, topo, global_batch_size=GLOBAL_BATCH, mode="train", seed=0, parts=parts)
    val_loader = mesh_dataloader(val, topo, global_batch_size=GLOBAL_BATCH, mode="eval", parts=parts)
    return model, opt, trainer, loader, val_loader


def _train(
    topo, cp: bool, steps: int, ref, ckpt: str | None = None, load: str | None = None, kind: str = "auto"
) -> dict:
    """Train ``steps`` steps (after loading ``load``, if given); compare losses, gradients, parameters."""
    from ignite.engine import Events

    import meshwise

    losses, grads, params, _ = ref
    model, opt, trainer, loader, _ = _build(topo, cp, kind)
    seen: list[float] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.output))
    start = 0
    if load:
        meshwise.Checkpointer(load, topo).load("latest", model=model, optimizer=opt, engine=trainer, loader=loader)
        start = trainer.state.iteration
    trainer.run(loader, max_iters=start + steps)
    out = {
        "loss": max(abs(a - b) for a, b in zip(seen, losses[start : start + steps])),
        "grad": _diff(model, grads[start + steps - 1], grads=True),
        "param": _diff(model, params[start + steps - 1]),
        "cursor": loader.state_dict()["samples_consumed"],
        "bytes": loader.bytes_read,
    }
    if ckpt:
        meshwise.Checkpointer(ckpt, topo).save(
            trainer.state.iteration, model=model, optimizer=opt, engine=trainer, loader=loader
        )
    return out


def _held_out(topo, ref) -> dict:
    """Held-out mean loss and token count at dp=2 x cp=2 after training: each token counted once."""
    from torchmetrics.aggregation import SumMetric

    import meshwise
    from meshwise.metrics import MeanLoss

    model, _, trainer, loader, val_loader = _build(topo, cp=True)
    trainer.run(loader, max_iters=STEPS)

    def per_token(m, batch):
        logits = m(batch["input"], positions=batch["positions"])
        return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), reduction="none").view(
            batch["target"].shape
        )

    evaluator = meshwise.create_evaluator(
        model,
        topo,
        metrics={"loss": MeanLoss(), "tokens": SumMetric()},
        forward=per_token,
        select=lambda losses, batch: (losses,),
    )
    counts = meshwise.create_evaluator(
        model, topo, metrics={"tokens": SumMetric()}, forward=per_token, select=lambda losses, b: (losses * 0 + 1,)
    )
    loss = evaluator.run(val_loader).metrics["loss"]
    tokens = counts.run(val_loader).metrics["tokens"]
    return {"loss": abs(float(loss) - ref[3][0]), "tokens": float(tokens), "ref_tokens": ref[3][1]}


def _layouts(k: int) -> dict[str, list[torch.Tensor]]:
    """Each split rank's positions, several ways: balanced chunks of odd length, contiguous odd chunks, shuffled."""
    from meshwise.data.parts import balanced_bounds

    out = {}
    for c in (3, 5):  # balanced, chunks of c tokens: windows of 2k * c
        out[f"balanced{c}"] = [
            torch.cat([torch.arange(a, b) for a, b in balanced_bounds(2 * k * c, k, i)]) for i in range(k)
        ]
    out["contiguous3"] = list(torch.arange(3 * k).chunk(k))
    out["shuffled5"] = list(torch.randperm(5 * k, generator=torch.Generator().manual_seed(k)).chunk(k))
    return out


def _attention_checks(topo) -> dict:
    """Both kinds of attention at this mesh's cp size against one process's SDPA: largest differences, fp64.

    The ring scores queries in tiles of 2 rows here (``Q_TILE``), so tiles also cut runs and partly masked ones
    hold rows with no key yet. Then unequal parts (rank 0 one token more): refused on every rank alike.
    """
    from meshwise.parallel import ring
    from meshwise.parallel.context import attention

    k, me = topo.size("cp"), topo.coordinate("cp")
    worst = {"ring": 0.0, "gather": 0.0}
    tile, ring.Q_TILE = ring.Q_TILE, 2
    try:
        for parts in _layouts(k).values():
            pos, window = parts[me], sum(len(p) for p in parts)
            for causal in (True, False):
                torch.manual_seed(window)
                q, kk, v, g = (torch.randn(2, 3, window, 4, dtype=torch.float64) for _ in range(4))
                full = [t.clone().requires_grad_() for t in (q, kk, v)]
                ref = F.scaled_dot_product_attention(*full, is_causal=causal)
                ref.backward(g)
                for kind in worst:
                    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, kk, v)]
                    out = attention(*mine, pos, topo, is_causal=causal, kind=kind)
                    out.backward(g[:, :, pos])
                    diffs = [(out - ref[:, :, pos]).abs().max().item()]
                    diffs += [(m.grad - f.grad[:, :, pos]).abs().max().item() for m, f in zip(mine, full)]
                    worst[kind] = max(worst[kind], *diffs)
    finally:
        ring.Q_TILE = tile
    n = 3 if me == 0 else 2
    try:
        attention(*(torch.zeros(1, 1, n, 4, dtype=torch.float64) for _ in range(3)), torch.arange(n), topo, kind="ring")
        worst["unequal"] = "no error"
    except ParallelError as e:
        worst["unequal"] = str(e)
    return worst


def _init(mesh: dict, world: int | None = None):
    import meshwise

    if world is not None:  # a smaller world in the same processes (ranks >= world sit this phase out)
        os.environ.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    return meshwise.init(mesh, timeout=30)


def _phases(root: str) -> dict:
    import meshwise

    rank = int(os.environ["RANK"])
    ref = _reference(STEPS + 1)
    out: dict = {}
    topo = _init({"dp": 4})  # cp=1, four data ranks: saves step STEPS for the move to cp=2
    out["dp4"] = _train(topo, False, STEPS, ref, ckpt=f"{root}/dp4")
    meshwise.shutdown()
    topo = _init({"dp": 2, "cp": 2})
    out["dp2cp2"] = _train(topo, True, STEPS, ref)  # windows of 16 tokens: "auto" all-gathers
    out["dp4->dp2cp2"] = _train(topo, True, 1, ref, load=f"{root}/dp4")
    out["held_out"] = _held_out(topo, ref)
    out["attention_cp2"] = _attention_checks(topo)
    meshwise.shutdown()
    topo = _init({"cp": 2, "tp": 2})
    out["cp2tp2"] = _train(topo, True, STEPS, ref, kind="ring")
    meshwise.shutdown()
    topo = _init({"cp": 4})
    out["cp4"] = _train(topo, True, STEPS, ref, kind="ring")
    out["attention_cp4"] = _attention_checks(topo)
    meshwise.shutdown()
    if rank < 2:
        topo = _init({"cp": 2}, world=2)
        out["cp2"] = _train(topo, True, STEPS, ref, ckpt=f"{root}/cp2", kind="ring")
        meshwise.shutdown()
    if rank == 0:
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = "0"
        topo = _init({"dp": 1}, world=1)
        out["cp2->cp1"] = _train(topo, False, 1, ref, load=f"{root}/cp2")
        meshwise.shutdown()
    return out


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    return run_distributed(_phases, 4, str(tmp_path_factory.mktemp("cp")), timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp2cp2", "cp2tp2", "cp4", "cp2"])
def test_training_equals_one_process(phases, mesh):
    ranks = [p[mesh] for p in phases if mesh in p]
    for r in ranks:
        assert r["loss"] <= 1e-12 and r["grad"] <= 1e-12 and r["param"] <= 1e-12, r
        assert r["cursor"] == STEPS * GLOBAL_BATCH


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_gather_attention_equal_one_process(phases, cp):
    for p in phases:
        r = p[f"attention_cp{cp}"]
        assert r["ring"] <= 1e-12 and r["gather"] <= 1e-12, r


@pytest.mark.slow
def test_unequal_parts_refused_on_every_rank(phases):
    for p in phases:
        for cp, counts in ((2, [3, 2]), (4, [3, 2, 2, 2])):
            assert f"split ranks hold {counts} tokens" in p[f"attention_cp{cp}"]["unequal"], p
            assert "Shard(0, balanced=True)" in p[f"attention_cp{cp}"]["unequal"]


@pytest.mark.slow
def test_each_rank_reads_its_part(phases):
    whole = phases[0]["dp4"]["bytes"] * 4  # every window of the 5 steps, read once over dp=4
    for p in phases:
        assert p["dp2cp2"]["bytes"] == whole // 4  # half the windows (dp), half of each window (cp)
        assert p["cp2tp2"]["bytes"] == whole // 2
    assert phases[0]["cp2"]["bytes"] == whole // 2


@pytest.mark.slow
def test_held_out_counts_every_token_once(phases):
    for p in phases:
        h = p["held_out"]
        assert h["loss"] <= 1e-12 and h["tokens"] == h["ref_tokens"] == 20 * TINY["block_size"], h


@pytest.mark.slow
def test_checkpoint_moves_between_cp_sizes(phases):
    for p in phases:  # cp=1 (dp=4) -> dp=2 x cp=2: the sixth step equals one process's, cursor included
        assert p["dp4->dp2cp2"]["loss"] <= 1e-12 and p["dp4->dp2cp2"]["param"] <= 1e-12
        assert p["dp4->dp2cp2"]["cursor"] == (STEPS + 1) * GLOBAL_BATCH
    one = phases[0]["cp2->cp1"]  # cp=2 -> one process
    assert one["loss"] <= 1e-12 and one["param"] <= 1e-12 and one["cursor"] == (STEPS + 1) * GLOBAL_BATCH


# --------------------------------------------------------------------------- bad inputs (no process group needed)


def test_window_that_cannot_balance():
    topo = layout_topology({"cp": 4}, 1)
    ds = ArrayDataset({"input": _windows(4, 0)[:, :12]})  # 12 tokens: not divisible by 2 * 4
    with pytest.raises(DataError, match=r"12 cells cannot be cut into 8 equal chunks.*divisible by 8"):
        mesh_dataloader(ds, topo, global_batch_size=2, parts={"input": BALANCED})


def test_split_dim_given_two_ways():
    topo = layout_topology({"cp": 2}, 0)
    w = _windows(4, 0)
    ds = ArrayDataset({"input": w[:, :-1], "target": w[:, 1:], "pair": np.stack([w[:, :-1]] * 2, axis=1)})
    for other in (Shard(0), Shard(1, balanced=True)):
        with pytest.raises(DataError, match=r"split dim 'cp' splits the windows two ways"):
            mesh_dataloader(ds, topo, global_batch_size=2, parts={"input": BALANCED, "target": BALANCED, "pair": other})
    with pytest.raises(DataError, match="no halo"):
        Shard(0, halo=1, balanced=True)


def test_model_without_entry_point_or_positions():
    from meshwise.parallel.context import context_parallel

    topo = layout_topology({"cp": 2}, 0)
    with pytest.raises(ParallelError, match="no known attention entry point.*context_attention = None"):
        context_parallel(torch.nn.TransformerEncoderLayer(16, 2), topo)
    with pytest.raises(ParallelError, match="no split dim|needs the split dim"):
        context_parallel(_model(), layout_topology({"dp": 2}, 0))
    with pytest.raises(ParallelError, match="with pipeline stages .* is not supported"):
        context_parallel(_model(), layout_topology({"pp": 2, "cp": 2}, 0))
    model = context_parallel(copy.deepcopy(_model()), topo)
    with pytest.raises(ParallelError, match=r"positions=batch\['positions'\]"):
        model(torch.zeros(1, 8, dtype=torch.long))  # forgot the positions: refused before any collective


def test_attention_on_any_order_of_runs():
    """One rank holding the window's tokens in a shuffled order of runs: both kinds equal SDPA forward and backward."""
    from meshwise.parallel.context import attention, score_elements

    topo = layout_topology({"cp": 1}, 0)
    order = torch.cat([torch.arange(0, 4), torch.arange(12, 16), torch.arange(5, 12), torch.tensor([4])])
    for causal, kind in ((c, k) for c in (True, False) for k in ("gather", "ring")):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 3, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        ref.backward(torch.ones_like(ref))
        local = [t.detach()[:, :, order].requires_grad_() for t in (q, k, v)]
        out = attention(*local, order, topo, is_causal=causal, kind=kind)
        out.backward(torch.ones_like(out))
        assert (out - ref[:, :, order]).abs().max() <= 1e-12
        for mine, full in zip(local, (q, k, v)):
            assert (mine.grad - full.grad[:, :, order]).abs().max() <= 1e-12
    assert score_elements([0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]) == 4 * (4 + 16 + 8 + 12)
    # balanced cp=2 of 8 tokens: rank 1's chunks [2, 4) and [4, 6) touch, and are scored as two blocks
    ranks = [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [score_elements(r, ranks) for r in ranks] == [2 * (2 + 8), 2 * (4 + 6)]
    with pytest.raises(ParallelError, match="not 0..15 once each"):
        attention(*local, torch.zeros(16, dtype=torch.long), topo)


def test_attention_kind_and_bad_options():
    """kind="auto" takes the ring above ring_above tokens on more than one rank; bad options name the fix."""
    from meshwise.parallel.context import RING_ABOVE, ContextAttention, attention, attention_kind, context_parallel
    from meshwise.parallel.ring import ring_plan

    assert attention_kind(RING_ABOVE, 4) == "gather" and attention_kind(RING_ABOVE + 8, 4) == "ring"
    assert attention_kind(RING_ABOVE + 8, 1) == "gather" and attention_kind(16, 2, "auto", ring_above=8) == "ring"
    assert attention_kind(1 << 20, 4, "gather") == "gather" and attention_kind(8, 1, "ring") == "ring"
    topo = layout_topology({"cp": 2}, 0)
    assert "ring attention over 'cp' (2 ranks" in ContextAttention(topo, kind="ring").description
    for bad, match in (
        ({"kind": "flash"}, r"kind='flash'.*one of \['auto', 'ring', 'gather'\]"),
        ({"ring_above": -1}, "int >= 0"),
    ):
        with pytest.raises(ParallelError, match=match):
            context_parallel(_model(), topo, **bad)
        with pytest.raises(ParallelError, match=match):
            attention(*(torch.zeros(1, 1, 4, 2) for _ in range(3)), torch.arange(4), topo, **bad)
    # balanced cp=2 of 8 tokens, rank 1 ([2, 4) and [4, 6) touch): two key runs a peer, the triangles masked
    ranks = [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert ring_plan(ranks[1], ranks, causal=True) == [
        [(0, 2, 0, 2, False), (2, 4, 0, 2, False)],  # rank 0's keys [0, 2) in full, [6, 8) skipped
        [(0, 2, 0, 2, True), (2, 4, 0, 2, False), (2, 4, 2, 4, True)],
    ]


def test_ring_in_16_bit_keeps_sums_in_float32():
    """16-bit inputs: the ring's running sums stay float32, so it is about as close to fp64 as torch's SDPA is.

    (With 16-bit sums its bf16 output is 2.6x SDPA's error.)
    """
    from meshwise.parallel.context import attention

    topo = layout_topology({"cp": 1}, 0)
    torch.manual_seed(0)
    window = 128
    order = torch.cat([torch.arange(64, 128), torch.arange(0, 64)])  # two runs: the online softmax rescales
    q, k, v, g = (torch.randn(1, 2, window, 32, dtype=torch.float64) for _ in range(4))

    def run(fn, dtype, idx):
        given = [t[:, :, idx].to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(given)
        out.backward(g[:, :, idx].to(dtype))
        return [t.double()[:, :, torch.argsort(idx)] for t in (out, *(x.grad for x in given))]

    whole = torch.arange(window)
    ref = run(lambda t: F.scaled_dot_product_attention(*t, is_causal=True), torch.float64, whole)
    for dtype in (torch.bfloat16,):  # float16 takes the same path
        sdpa = run(lambda t: F.scaled_dot_product_attention(*t, is_causal=True), dtype, whole)
        ring = run(lambda t: attention(*t, order, topo, kind="ring"), dtype, order)
        for name, mine, theirs, exact in zip(("out", "dq", "dk", "dv"), ring, sdpa, ref):
            assert mine.dtype == torch.float64 and ring[0].shape == exact.shape
            err, base = (mine - exact).abs().max().item(), (theirs - exact).abs().max().item()
            assert err <= 2.5 * base, (dtype, name, err, base)
