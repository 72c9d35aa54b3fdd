"""A loader iterated again continues from its position: a `break` and a new `for`, ignite's run() called again.

Every loader kind (arrays, a map-style torch Dataset, a torch IterableDataset, a ``datasets`` stream; no workers
and two DataLoader workers) is read the way users read it: a `for` loop broken after a few batches and a new
`for` loop, and a trainer whose ``run(max_iters=2)`` is followed by ``run(max_iters=4)`` on the same engine,
saved (model, optimizer, engine, loader state dicts, what a Checkpointer saves) and resumed in a fresh script.
Each must see exactly the samples of one uninterrupted pass (sample ids) and train the same float64 parameters,
with the saved position matching the samples handed out. In one process, and at dp=2 in one launch.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from meshwise.data import ArrayDataset, mesh_dataloader
from meshwise.environment import Environment
from meshwise.errors import DataError
from meshwise.layout import Layout
from meshwise.testing import run_distributed
from meshwise.topology import Topology

N = 40  # samples; a global batch of 4 gives 10 steps a pass, 5 at dp=2 per rank's share of a stream
KINDS = ("arrays", "map", "torch-stream", "hf-stream")


def layout_topology(mesh: dict, rank: int) -> Topology:
    """A real Topology for ``rank`` of ``mesh`` with no process group (enough where no collective is reached)."""
    world = int(np.prod(list(mesh.values())))
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    return Topology(Layout.resolve(mesh, world, None), env, torch.device("cpu"), "gloo", datetime.timedelta(30), None)


def sample(i: int) -> dict:
    return {"input": [i % 7, i % 5, i % 3], "target": [i % 4, i % 3], "id": i}


class Samples(torch.utils.data.Dataset):
    """A user's map-style dataset (module level: workers and launched ranks import it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return sample(i)


class Stream(torch.utils.data.IterableDataset):
    """A user's stream: samples 0..n-1 in order, the same on every pass and rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield sample(i)


def write_shards(folder: str, n: int = N, files: int = 4) -> list[str]:
    paths = []
    for k in range(files):
        path = Path(folder) / f"part{k}.jsonl"
        path.write_text("".join(json.dumps(sample(i)) + "\n" for i in range(k * n // files, (k + 1) * n // files)))
        paths.append(str(path))
    return paths


def make_loader(kind: str, topo, folder: str, workers: int = 0, gbs: int = 4):
    if kind == "arrays":
        rows = [sample(i) for i in range(N)]
        source = ArrayDataset({k: np.array([r[k] for r in rows], dtype=np.int64) for k in ("input", "target", "id")})
    elif kind == "map":
        source = Samples(N)
    elif kind == "torch-stream":
        source = Stream(N)
    else:
        source = datasets.load_dataset("json", data_files=write_shards(folder), streaming=True, split="train")
    return mesh_dataloader(source, topo, global_batch_size=gbs, seed=1, num_workers=workers)


def ids(batch) -> list[int]:
    return [int(i) for i, v in zip(batch["id"], batch["valid"]) if v]


# ---- a `for` loop, a `break`, a new `for` loop
def break_and_new_for(kind: str, topo, folder: str, workers: int) -> dict:
    """Two passes read with breaks and new loops, against two uninterrupted passes; the position at each break."""
    whole = make_loader(kind, topo, folder, workers)
    unbroken = [ids(b) for _ in range(2) for b in whole]
    loader = make_loader(kind, topo, folder, workers)
    seen, positions = [], []
    for stop in (2, 1, 3, 100, 4):  # the 4th loop ends the first pass; the 5th reads into the second
        for i, batch in enumerate(loader):
            seen.append(ids(batch))
            if i + 1 == stop:
                break
        # the position says what was handed out: a fresh loader resumed from it reads the rest of this pass
        state = loader.state_dict()
        fresh = make_loader(kind, topo, folder, workers)
        fresh.load_state_dict(state)
        positions.append([ids(b) for b in fresh])
    for batch in loader:  # the rest of the second pass
        seen.append(ids(batch))
    # a resume at a break reads the rest of the pass it was in (at a pass's end: the whole next pass)
    steps = len(unbroken) // 2
    rests = [unbroken[at : (at // steps + 1) * steps] for at in (2, 3, 6, steps, steps + 4)]
    return {"unbroken": unbroken, "seen": seen, "positions": positions, "rests": rests}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_break_and_new_for_continues(tmp_path, kind, workers):
    got = break_and_new_for(kind, layout_topology({"dp": 1}, 0), str(tmp_path), workers)
    assert got["seen"] == got["unbroken"]  # no sample twice, none skipped
    assert len(got["unbroken"]) == 20 and sorted(sum(got["unbroken"][:10], [])) == list(range(N))
    assert got["positions"] == got["rests"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_older_iterator_refuses_and_set_epoch_ends_it(tmp_path, kind):
    loader = make_loader(kind, layout_topology({"dp": 1}, 0), str(tmp_path))
    first = iter(loader)
    a = ids(next(first))
    second = iter(loader)  # continues from the position
    b = ids(next(second))
    with pytest.raises(DataError, match="superseded"):
        next(first)  # it would hand out what `second` hands out (or skip it)
    unbroken = [ids(x) for x in make_loader(kind, layout_topology({"dp": 1}, 0), str(tmp_path))]
    assert [a, b, ids(next(second))] == unbroken[:3]
    loader.set_epoch(5)  # a reset position: the iterator that was reading ends, the next starts epoch 5
    assert list(second) == []
    assert len(list(loader)) == 10


# ---- ignite: run() called again on the same engine, then a resume in a fresh script
def _script(kind, topo, folder, workers, runs, state=None):
    """A user's training script: create_trainer, trainer.run(loader, max_iters=m) for each m of ``runs``."""
    from ignite.engine import Events

    import meshwise

    torch.manual_seed(0)
    model = meshwise.parallelize(torch.nn.Linear(3, 2, dtype=torch.float64), topo)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = meshwise.create_trainer(
        model,
        opt,
        lambda out, target: torch.nn.functional.mse_loss(out, target.double()),
        topo,
        forward=lambda m, batch: m(batch["input"].double()),
    )
    loader = make_loader(kind, topo, folder, workers)
    if state is not None:  # what a Checkpointer's load does with each object
        for obj, key in ((model, "model"), (opt, "opt"), (trainer, "engine"), (loader, "loader")):
            obj.load_state_dict(state[key])
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(ids(e.state.batch)))
    for m in runs:
        trainer.run(loader, max_iters=m)
    saved = {"model": model, "opt": opt, "engine": trainer, "loader": loader}
    return seen, {k: v.state_dict() for k, v in saved.items()}


def run_twice_and_resume(kind: str, topo, folder: str, workers: int) -> dict:
    unbroken, end = _script(kind, topo, folder, workers, [7])
    twice, state = _script(kind, topo, folder, workers, [2, 4])
    resumed, end2 = _script(kind, topo, folder, workers, [7], state=state)
    full = {k: _full(end["model"][k]) for k in end["model"]}
    diff = max(float((full[k] - _full(end2["model"][k])).abs().max()) for k in full)
    return {"unbroken": unbroken, "broken": twice + resumed, "diff": diff, "moved": float(full["bias"].abs().sum())}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a sharded parameter (FSDP2 at dp=2) whole


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_ignite_run_again_then_resume_equals_one_run(tmp_path, kind, workers):
    got = run_twice_and_resume(kind, layout_topology({"dp": 1}, 0), str(tmp_path), workers)
    assert len(got["unbroken"]) == 7 and got["broken"] == got["unbroken"]
    assert got["diff"] <= 1e-12 and got["moved"] != 0.0


def _counted(kind, topo, folder, plan) -> tuple[list, int]:
    """(epoch, iteration, sample ids) of each step of an engine run as ``plan`` says, and the learnt length."""
    from ignite.engine import Events

    from meshwise.engine.trainer import MeshEngine

    loader = make_loader(kind, topo, folder, gbs=8)  # 5 steps a pass
    seen = []
    engine = MeshEngine(lambda e, batch: seen.append((e.state.epoch, e.state.iteration, ids(batch))))
    for stop, run in plan:
        handler = engine.add_event_handler(Events.ITERATION_COMPLETED(once=stop), lambda e: e.terminate())
        engine.run(loader, **run)
        handler.remove()
    return seen, engine.state.epoch_length


@pytest.mark.parametrize("kind", KINDS)
def test_ignite_run_again_across_the_end_of_a_pass(tmp_path, kind):
    """Runs stopped inside a pass (terminate(), max_iters; once exactly at a pass's last batch) and run again.

    Each run again goes on in the epoch it stopped in, as a resume from its state_dict would: the epochs,
    iterations and samples of one unbroken run, and a stream's length learnt whole (not from the run again on).
    """
    topo, folder = layout_topology({"dp": 1}, 0), str(tmp_path)
    never = 10**6
    unbroken, length = _counted(kind, topo, folder, [(never, {"max_epochs": 3})])
    epochs, length2 = _counted(
        kind, topo, folder, [(2, {"max_epochs": 2}), (never, {"max_epochs": 2}), (never, {"max_epochs": 3})]
    )
    assert len(unbroken) == 15 and epochs == unbroken and length == length2 == 5
    iters, length3 = _counted(kind, topo, folder, [(never, {"max_iters": m}) for m in (2, 4, 5, 7, 12, 15)])
    assert iters == unbroken and length3 == 5


# ---- dp=2: the same checks in one launch
def _at_dp2(topo, folder: str) -> dict:
    out = {}
    for kind in KINDS:
        for workers in (0, 2):
            out[f"for {kind} {workers}"] = break_and_new_for(kind, topo, folder, workers)
            out[f"run {kind} {workers}"] = run_twice_and_resume(kind, topo, folder, workers)
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reiterate")
    write_shards(str(folder))
    return run_distributed(_at_dp2, 2, str(folder), mesh={"dp": 2}, timeout=240)


def test_dp2_break_and_new_for_continues(dp2):
    for rank, got in enumerate(dp2):
        for kind in KINDS:
            for workers in (0, 2):
                r = got[f"for {kind} {workers}"]
                assert r["seen"] == r["unbroken"], (rank, kind, workers)
                assert r["positions"] == r["rests"], (rank, kind, workers)
    for kind in KINDS:  # the two data ranks read disjoint halves of every pass
        first = [set(sum(got[f"for {kind} 0"]["unbroken"][:10], [])) for got in dp2]
        assert not first[0] & first[1] and first[0] | first[1] == set(range(N)), kind


def test_dp2_ignite_run_again_then_resume_equals_one_run(dp2):
    for rank, got in enumerate(dp2):
        for kind in KINDS:
            for workers in (0, 2):
                r = got[f"run {kind} {workers}"]
                assert len(r["unbroken"]) == 7 and r["broken"] == r["unbroken"], (rank, kind, workers)
                assert r["diff"] <= 1e-12 and r["moved"] != 0.0, (rank, kind, workers)


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_dropped_mid_pass_in_a_cycle_stops_its_workers_cleanly(tmp_path, kind):
    """A loader an ignite engine holds (a reference cycle) and dropped mid-pass: the cycle collector frees it.

    Its DataLoader workers must get their stop message and exit at once. When the collector closed torch's worker
    queues before the iterator's ``__del__`` ran, the stop message was never sent, and the collection waited out
    torch's join timeout (``MP_STATUS_CHECK_INTERVAL``, 5 s) for each worker: that wait is what is checked, with
    the timeout itself as the bound (a clean stop takes about 0.3 s here).
    """
    import gc
    import multiprocessing
    import time

    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

    before = set(multiprocessing.active_children())
    loader = make_loader(kind, layout_topology({"dp": 1}, 0), str(tmp_path), workers=2)
    loader.cycle = {"loader": loader}  # what an engine's state and handlers make of it
    it = iter(loader)
    next(it)
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2, kind
    del loader, it
    start = time.monotonic()
    gc.collect()
    assert time.monotonic() - start < MP_STATUS_CHECK_INTERVAL, f"{kind}: the collection waited for the workers"
    for p in workers:
        p.join(timeout=60)
    assert [p.exitcode for p in workers] == [0, 0], kind
