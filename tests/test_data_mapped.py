"""Map-style sources on the mesh: torch Datasets and datasets.Dataset, pad_collate, pack; one dp=2 x tp=2 launch.

Rank views are simulated in one process where the loader needs no process group (read='each' over a
``Topology`` built from a ``Layout``); one real launch checks replica ranks, coverage, eval and resume.
"""

from __future__ import annotations

import datetime
import pickle
import threading

import datasets
import numpy as np
import pytest
import torch

from meshwise.data import ArrayDataset, MeshSampleLoader, Shard, mesh_dataloader, pack, pad_collate
from meshwise.data.packing import pack_arrays
from meshwise.environment import Environment
from meshwise.errors import DataError
from meshwise.layout import Layout
from meshwise.testing import run_distributed
from meshwise.topology import Topology

N = 13


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
    with pytest.raises(DataError, match="read='each'"):
        mesh_dataloader(Docs(), topo, global_batch_size=1, read="broadcast")
    with pytest.raises(DataError, match="pack"):
        mesh_dataloader(Docs(), topo, global_batch_size=1, parts={"input_ids": Shard(0)})
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


# ---- one real launch
def _mapped_run(topo):
    out = {}
    for name, ds in (("torch", Docs()), ("hf", _hf())):
        res = {}
        for mode in ("train", "eval"):
            ld = mesh_dataloader(ds, topo, global_batch_size=4, mode=mode, seed=7, drop_last=False)
            batches = list(ld)
            for b in batches:
                _check_batch(b)
            res[mode] = [{k: v.tolist() for k, v in b.items()} for b in batches]
        ld = mesh_dataloader(ds, topo, global_batch_size=4, seed=7)
        it = iter(ld)
        next(it), next(it)
        again = mesh_dataloader(ds, topo, global_batch_size=4, seed=7)
        again.load_state_dict(ld.state_dict())
        res["resume"] = ([b["index"].tolist() for b in it], [b["index"].tolist() for b in again])
        out[name] = res
    return out


def test_map_style_on_dp2_tp2_processes():
    res = run_distributed(_mapped_run, 4, mesh={"dp": 2, "tp": 2}, timeout=90)
    for name in ("torch", "hf"):
        for mode in ("train", "eval"):
            assert res[0][name][mode] == res[1][name][mode] and res[2][name][mode] == res[3][name][mode]
            seen = [i for r in (0, 2) for b in res[r][name][mode] for i in b["index"] if i >= 0]
            assert sorted(seen) == list(range(N)), (name, mode)
        for r in res:
            rest, resumed = r[name]["resume"]
            assert rest == resumed and rest
