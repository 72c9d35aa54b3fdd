"""Map-style sources on the mesh: torch Datasets and datasets.Dataset, pad_collate, pack, replica reads, token splits.

Rank views are simulated in one process where the loader needs no process group (read='each' over a
``Topology`` built from a ``Layout``). One launch of 4 gloo processes runs two meshes in turn (dp=2 x tp=2,
then dp=2 x cp=2): for a torch Dataset, an Arrow ``datasets.Dataset`` read from disk and packed rows it checks
that the read strategies give the batches of ``read="each"``, that the GPT example's model trains to the
parameters of one float64 process reading the same global batches (across a mid-epoch resume of the loader)
and that an evaluator counts every held-out sample once.
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from meshwise.data import ArrayDataset, MeshSampleLoader, Replicate, Shard, mesh_dataloader, pack, pad_collate
from meshwise.data.packing import pack_arrays
from meshwise.data.reading import decode, encode
from meshwise.data.sampler import MeshSampler
from meshwise.environment import Environment
from meshwise.errors import DataError
from meshwise.layout import Layout
from meshwise.testing import run_distributed
from meshwise.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

import model as gpt  # noqa: E402

N = 13
BALANCED = Shard(0, dim="cp", balanced=True)


def layout_topology(mesh: dict, rank: int) -> Topology:
    """A real Topology for ``rank`` of ``mesh`` with no process group (enough for read='each')."""
    world = int(np.prod(list(mesh.values())))
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    return Topology(Layout.resolve(mesh, world, None), env, torch.device("cpu"), "gloo", datetime.timedelta(30), None)


def _tokens(i: int) -> list[int]:
    return [100 * i + j for j in range(1 + (i * 7) % 5)]  # lengths 1..5, varying


class Docs(torch.utils.data.Dataset):
    """A map-style torch dataset of variable-length token documents (module level: it pickles)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": _tokens(i), "labels": _tokens(i), "id": i}


def _hf() -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"input_ids": [_tokens(i) for i in range(N)], "labels": [_tokens(i) for i in range(N)], "id": list(range(N))}
    )


def _check_batch(b: dict) -> None:
    v = b["valid"]
    assert torch.equal(b["index"][~v], torch.full_like(b["index"][~v], -1))
    assert torch.all(b["input_ids"][~v] == 0) and torch.all(b["labels"][~v] == -100)
    for row, i in enumerate(b["index"].tolist()):
        if i < 0:
            continue
        toks = torch.tensor(_tokens(i))
        assert b["input_ids"].dtype == torch.int64 and int(b["id"][row]) == i
        assert torch.equal(b["input_ids"][row, : len(toks)], toks)
        assert int(b["attention_mask"][row].sum()) == len(toks)
        assert torch.all(b["labels"][row, len(toks) :] == -100)


# ---- collate
def test_pad_collate_pads_stacks_and_masks():
    b = pad_collate(
        [
            {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "x": np.ones(2)},
            {"input_ids": [4], "labels": [4], "x": np.zeros(2)},
        ]
    )
    assert b["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]] and b["input_ids"].dtype == torch.int64
    assert b["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and b["x"].shape == (2, 2)
    b = pad_collate([{"input_ids": [1, 2]}, {"input_ids": [3]}], pad_to=4, pad_value={"input_ids": 9})
    assert b["input_ids"].tolist() == [[1, 2, 9, 9], [3, 9, 9, 9]]
    b = pad_collate([(torch.ones(2, 3), 1), (torch.zeros(2, 3), 0)])  # tuples: fields "0", "1"
    assert b["0"].shape == (2, 2, 3) and b["1"].tolist() == [1, 0]
    assert pad_collate([{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])["attention_mask"].tolist() == [[1, 1]] * 2
    assert pad_collate([{"input_ids": np.array([1, 2], dtype=np.uint16)}])["input_ids"].dtype == torch.int64


def test_pad_collate_errors_name_the_field():
    with pytest.raises(DataError, match="'img'"):
        pad_collate([{"img": torch.zeros(2, 3)}, {"img": torch.zeros(2, 4)}])
    with pytest.raises(DataError, match="'input_ids'.*pad_to"):
        pad_collate([{"input_ids": [1, 2, 3]}], pad_to=2)
    with pytest.raises(DataError, match="same fields"):
        pad_collate([{"a": 1}, {"b": 1}])


# ---- pack
def _pack_oracle(docs, seq_len):
    ids, pos, doc = [], [], []
    for d, tokens in enumerate(docs):
        for p, t in enumerate(tokens):
            ids.append(t), pos.append(p), doc.append(d)
    n = len(ids) // seq_len * seq_len
    return [np.array(x[:n]).reshape(-1, seq_len) for x in (ids, pos, doc)]


@pytest.mark.parametrize("seq_len", [1, 4, 7])
def test_pack_matches_a_python_loop(seq_len):
    docs = [_tokens(i) for i in range(N)]
    want = _pack_oracle(docs, seq_len)
    for source in (docs, Docs(), _hf()):
        ds = pack(source, seq_len)
        got = [ds.sources[k].array for k in ("input_ids", "position_ids", "document_ids")]
        assert all(g.dtype == np.int64 and np.array_equal(g, w) for g, w in zip(got, want)), type(source)
    ordered = _hf().select([5, 2, 9])  # a select() view packs in view order
    assert np.array_equal(pack(ordered, 2).sources["input_ids"].array, _pack_oracle([docs[5], docs[2], docs[9]], 2)[0])


def test_pack_rows_are_array_samples_with_balanced_token_split():
    ds = pack(Docs(), 8)
    batches = [
        list(mesh_dataloader(ds, layout_topology({"dp": 1, "cp": 2}, r), global_batch_size=2, mode="eval",
                             parts={n: Shard(0, dim="cp", balanced=True) for n in ds.names}))
        for r in range(2)
    ]  # fmt: skip
    for b0, b1 in zip(*batches):
        full = torch.cat([b0["input_ids"], b1["input_ids"]], 1)
        pos = torch.cat([b0["positions"], b1["positions"]], 1)
        rows = torch.from_numpy(ds.sources["input_ids"].array[b0["index"].numpy()])
        assert torch.equal(full, torch.gather(rows, 1, pos))
    with pytest.raises(DataError, match="fewer than one row"):
        pack([[1, 2]], 3)
    with pytest.raises(DataError, match="add up"):
        pack_arrays(np.arange(5), [2, 2], 2)


# ---- loader, ranks simulated in one process
@pytest.mark.parametrize("source", ["torch", "hf"])
def test_map_style_loader_on_simulated_mesh(source):
    ds = Docs() if source == "torch" else _hf()
    mesh = {"dp": 2, "tp": 2}
    for mode in ("train", "eval"):
        runs = [
            [b for b in mesh_dataloader(ds, layout_topology(mesh, r), global_batch_size=4, mode=mode, seed=3,
                                        drop_last=False)]
            for r in range(4)
        ]  # fmt: skip
        for run in runs:
            for b in run:
                _check_batch(b)
                assert len(b["valid"]) == 2 == len(b["input_ids"])
        for a, b in zip(runs[0], runs[1]):  # tp peers: identical batches
            assert all(torch.equal(a[k], b[k]) for k in a)
        seen = sorted(i for r in (0, 2) for b in runs[r] for i in b["index"].tolist() if i >= 0)
        assert seen == list(range(N)), mode
    ld = mesh_dataloader(ds, layout_topology({"dp": 1}, 0), global_batch_size=3, num_workers=1)
    assert [b["index"].tolist() for b in ld] == [
        b["index"].tolist() for b in mesh_dataloader(ds, layout_topology({"dp": 1}, 0), global_batch_size=3)
    ]


def test_map_style_resume_at_another_dp_size():
    ds = _hf()
    one = mesh_dataloader(ds, layout_topology({"dp": 1}, 0), global_batch_size=4, seed=1)
    full = [b["index"].tolist() for b in one]
    first = mesh_dataloader(ds, layout_topology({"dp": 1}, 0), global_batch_size=4, seed=1)
    next(iter(first))  # one batch handed out
    state = pickle.loads(pickle.dumps(first.state_dict()))
    halves = []
    for r in range(2):
        ld = mesh_dataloader(ds, layout_topology({"dp": 2}, r), global_batch_size=4, seed=1)
        ld.load_state_dict(state)
        halves.append([b["index"].tolist() for b in ld])
    assert [a + b for a, b in zip(*halves)] == full[1:]


def test_map_style_errors():
    topo = layout_topology({"dp": 1}, 0)

    # streams are taken by mesh_dataloader's streaming path (tests/test_streaming_sources.py)
    with pytest.raises(DataError, match="one split"):
        mesh_dataloader(datasets.DatasetDict({"train": _hf()}), topo, global_batch_size=1)
    with pytest.raises(DataError, match="read must be one of"):
        mesh_dataloader(Docs(), topo, global_batch_size=1, read="gather")
    with pytest.raises(DataError, match="no 'split' dim"):
        mesh_dataloader(Docs(), topo, global_batch_size=1, parts={"input_ids": Shard(0)})
    cp = layout_topology({"dp": 1, "cp": 2}, 0)
    with pytest.raises(DataError, match="not a split dim"):
        mesh_dataloader(Docs(), cp, global_batch_size=1, parts={"input_ids": Shard(0, dim="tp")})
    with pytest.raises(DataError, match="'id'.*collated batch"):  # a [B] field has no sample axis to cut
        next(iter(mesh_dataloader(Docs(), cp, global_batch_size=2, parts={"id": Shard(0)})))
    odd = mesh_dataloader(Docs(), cp, global_batch_size=2, parts={"input_ids": BALANCED}, collate_fn=_collate_to_6)
    with pytest.raises(DataError, match="6 cells cannot be cut into 4"):  # own collate_fn: it pads, not the loader
        next(iter(odd))
    with pytest.raises(DataError, match="stage_fields"):
        mesh_dataloader(Docs(), topo, global_batch_size=1, stage_fields={"first": ["input_ids"]})
    locked = Docs()
    locked.lock = threading.Lock()
    with pytest.raises(DataError, match="pickle"):
        mesh_dataloader(locked, topo, global_batch_size=1, num_workers=1)
    with pytest.raises(DataError, match="pickle"):
        mesh_dataloader(Docs(), topo, global_batch_size=1, num_workers=1, collate_fn=lambda s: pad_collate(s))
    with pytest.raises(DataError, match="collate_fn"):
        mesh_dataloader(ArrayDataset({"x": np.zeros((2, 1))}), topo, global_batch_size=1, collate_fn=pad_collate)
    ld = mesh_dataloader(
        Docs(), topo, global_batch_size=2, collate_fn=lambda s: {"n": torch.tensor([len(x["input_ids"]) for x in s])}
    )
    assert isinstance(ld, MeshSampleLoader) and next(iter(ld))["n"].shape == (2,)


def _collate_to_6(samples):
    return pad_collate(samples, pad_to=6)


def test_wire_format_keeps_every_object():
    batch = {
        "x": torch.arange(6, dtype=torch.float64).view(2, 3).t(),  # not contiguous
        "m": torch.tensor([True, False]),
        "s": torch.tensor(3),
        "e": torch.zeros(0, 4, dtype=torch.bfloat16),
        "a": np.arange(5, dtype=np.uint16),
        "text": ["a", None, {"k": 1}],
    }
    got = decode(encode([batch, batch["x"]]))
    for k in ("x", "m", "s", "e"):
        assert got[0][k].dtype == batch[k].dtype and torch.equal(got[0][k], batch[k]), k
    assert got[0]["a"].dtype == np.uint16 and np.array_equal(got[0]["a"], batch["a"])
    assert got[0]["text"] == batch["text"] and torch.equal(got[1], batch["x"])


# ---- token split of map-style batches, ranks simulated in one process
def _packed_hf(seq_len: int) -> datasets.Dataset:
    """Packed rows kept as an Arrow dataset (e.g. packed once and saved), read back map-style."""
    docs = [_tokens(i) for i in range(4 * N)]
    rows = pack_arrays(np.concatenate(docs), [len(d) for d in docs], seq_len)
    return datasets.Dataset.from_dict({k: v.tolist() for k, v in rows.items()})


@pytest.mark.parametrize("source", ["torch", "hf", "packed-hf"])
def test_map_style_balanced_token_split(source):
    ds = {"torch": Docs, "hf": _hf, "packed-hf": lambda: _packed_hf(8)}[source]()
    fields = ("input_ids", "position_ids", "document_ids") if source == "packed-hf" else ("input_ids", "labels")
    parts = {f: BALANCED for f in fields}
    whole = list(mesh_dataloader(ds, layout_topology({"dp": 1}, 0), global_batch_size=2, mode="eval"))
    loaders = [
        mesh_dataloader(ds, layout_topology({"dp": 1, "cp": 2}, r), global_batch_size=2, mode="eval", parts=parts)
        for r in range(2)
    ]
    runs = [list(ld) for ld in loaders]
    for full, b0, b1 in zip(whole, *runs):
        width = b0["input_ids"].shape[1] * 2
        assert width % 4 == 0 and 0 <= width - full["input_ids"].shape[1] < 4  # padded up to 2k chunks only
        pos = torch.cat([b0["positions"], b1["positions"]], 1)
        assert sorted(pos[0].tolist()) == list(range(width))
        for f in fields:
            fill = -100 if f == "labels" else 0
            padded = torch.nn.functional.pad(full[f], (0, width - full[f].shape[1]), value=fill)
            assert torch.equal(torch.cat([b0[f], b1[f]], 1), torch.gather(padded, 1, pos)), f
        assert torch.equal(b0["attention_mask"], full["attention_mask"])  # not in parts: whole
    part = loaders[1].parts["input_ids"]  # the last batch's parts; the dry run's hook gives them from shapes
    w = part.sample_shape[0]  # rank 1 of 2 holds chunks 1 and 2 of 4
    assert [(r[0].start, r[0].stop) for r in part.regions] == [(w // 4, w // 2), (w // 2, 3 * w // 4)]
    hook = loaders[1].parts_for({"input_ids": (7,), "attention_mask": (7,)})
    assert hook["input_ids"].sample_shape == (8,) and hook["input_ids"].shape == (4,)
    assert hook["attention_mask"].shape == (7,)
    plain = mesh_dataloader(ds, layout_topology({"dp": 1, "cp": 2}, 1), global_batch_size=2, mode="eval",
                            parts={"input_ids": Shard(0), "attention_mask": Replicate()})  # fmt: skip
    b = next(iter(plain))
    w = whole[0]["input_ids"].shape[1]
    assert torch.equal(b["input_ids"], whole[0]["input_ids"][:, -(-w // 2) :]) and "positions" not in b


# ---- one launch, two meshes: read strategies, training against one process across a resume, eval counts
TINY = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16)
G, TRAIN, HELD, LR = 4, 24, 10, 1e-2
STEPS, STOP = 3, 2  # the loader is rebuilt from its saved state after STOP steps: a mid-epoch resume
TOKEN_FIELDS = ("input_ids", "labels")


def _doc(i: int, seed: int) -> list[int]:
    return np.random.default_rng([seed, i]).integers(0, TINY["vocab_size"], 8 + i % 9).tolist()  # 8..16 tokens


class Windows(torch.utils.data.Dataset):
    """Documents of 8..16 tokens as already-shifted ``input_ids``/``labels`` (module level: it pickles)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        d = _doc(i, self.seed)
        return {"input_ids": d[:-1], "labels": d[1:]}


def _packed(docs: Windows) -> ArrayDataset:
    """Documents packed into rows of 17 tokens: input = the first 16, labels = the next (views of pack's arrays)."""
    rows = pack(docs, TINY["block_size"] + 1)
    a = {k: rows.sources[k].array for k in rows.names}
    return ArrayDataset(
        {
            "input_ids": a["input_ids"][:, :-1],
            "labels": a["input_ids"][:, 1:],
            "position_ids": a["position_ids"][:, :-1],
            "document_ids": a["document_ids"][:, :-1],
        }
    )


def _sources(root: str) -> dict[str, tuple]:
    """(train, held-out) of each kind: a torch Dataset, an Arrow dataset read back from disk, packed rows."""
    arrow = []
    for name, ds in (("train", Windows(TRAIN, 0)), ("held", Windows(HELD, 1))):
        path = f"{root}/{name}"
        if not os.path.exists(path):  # the test process writes the tables once
            rows = [ds[i] for i in range(len(ds))]
            datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in TOKEN_FIELDS}).save_to_disk(path)
        arrow.append(datasets.load_from_disk(path))
    return {
        "torch": (Windows(TRAIN, 0), Windows(HELD, 1)),
        "arrow": tuple(arrow),
        "packed": (_packed(Windows(64, 2)), _packed(Windows(24, 3))),
    }


def _global_batch(ds, idx: np.ndarray) -> dict:
    if isinstance(ds, ArrayDataset):
        return {k: torch.as_tensor(ds.sources[k].array[idx]) for k in TOKEN_FIELDS}
    return pad_collate([ds[int(i)] for i in idx])


def _model() -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(**TINY)).double()


@functools.cache
def _reference(train) -> tuple[list[float], dict]:
    """One process on the same global batches: each step's loss (mean over labels) and the final parameters."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for idx in MeshSampler(len(train), G, mode="train", seed=0).plan()[:STEPS]:
        b = _global_batch(train, idx)
        loss = torch.nn.functional.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _forward(model, batch):
    return model(batch["input_ids"], positions=batch.get("positions"))


def _train(topo, kind: str, train, read: str, parts) -> dict:
    """STOP steps, the loader rebuilt from its state (through JSON), STEPS - STOP more; against one process."""
    import json

    from ignite.engine import Events
    from torch.distributed.tensor.parallel import loss_parallel

    import meshwise
    from meshwise.parallel.context import context_parallel

    losses, params = _reference(train)
    model = _model()
    if parts:
        context_parallel(model, topo)
    tp = topo.sizes.get("tp", 1)
    model = meshwise.parallelize(model, topo, tp_plan=gpt.tp_plan if tp > 1 else None, fsdp_units=gpt.Block)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    seen: list[float] = []
    state = None
    for steps in (STOP, STEPS - STOP):
        loader = mesh_dataloader(train, topo, global_batch_size=G, seed=0, read=read, parts=parts)
        if state is not None:
            loader.load_state_dict(state)
        trainer = meshwise.create_trainer(
            model,
            opt,
            gpt.token_loss,
            topo,
            loss_weight="labels",
            step_context=loss_parallel if tp > 1 else None,
            forward=_forward,
            input_key="input_ids",
            target_key="labels",
        )
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.output))
        trainer.run(loader, max_iters=steps)
        state = json.loads(json.dumps(loader.state_dict()))
    return {
        "loss": max(abs(a - b) for a, b in zip(seen, losses, strict=True)),
        "param": max((_full(p) - params[n]).abs().max().item() for n, p in model.named_parameters()),
        "cursor": state["samples_consumed"],
        "model": model,
    }


def _eval_ids(topo, model, held, parts) -> list[int]:
    """Every held-out sample's index, gathered by an evaluator (padded rows left out, split ranks counted once)."""
    from torchmetrics import CatMetric

    import meshwise

    evaluator = meshwise.create_evaluator(
        model,
        topo,
        metrics={"ids": CatMetric()},
        forward=_forward,
        select=lambda out, b: (b["index"].double(),),
        split_inputs="whole",
    )
    loader = mesh_dataloader(held, topo, global_batch_size=G, mode="eval", parts=parts)
    return sorted(int(i) for i in evaluator.run(loader).metrics["ids"].tolist())


def _batches(topo, ds, mode: str, **kw) -> list[dict]:
    ld = mesh_dataloader(ds, topo, global_batch_size=G, mode=mode, seed=7, drop_last=False, **kw)
    return [{k: v.tolist() for k, v in b.items()} for b in ld]


def _phases(root: str) -> dict:
    import meshwise

    out: dict = {}
    # dp=2 x tp=2: tp is a replica dim, so the strategies share one read among the two tp ranks
    topo = meshwise.init({"dp": 2, "tp": 2}, timeout=30)
    sources = _sources(root)
    reads = {"torch": "scatter", "arrow": "broadcast", "packed": "scatter"}
    for kind, (train, held) in sources.items():
        t0, res = time.perf_counter(), {}
        for mode in ("train", "eval"):
            each = _batches(topo, train if mode == "train" else held, mode)
            res[mode] = each
            extra = [(reads[kind], 1)] if (kind, mode) == ("torch", "train") else []  # reads in a DataLoader worker
            for read, workers in [("broadcast", 0), ("scatter", 0), *extra]:
                got = _batches(topo, train if mode == "train" else held, mode, read=read, num_workers=workers)
                res[f"{mode} {read} {workers}"] = got == each
        trained = _train(topo, kind, train, reads[kind], None)
        res["held ids"] = _eval_ids(topo, trained.pop("model"), held, None)
        res["fit"] = trained
        res["seconds"] = time.perf_counter() - t0
        out[("dp2tp2", kind)] = res
    meshwise.shutdown()
    # dp=2 x cp=2: each cp rank gets the balanced chunks of every row, and the model attends across them
    topo = meshwise.init({"dp": 2, "cp": 2}, timeout=30)
    for kind, (train, held) in sources.items():
        fields = TOKEN_FIELDS + (("position_ids", "document_ids") if kind == "packed" else ())
        parts = {f: BALANCED for f in fields}
        t0 = time.perf_counter()
        res = {"fit": _train(topo, kind, train, "each", parts)}
        res["held ids"] = _eval_ids(topo, res["fit"].pop("model"), held, parts)
        if kind == "packed":  # pack()'s position_ids/document_ids come in the same balanced layout
            b = next(iter(mesh_dataloader(train, topo, global_batch_size=G, mode="eval", parts=parts)))
            rows = {f: torch.as_tensor(train.sources[f].array[b["index"].numpy()]) for f in fields}
            res["layout"] = all(torch.equal(b[f], rows[f].gather(1, b["positions"])) for f in fields)
        res["seconds"] = time.perf_counter() - t0
        out[("dp2cp2", kind)] = res
    meshwise.shutdown()
    # cp=2 x tp=2: the replica leader cuts its split rank's chunks before it sends them
    topo = meshwise.init({"cp": 2, "tp": 2}, timeout=30)
    parts = {f: BALANCED for f in TOKEN_FIELDS}
    for kind in ("torch", "arrow"):
        each = _batches(topo, sources[kind][1], "eval", parts=parts)
        same = [_batches(topo, sources[kind][1], "eval", parts=parts, read=r) == each for r in ("broadcast", "scatter")]
        out[("cp2tp2", kind)] = {"same": same, "positions": [b["positions"][0] for b in each]}
    meshwise.shutdown()
    return out


def test_map_style_sources_on_dp2_tp2_and_dp2_cp2(tmp_path):
    sources = _sources(str(tmp_path))  # writes the Arrow tables once, before the ranks read them
    res = run_distributed(_phases, 4, str(tmp_path), timeout=240)
    print({k: (round(v["seconds"], 2), v["fit"]["loss"], v["fit"]["param"]) for k, v in res[0].items() if "fit" in v})
    for kind in ("torch", "arrow"):  # cp=2 x tp=2: ranks 0, 1 are cp rank 0, ranks 2, 3 cp rank 1
        assert all(all(r[("cp2tp2", kind)]["same"]) for r in res), kind
        for p0, p1 in zip(res[0][("cp2tp2", kind)]["positions"], res[2][("cp2tp2", kind)]["positions"]):
            assert sorted(p0 + p1) == list(range(len(p0) * 2)) and len(p0) % 2 == 0
    for (mesh, kind), r0 in res[0].items():
        if mesh == "cp2tp2":
            continue
        assert r0["held ids"] == list(range(len(sources[kind][1]))), (mesh, kind)
        t = r0["fit"]
        assert t["loss"] <= 1e-12 and t["param"] <= 1e-12 and t["cursor"] == STEPS * G, (mesh, kind, t)
        if mesh == "dp2tp2":
            others = [r[(mesh, kind)] for r in res]
            for mode in ("train", "eval"):
                assert others[0][mode] == others[1][mode] and others[2][mode] == others[3][mode]  # tp peers
                seen = sorted(i for r in (0, 2) for b in others[r][mode] for i in b["index"] if i >= 0)
                total = len(sources[kind][0 if mode == "train" else 1])
                assert seen == list(range(total)), (kind, mode)
                flags = [(k, v) for r in others for k, v in r.items() if k.startswith(mode + " ")]
                assert len(flags) == 4 * (3 if (kind, mode) == ("torch", "train") else 2), (kind, flags)
                assert all(v for _, v in flags), (kind, flags)
        else:
            assert r0.get("layout", True)
