"""MeshSampler properties over dataset length, mesh, global batch, seed and mode; resume; bad input.

Every rank's view is simulated in one process: the sampler needs only (data_rank, data_size), and the
loader a real ``Topology`` built from a ``Layout`` without a process group.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshwise.data import ArrayDataset, MeshSampler, mesh_dataloader
from meshwise.environment import Environment
from meshwise.errors import DataError, MeshwiseError
from meshwise.layout import Layout
from meshwise.topology import Topology

# derandomize: CI sees the same examples every run (explore locally with more examples and derandomize=False)
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def layout_topology(mesh: dict, rank: int, roles: dict | None = None) -> Topology:
    """A real Topology for ``rank`` of ``mesh`` with no process group (enough for read='each')."""
    world = int(np.prod(list(mesh.values())))
    layout = Layout.resolve(mesh, world, roles)
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    return Topology(layout, env, torch.device("cpu"), "gloo", datetime.timedelta(seconds=30), None)


def run_epoch(samplers: list[MeshSampler]) -> list[list[np.ndarray]]:
    """Each sampler's local batches for the rest of its epoch."""
    return [list(s) for s in samplers]


def samplers_for(n, gbs, data_size, **kw) -> list[MeshSampler]:
    return [MeshSampler(n, gbs, data_rank=r, data_size=data_size, **kw) for r in range(data_size)]


config = st.fixed_dictionaries(
    {
        "n": st.integers(1, 60),
        "data_size": st.integers(1, 5),
        "local": st.integers(1, 6),
        "seed": st.integers(0, 2**31),
        "mode": st.sampled_from(["train", "eval"]),
        "drop_last": st.booleans(),
        "epoch": st.integers(0, 3),
    }
)


@SETTINGS
@given(config)
def test_ranks_disjoint_cover_epoch_same_steps(c):
    n, ds, gbs = c["n"], c["data_size"], c["local"] * c["data_size"]
    drop = c["drop_last"] and c["mode"] == "train"
    if drop and n < gbs:
        with pytest.raises(DataError, match="fewer than one global batch"):
            MeshSampler(n, gbs, data_size=ds, mode=c["mode"], drop_last=c["drop_last"])
        return
    samplers = samplers_for(n, gbs, ds, mode=c["mode"], seed=c["seed"], drop_last=c["drop_last"])
    for s in samplers:
        s.set_epoch(c["epoch"])
    per_rank = run_epoch(samplers)
    steps = {len(b) for b in per_rank}
    assert steps == {len(samplers[0])}, "every data rank runs the same number of steps"
    expected_steps = n // gbs if drop else -(-n // gbs)
    assert len(samplers[0]) == expected_steps
    seen = []
    for step in range(expected_steps):
        glob = np.concatenate([per_rank[r][step] for r in range(ds)])
        assert len(glob) == gbs and all(len(per_rank[r][step]) == c["local"] for r in range(ds))
        pad = glob < 0
        assert not np.any(np.diff(pad.astype(int)) < 0), "padding only at the end of the global batch"
        assert np.all(glob[pad] == -1)
        seen.extend(glob[~pad].tolist())
    assert len(seen) == len(set(seen)), "no sample twice in an epoch (data ranks disjoint)"
    if drop:
        assert len(seen) == expected_steps * gbs
    else:
        assert sorted(seen) == list(range(n)), "every sample exactly once"
    if c["mode"] == "eval":
        assert seen == list(range(n))
    else:  # one permutation per (seed, epoch) shared by every data size
        ref = MeshSampler(n, gbs, mode="train", seed=c["seed"], drop_last=c["drop_last"])
        assert seen == ref.order(c["epoch"])[: len(seen)].tolist()
        again = MeshSampler(n, gbs, data_size=ds, mode="train", seed=c["seed"], drop_last=c["drop_last"])
        assert np.array_equal(again.order(c["epoch"]), ref.order(c["epoch"]))
    # after the epoch the cursor sits at the start of the next one
    assert all(s.consumed == 0 for s in samplers)
    assert all(s.epoch == c["epoch"] + (c["mode"] == "train") for s in samplers)


@SETTINGS
@given(
    st.integers(1, 3),
    st.integers(1, 2),
    st.integers(1, 2),
    st.integers(1, 40),
    st.integers(1, 4),
    st.sampled_from(["train", "eval"]),
    st.integers(0, 99),
)
def test_replica_and_split_ranks_get_identical_indices(dp, cp, tp, n, local, mode, seed):
    mesh = {"dp": dp, "cp": cp, "tp": tp}
    gbs = local * dp
    if mode == "train" and n < gbs:
        return
    views = {}
    for rank in range(dp * cp * tp):
        topo = layout_topology(mesh, rank)
        s = MeshSampler.from_topology(topo, n, gbs, mode=mode, seed=seed)
        views[rank] = (topo.data_rank, [b.tolist() for b in s])
    by_data_rank: dict[int, list] = {}
    for data_rank, batches in views.values():
        by_data_rank.setdefault(data_rank, []).append(batches)
    assert sorted(by_data_rank) == list(range(dp))
    for group in by_data_rank.values():
        assert len(group) == cp * tp and all(g == group[0] for g in group)
    assert len({len(b) for _, b in views.values()}) == 1


@SETTINGS
@given(config, st.integers(0, 20), st.integers(1, 5), st.integers(1, 6))
def test_resume_same_and_other_data_size(c, stop, new_ds, new_local):
    n, ds, gbs = c["n"], c["data_size"], c["local"] * c["data_size"]
    kw = dict(mode=c["mode"], seed=c["seed"], drop_last=c["drop_last"])
    drop = c["drop_last"] and c["mode"] == "train"
    if drop and n < gbs:
        return
    full = run_epoch(samplers_for(n, gbs, ds, **kw))
    stop = min(stop, len(full[0]) - 1)
    first = samplers_for(n, gbs, ds, **kw)
    consumed = []
    for s in first:
        it = iter(s)
        for _ in range(stop):
            consumed.extend(b for b in next(it).tolist() if b >= 0)
    states = [s.state_dict() for s in first]
    assert all(st_ == states[0] for st_ in states), "the cursor is global: the same on every rank"
    assert states[0]["samples_consumed"] == stop * gbs
    # same mesh: identical remaining batches
    again = samplers_for(n, gbs, ds, **{**kw, "seed": c["seed"] + 1})  # the saved seed wins
    for s in again:
        s.load_state_dict(states[0])
    remaining = run_epoch(again)
    assert [[b.tolist() for b in r] for r in remaining] == [[b.tolist() for b in r[stop:]] for r in full]
    # another data-parallel size (and global batch): the rest of the epoch, each sample once
    gbs2 = new_ds * new_local
    if drop and n < gbs2:
        return
    other = samplers_for(n, gbs2, new_ds, **kw)
    for s in other:
        s.load_state_dict(states[0])
    if drop and (n - stop * gbs) // gbs2 == 0:  # no full new batch left: the cursor moves to the next epoch
        assert all(s.epoch == 1 and s.consumed == 0 for s in other)
        return
    rest = [i for r in zip(*run_epoch(other)) for b in r for i in b.tolist() if i >= 0]
    assert len(rest) == len(set(rest)) and not set(rest) & set(consumed)
    order = first[0].order(0).tolist()
    if drop:
        left = n - stop * gbs
        assert rest == order[stop * gbs : stop * gbs + (left // gbs2) * gbs2]
    else:
        assert sorted(consumed + rest) == list(range(n))
        assert rest == order[stop * gbs :]


def _loader(n=23, dp=2, rank=0, **kw):
    x = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)
    ds = ArrayDataset({"input": x, "target": np.arange(n, dtype=np.int64)})
    return mesh_dataloader(ds, layout_topology({"dp": dp}, rank), **kw), x


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_counts_handed_batches(num_workers):
    for mode in ("train", "eval"):
        for rank in range(2):
            ref, x = _loader(rank=rank, global_batch_size=4, mode=mode, drop_last=False)
            full = [{k: v.clone() for k, v in b.items()} for b in ref]
            ld, _ = _loader(rank=rank, global_batch_size=4, mode=mode, drop_last=False, num_workers=num_workers)
            it = iter(ld)
            for _ in range(3):
                next(it)  # the workers have prefetched more; the state counts only these three
            state = ld.state_dict()
            del it
            assert state["samples_consumed"] == 12 and state["epoch"] == 0
            resumed, _ = _loader(rank=rank, global_batch_size=4, mode=mode, drop_last=False, num_workers=num_workers)
            resumed.load_state_dict(state)
            rest = list(resumed)
            assert len(rest) == len(full) - 3
            for a, b in zip(rest, full[3:]):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                v = a["valid"]
                assert torch.equal(a["input"][v], torch.from_numpy(x[a["index"][v].numpy()]))
                assert torch.all(a["input"][~v] == 0) and torch.all(a["index"][~v] == -1)
            assert resumed.bytes_read == sum(int(b["valid"].sum()) for b in rest) * (6 * 4 + 8)


def test_epochs_and_set_epoch():
    ld, _ = _loader(global_batch_size=4, mode="train", seed=3)
    assert len(ld) == 5
    e0 = [b["index"].tolist() for b in ld]
    e1 = [b["index"].tolist() for b in ld]  # a full pass moves to the next epoch
    assert e0 != e1 and ld.state_dict()["epoch"] == 2
    ld.set_epoch(0)
    assert [b["index"].tolist() for b in ld] == e0
    ld.set_epoch(1)
    it = iter(ld)
    next(it)
    ld.set_epoch(1)  # the current epoch keeps its cursor (e.g. after a resume)
    assert ld.state_dict()["samples_consumed"] == 4


def test_bad_input():
    with pytest.raises(DataError, match="not divisible by the data size 3"):
        MeshSampler(30, 8, data_size=3)
    with pytest.raises(DataError, match="fewer than one global batch"):
        MeshSampler(5, 8, data_size=2, mode="train", drop_last=True)
    MeshSampler(5, 8, data_size=2, mode="train", drop_last=False)
    MeshSampler(5, 8, data_size=2, mode="eval")
    with pytest.raises(DataError, match="mode"):
        MeshSampler(5, 2, mode="test")
    s = MeshSampler(10, 2)
    state = MeshSampler(11, 2).state_dict()
    with pytest.raises(DataError, match="dataset of 11 samples, this one has 10"):
        s.load_state_dict(state)
    with pytest.raises(DataError, match="mode 'eval'"):
        s.load_state_dict(MeshSampler(10, 2, mode="eval").state_dict())
    with pytest.raises(DataError, match="global batch 6 is not divisible by the data size 4"):
        _loader(dp=4, global_batch_size=6)
    ld, _ = _loader(global_batch_size=4)
    with pytest.raises(MeshwiseError, match="dataset of 24 samples"):
        ld.load_state_dict(_loader(n=24, global_batch_size=4)[0].state_dict())
    with pytest.raises(DataError, match="reserved"):
        ArrayDataset({"valid": np.zeros(3)})
    with pytest.raises(DataError, match="different numbers of samples"):
        ArrayDataset({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(DataError, match="read must be one of"):
        _loader(global_batch_size=4, read="gather")
