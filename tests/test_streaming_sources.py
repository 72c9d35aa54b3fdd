"""Streaming sources on the mesh: a torch IterableDataset and a datasets.IterableDataset; one dp=2 x tp=2 launch.

In-process checks run on a one-rank topology (or a dp=2 ``Topology`` built from a ``Layout`` where no collective
is reached); the launch checks disjoint coverage, tp peers, an exact resume, eval padding and the errors.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from meshwise.data import MeshStreamLoader, mesh_dataloader
from meshwise.environment import Environment
from meshwise.errors import DataError
from meshwise.layout import Layout
from meshwise.testing import run_distributed
from meshwise.topology import Topology

LENGTHS = (5, 3, 6, 4)  # samples per shard file: uneven shares per data rank


def layout_topology(mesh: dict, rank: int) -> Topology:
    """A real Topology for ``rank`` of ``mesh`` with no process group (enough where no collective is reached)."""
    world = int(np.prod(list(mesh.values())))
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    return Topology(Layout.resolve(mesh, world, None), env, torch.device("cpu"), "gloo", datetime.timedelta(30), None)


def _tokens(i: int) -> list[int]:
    return [100 * i + j for j in range(1 + (i * 7) % 5)]


class Counting(torch.utils.data.IterableDataset):
    """Samples 0..n-1 in order (module level: the launched ranks import it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"input_ids": _tokens(i), "id": i}


def write_shards(folder: Path, lengths=LENGTHS) -> list[str]:
    files, at = [], 0
    for k, n in enumerate(lengths):
        f = folder / f"shard{k}.jsonl"
        f.write_text("".join(json.dumps({"input_ids": _tokens(i), "id": i}) + "\n" for i in range(at, at + n)))
        files.append(str(f))
        at += n
    return files


def hf_stream(files: list[str]) -> datasets.IterableDataset:
    return datasets.load_dataset("json", data_files=files, streaming=True, split="train")


def ids(batches) -> list[list[int]]:
    return [[int(i) if v else -1 for i, v in zip(b["id"], b["valid"])] for b in batches]


# ---- in process (data size 1)
@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_stream_one_rank_batches_and_resume(tmp_path, kind):
    topo = layout_topology({"dp": 1}, 0)
    make = (lambda: Counting(18)) if kind == "torch" else (lambda: hf_stream(write_shards(tmp_path)))
    ld = mesh_dataloader(make(), topo, global_batch_size=4)
    assert isinstance(ld, MeshStreamLoader)
    full = list(ld)
    assert ids(full) == [list(range(4 * s, 4 * s + 4)) for s in range(4)]  # 18 samples: the partial 5th dropped
    for b in full:
        valid = b["valid"]
        assert b["input_ids"].dtype == torch.int64 and b["attention_mask"].shape == b["input_ids"].shape
        assert bool(valid.all())
    assert ids(list(ld)) == ids(full)  # a second pass reads the stream again from its start

    ld = mesh_dataloader(make(), topo, global_batch_size=4)
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    resumed = mesh_dataloader(make(), topo, global_batch_size=4)
    resumed.load_state_dict(state)
    assert ids(list(resumed)) == ids(full)[2:]

    ev = list(mesh_dataloader(make(), topo, global_batch_size=4, mode="eval"))
    last = ev[-1]
    assert ids(ev)[-1] == [16, 17, -1, -1] and last["index"].tolist() == [16, 17, -1, -1]
    assert torch.all(last["input_ids"][2:] == 0)


def test_stream_errors(tmp_path):
    one = layout_topology({"dp": 1}, 0)
    with pytest.raises(DataError, match="num_workers=0"):
        mesh_dataloader(Counting(4), one, global_batch_size=2, num_workers=1)
    with pytest.raises(DataError, match="mode='eval'"):
        mesh_dataloader(Counting(4), one, global_batch_size=2, drop_last=False)
    files = write_shards(tmp_path)
    # three shard files for two data ranks: each rank would read the whole stream, so ask for more files
    with pytest.raises(DataError, match="multiple of 2 shard files"):
        mesh_dataloader(hf_stream(files[:3]), layout_topology({"dp": 2}, 0), global_batch_size=2)
    ld = mesh_dataloader(Counting(8), one, global_batch_size=2)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    with pytest.raises(DataError, match="data size 1"):
        mesh_dataloader(Counting(8), layout_topology({"dp": 2}, 0), global_batch_size=2).load_state_dict(state)
    with pytest.raises(DataError, match="seed="):
        mesh_dataloader(Counting(8), one, global_batch_size=2, seed=3).load_state_dict(state)
    short = mesh_dataloader(Counting(1), one, global_batch_size=2)
    short.load_state_dict(state)
    with pytest.raises(DataError, match="past the end"):
        list(short)
    with pytest.raises(DataError, match="not a streaming"):
        ld.load_state_dict({"epoch": 0})


# ---- one launch: dp=2 x tp=2
def _stream_run(topo, files):
    out = {"data_rank": topo.data_rank}
    for name, make in (("torch", lambda: Counting(17)), ("hf", lambda: hf_stream(files))):
        res = {}
        res["train"] = ids(mesh_dataloader(make(), topo, global_batch_size=6))
        res["eval"] = ids(mesh_dataloader(make(), topo, global_batch_size=6, mode="eval"))
        ld = mesh_dataloader(make(), topo, global_batch_size=6)
        next(iter(ld))
        state = ld.state_dict()
        again = mesh_dataloader(make(), topo, global_batch_size=6)
        again.load_state_dict(state)
        res["resumed"] = ids(again)
        res["state"] = state
        out[name] = res
    try:  # another file list of the same shard count
        mesh_dataloader(hf_stream(files[:2]), topo, global_batch_size=6).load_state_dict(out["hf"]["state"])
        out["other_files"] = "no error"
    except DataError as exc:
        out["other_files"] = str(exc)
    return out


def test_stream_distributed(tmp_path):
    files = write_shards(tmp_path)
    res = run_distributed(_stream_run, 4, files, mesh={"dp": 2, "tp": 2}, timeout=90)
    by_dr = {}
    for r in res:
        state_free = {k: v for k, v in r.items() if k not in ("torch", "hf")}
        by_dr.setdefault(r["data_rank"], []).append((r, state_free))
    assert sorted(by_dr) == [0, 1]
    for peers in by_dr.values():  # tp peers see the same batches
        a, b = (p[0] for p in peers)
        for name in ("torch", "hf"):
            assert a[name]["train"] == b[name]["train"] and a[name]["eval"] == b[name]["eval"]
    r0, r1 = by_dr[0][0][0], by_dr[1][0][0]
    for name, total in (("torch", 17), ("hf", sum(LENGTHS))):
        flat = [[i for batch in r[name]["eval"] for i in batch if i >= 0] for r in (r0, r1)]
        assert sorted(flat[0] + flat[1]) == list(range(total))  # eval: every sample once
        assert not set(flat[0]) & set(flat[1])
        assert len(r0[name]["eval"]) == len(r1[name]["eval"])  # the shorter share padded, nobody hung
        for r in (r0, r1):
            assert len(r[name]["train"]) == 2  # both ranks stop when the shorter share runs out
            assert r[name]["resumed"] == r[name]["train"][1:]  # stop at step 1 + resume = an unbroken run
        assert r0[name]["state"] == r1[name]["state"]  # every data rank's position, the same on every rank
    assert r0["torch"]["eval"][-1] == [12, 14, 16] and r1["torch"]["eval"][-1] == [13, 15, -1]
    assert any(-1 in batch for r in (r0, r1) for batch in r["hf"]["eval"])
    assert "another source" in r0["other_files"]
    with pytest.raises(DataError, match="data size 2"):  # resume at another dp size
        mesh_dataloader(Counting(17), layout_topology({"dp": 1}, 0), global_batch_size=6).load_state_dict(
            r0["torch"]["state"]
        )
