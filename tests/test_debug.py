"""No silent hangs: deliberately broken programs on 4 gloo processes end fast with errors that name the mesh dim.

Every scenario returns what each rank saw (message, seconds); the assertions run here, in the parent.
Between scenarios the ranks meet on the store (not a collective), so a rank that is "elsewhere" is
somewhere known, and a fresh ``meshwise.init`` gives every scenario clean groups.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshwise
from meshwise.debug import guarded
from meshwise.debug.crash import read_report
from meshwise.testing import CollectiveCounter, DistributedFailure, run_command, run_distributed

REAL_ALL_REDUCE = dist.all_reduce  # imported before any init: torch's own
MESH = {"dp": 2, "tp": 2}  # dp groups [0, 2] and [1, 3]; tp groups [0, 1] and [2, 3]
TIMEOUT = 3.0


def _meet(topo, name: str) -> None:
    """Wait for every rank on the store: no collective, so it works after a broken one."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/{name}/{topo.rank}", "1")
    store.wait([f"test/{name}/{r}" for r in range(topo.world_size)], datetime.timedelta(seconds=60))


def _attempt(fn):
    """(error type, message, seconds) of ``fn()``; (None, result, seconds) when it worked."""
    start = time.monotonic()
    try:
        out = fn()
    except meshwise.MeshwiseError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, out, time.monotonic() - start


def _reduce(dims, t):
    topo = meshwise.current()
    dist.all_reduce(t, group=topo.group(dims))
    return t.tolist()


# --------------------------------------------------------------------------- debug mode


def _debug_scenarios(run_dir: str) -> dict:
    out: dict = {"pid": os.getpid()}
    topo = meshwise.init(MESH, timeout=TIMEOUT, debug=True, run_dir=run_dir)
    rank = topo.rank
    out["wrapped"] = dist.all_reduce is not REAL_ALL_REDUCE

    # Correct programs give the plain results through the wrapper.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=topo.group("dp"))
    gathered = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=topo.group("tp"))
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=0)
    dist.barrier()
    out["ok"] = [t.item(), [g.item() for g in gathered], b.item()]

    # A different op on one rank: rank 3 broadcasts where rank 1 all-reduces (dp group [1, 3]).
    def different_op():
        x = torch.ones(4)
        if rank == 3:
            dist.broadcast(x, group=topo.group("dp"), group_src=0)
        else:
            dist.all_reduce(x, group=topo.group("dp"))
        return x.tolist()

    out["op"] = _attempt(different_op)
    # A different shape: rank 2 holds 5 values where rank 0 holds 4 (dp group [0, 2]).
    out["shape"] = _attempt(lambda: _reduce("dp", torch.ones(5 if rank == 2 else 4)))
    # Nothing was sent, so the groups still work.
    out["after"] = _reduce("dp", torch.ones(1))
    _meet(topo, "mismatch")
    meshwise.shutdown()

    # An all-reduce on tp where the peers use dp: rank 3 is in tp group [2, 3], rank 1 waits on dp [1, 3].
    topo = meshwise.init(MESH, timeout=TIMEOUT, debug=True, run_dir=run_dir)
    out["tp_vs_dp"] = _attempt(lambda: _reduce("tp" if rank == 3 else "dp", torch.ones(2)))
    _meet(topo, "tp_vs_dp")
    meshwise.shutdown()

    # A rank that skips a metric compute() (metric dims: dp): rank 2 never comes.
    topo = meshwise.init(MESH, timeout=TIMEOUT, debug=True, run_dir=run_dir)
    out["skip"] = _attempt(lambda: _metric_compute(topo, skip=rank == 2))
    _meet(topo, "skip")
    meshwise.shutdown()
    out["unwrapped"] = dist.all_reduce is REAL_ALL_REDUCE
    return out


def _metric_compute(topo, skip: bool):
    from torchmetrics import SumMetric

    from meshwise.metrics import MeshMetric

    metric = MeshMetric(SumMetric(), topo)
    metric.update(torch.tensor([float(topo.rank)]))
    return None if skip else float(metric.compute())


def test_debug_mode_names_mismatches_and_missing_ranks(tmp_path):
    results = run_distributed(_debug_scenarios, 4, timeout=120, env={"MESHWISE_DEBUG": "0"}, run_dir=str(tmp_path))
    assert all(r["wrapped"] and r["unwrapped"] for r in results)
    tp_groups = [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    assert [r["ok"] for r in results] == [[s, g, 0.0] for s, g in zip([2.0, 4.0, 2.0, 4.0], tp_groups)]

    # Different op: both ranks of dp group [1, 3] raise before anything is sent; [0, 2] is unaffected.
    assert results[0]["op"][0] is None and results[2]["op"][0] is None
    for r in (1, 3):
        kind, msg, seconds = results[r]["op"]
        assert kind == "CollectiveMismatchError" and seconds < 2
        assert "dp (batch) group [1, 3]" in msg and "different op" in msg
        assert "rank 1 (dp=0, tp=1): all_reduce(op=SUM) float32[4] over dp (batch)" in msg
        assert "rank 3 (dp=1, tp=1): broadcast(group_src=0) float32[4] over dp (batch)" in msg
        assert re.search(r"test_debug.py:\d+ in different_op", msg)  # each rank's call site
    # Different shape: dp group [0, 2].
    for r in (0, 2):
        kind, msg, _ = results[r]["shape"]
        assert kind == "CollectiveMismatchError" and "different shapes" in msg
        assert "rank 2 (dp=1, tp=0): all_reduce(op=SUM) float32[5]" in msg
    assert results[1]["shape"][0] is None and results[3]["shape"][0] is None
    assert [r["after"] for r in results] == [[2.0]] * 4

    # tp where the peers use dp: rank 1 is told where rank 3 is instead, and rank 3 is told about rank 2.
    assert results[0]["tp_vs_dp"][0] is None and results[2]["tp_vs_dp"][0] is None
    kind, msg, seconds = results[1]["tp_vs_dp"]
    assert kind == "CollectiveTimeoutError" and TIMEOUT <= seconds < TIMEOUT + 5
    assert "over dp (batch), group [1, 3]" in msg and "ranks [3] did not arrive" in msg
    assert "rank 3 (dp=1, tp=1) is in all_reduce(op=SUM) float32[2] over tp (replica), group [2, 3]" in msg
    kind, msg, seconds = results[3]["tp_vs_dp"]
    assert kind == "CollectiveTimeoutError" and seconds < TIMEOUT + 5
    assert "over tp (replica), group [2, 3]" in msg and "ranks [2] did not arrive" in msg
    assert "rank 2 (dp=1, tp=0) is in no meshwise collective after all_reduce(op=SUM) float32[2] over dp" in msg
    _assert_stacks(msg, "_debug_scenarios", {2: "in _meet"})  # rank 2 waits there, not in a collective

    # A skipped compute(): rank 0 waits on dp group [0, 2] and is told rank 2 never came.
    kind, msg, seconds = results[0]["skip"]
    assert kind == "MetricSyncTimeout" and TIMEOUT <= seconds < TIMEOUT + 5
    assert "metric all_reduce float64[1] over dp (batch), group [0, 2]" in msg
    assert "ranks [2] did not arrive: rank 2 (dp=1, tp=0) is in no meshwise collective and has made none yet" in msg
    assert results[2]["skip"][:2] == (None, None)
    # Debug mode also checks that tp replicas agree, so ranks 1 and 3 wait on their tp partners 0 and 2.
    kind, msg, seconds = results[1]["skip"]
    assert kind == "MetricSyncTimeout" and TIMEOUT <= seconds < TIMEOUT + 5
    assert "metric replica check float64[1] over tp (replica), group [0, 1]" in msg
    assert "rank 0 (dp=0, tp=0) is in metric all_reduce float64[1] over dp (batch), group [0, 2]" in msg
    _assert_gone(results)


def _assert_stacks(message: str, function: str, expected: dict[int, str]) -> None:
    """The message names a folder with one stack file per rank, each showing the main thread in ``function``."""
    folder = Path(re.search(r"Python stacks of every rank: (\S+)\. ", message).group(1))
    files = sorted(folder.glob("rank-*.txt"))
    assert [f.name for f in files] == [f"rank-{r:05d}.txt" for r in range(4)]
    for rank, f in enumerate(files):
        text = f.read_text()
        assert "--- thread MainThread" in text and "meshwise watchdog" in text and function in text
        assert expected.get(rank, "") in text, text


def _assert_gone(results) -> None:
    """No rank process is left: each pid is gone (or a zombie about to be reaped) within a few seconds."""
    deadline = time.monotonic() + 5
    for pid in (r["pid"] for r in results):
        while Path(f"/proc/{pid}").exists() and "State:\tZ" not in _status(pid):
            assert time.monotonic() < deadline, f"rank process {pid} is still running"
            time.sleep(0.1)


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "State:\tZ"


# --------------------------------------------------------------------------- debug off: the watchdog


def _watchdog_scenarios(run_dir: str) -> dict:
    out: dict = {"pid": os.getpid()}
    topo = meshwise.init(MESH, timeout=TIMEOUT, run_dir=f"{run_dir}/skip")
    rank = topo.rank
    out["plain"] = dist.all_reduce is REAL_ALL_REDUCE
    # An error that is not a collective's (here a DataLoader's) passes through a guarded step unchanged, at once.
    start = time.monotonic()
    try:
        with guarded(topo, topo.dims, "trainer step", step=1, region=True):
            raise RuntimeError("DataLoader worker (pid 123) timed out after 5 seconds")
    except RuntimeError as exc:
        out["user_error"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    out["skip"] = _attempt(lambda: _metric_compute(topo, skip=rank == 2))
    _meet(topo, "skip")
    meshwise.shutdown()

    # A region that outlives the timeout without an error (what an asynchronous NCCL hang looks like).
    topo = meshwise.init(MESH, timeout=2.0, run_dir=f"{run_dir}/stall")
    if rank == 1:
        with guarded(topo, "dp", "slow op", step=7):
            time.sleep(4.0)
    _meet(topo, "stall")
    meshwise.shutdown()

    # An evaluation that rank 3 leaves after one step: its tp partner, rank 2, is told so at step 2.
    topo = meshwise.init(MESH, timeout=TIMEOUT, run_dir=f"{run_dir}/eval")
    trainer, loader = _trainer(topo, mode="eval")  # the evaluator refuses a training loader
    # "+ 0" waits for the tensor-parallel all-reduce inside the step (it is asynchronous until used)
    evaluator = meshwise.create_evaluator(trainer.model, topo, forward=lambda m, b: m(b["input"]) + 0)
    steps = 1 if rank == 3 else 2
    out["eval"] = _attempt(lambda: evaluator.run(loader, max_epochs=1, epoch_length=steps).iteration)
    _meet(topo, "eval")
    meshwise.shutdown()

    # A rank that exits: rank 2 leaves after 2 steps of a dp x tp training loop.
    topo = meshwise.init(MESH, timeout=TIMEOUT, run_dir=f"{run_dir}/exit")
    trainer, loader = _trainer(topo)
    steps = 2 if rank == 2 else 4
    out["exit"] = _attempt(lambda: trainer.run(loader, max_epochs=1, epoch_length=steps).iteration)
    if rank == 2:
        meshwise.shutdown()  # the end of its script; the others are still at step 3
    return out


def _trainer(topo, mode: str = "train"):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from meshwise.data import ArrayDataset, mesh_dataloader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    model = meshwise.parallelize(model, topo, tp_plan=plan, dp="replicate")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = meshwise.create_trainer(model, opt, torch.nn.functional.mse_loss, topo)
    trainer.model = model
    data = ArrayDataset({"input": torch.randn(64, 4), "target": torch.randn(64, 1)})
    return trainer, mesh_dataloader(data, topo, global_batch_size=8, mode=mode)


def test_watchdog_names_skipped_stalled_and_exited_ranks(tmp_path):
    results = run_distributed(_watchdog_scenarios, 4, timeout=120, env={"MESHWISE_DEBUG": "0"}, run_dir=str(tmp_path))
    assert all(r["plain"] for r in results)  # debug off: torch.distributed is not wrapped
    for r in results:
        kind, msg, seconds = r["user_error"]
        assert (kind, msg) == ("RuntimeError", "DataLoader worker (pid 123) timed out after 5 seconds")
        assert seconds < 0.5

    kind, msg, seconds = results[0]["skip"]
    assert kind == "MetricSyncTimeout" and TIMEOUT <= seconds < TIMEOUT + 5
    assert "metric all_reduce" in msg and "over dp (batch), group [0, 2]" in msg
    assert "ranks [2] did not arrive: rank 2 (dp=1, tp=0) is in no meshwise collective" in msg
    _assert_stacks(msg, "_watchdog_scenarios", {2: "in _meet", 0: "in _metric_compute"})

    # The stall: every rank wrote its stacks; rank 1's report names the region, its dims and step.
    (folder,) = (tmp_path / "stall").glob("hang-*")
    assert len(list(folder.glob("rank-*.txt"))) == 4
    report = (folder / "rank-00001.txt").read_text()
    assert "open collectives: slow op over dp (batch), group [1, 3], step 7" in report
    assert "time.sleep" in report or "_watchdog_scenarios" in report

    # The evaluation: ranks 0, 1 and 3 finish; rank 2 is told where its tp partner is.
    assert [results[r]["eval"][:2] for r in (0, 1, 3)] == [(None, 2), (None, 2), (None, 1)]
    kind, msg, seconds = results[2]["eval"]
    assert kind == "CollectiveTimeoutError" and seconds < 2 * 0.5 + TIMEOUT + 5
    assert "evaluator step over dp (batch), tp (replica)" in msg and "step 2" in msg
    assert "ranks [3] did not arrive: rank 3 (dp=1, tp=1) is in no meshwise collective after evaluator step" in msg

    # The exit: every other rank fails at step 3 with a message naming rank 2 and when it left; one report.
    assert len(list((tmp_path / "exit").glob("hang-*"))) == 1
    assert results[2]["exit"][:2] == (None, 2)
    for r in (0, 1, 3):
        kind, msg, seconds = results[r]["exit"]
        assert kind == "CollectiveTimeoutError" and seconds < 3 * 0.5 + TIMEOUT + 5, (r, msg)
        assert "trainer step over dp (batch), tp (replica)" in msg and "step 3" in msg
        assert "rank 2 (dp=1, tp=0) has left: meshwise.shutdown() after trainer step" in msg, msg
    _assert_gone(results)


def test_a_script_that_ends_early_under_meshwise_run_is_named(tmp_path):
    # The real launcher: torchrun's agent hosts the store, and the early rank's exit record comes from atexit.
    script = Path(__file__).parent / "debug_scripts" / "leave_early.py"
    cmd = [sys.executable, "-m", "meshwise.launch", "run", "--nproc-per-node", "2", str(script), str(tmp_path)]
    out = run_command(cmd, timeout=120).stdout
    (line,) = [x for x in out.splitlines() if x.startswith(("ERROR", "NO ERROR"))]
    assert line.startswith("ERROR MetricSyncTimeout") and "over dp (batch), group [0, 1]" in line, out
    assert "rank 1 (dp=1) has left: the process exited without meshwise.shutdown()" in line, out
    (folder,) = tmp_path.glob("hang-*")
    assert [f.name for f in sorted(folder.glob("rank-*.txt"))] == ["rank-00000.txt"]  # rank 1 was gone


# --------------------------------------------------------------------------- cost of debug off


def _collectives_per_step(debug: bool) -> dict:
    topo = meshwise.init(MESH, timeout=30, debug=debug)
    trainer, loader = _trainer(topo)
    trainer.run(loader, max_epochs=1, epoch_length=1)  # warm-up
    from meshwise.debug import COLLECTIVE_OPS

    with CollectiveCounter([name for name in COLLECTIVE_OPS if hasattr(dist, name)]) as c:  # every op debug mode wraps
        trainer.run(loader, max_epochs=1, epoch_length=2)
    meshwise.shutdown()
    return {"calls": c.calls}


def test_debug_mode_adds_only_the_replica_agreement_check():
    off = run_distributed(_collectives_per_step, 4, False, timeout=120)
    on = run_distributed(_collectives_per_step, 4, True, timeout=120)
    for a, b in zip(off, on):  # fingerprints travel through the store; the batch check is one all_gather a step
        assert [c for c in b["calls"] if c != "all_gather"] == a["calls"], (a["calls"], b["calls"])
        assert b["calls"].count("all_gather") == 2 and "all_gather" not in a["calls"], (a["calls"], b["calls"])
    # Two steps of a tp x dp-replicated model: the trainer's loss all-reduce and the data-parallel gradient
    # reduction of each step are among them (so the counter sees the collectives debug mode fingerprints).
    calls = off[0]["calls"]
    assert calls.count("all_reduce") >= 2 and len(calls) >= 4, calls


@pytest.mark.parametrize("mesh", [{"dp": 2}])
def test_trainer_names_the_rank_that_left_the_loop(mesh):
    results = run_distributed(_left_early, 2, mesh=mesh, pg_timeout=TIMEOUT, timeout=60)
    kind, msg, seconds = results[0]
    assert kind == "CollectiveTimeoutError" and seconds < 3 * 0.5 + TIMEOUT + 5
    assert "trainer step over dp (batch)" in msg and "step 3" in msg and "ranks [1] did not arrive" in msg
    assert results[1][0] is None


def _left_early(topo):
    from meshwise.data import ArrayDataset, mesh_dataloader

    torch.manual_seed(0)
    model = meshwise.parallelize(torch.nn.Linear(4, 1), topo, dp="replicate")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = meshwise.create_trainer(model, opt, torch.nn.functional.mse_loss, topo)
    data = ArrayDataset({"input": torch.randn(64, 4), "target": torch.randn(64, 1)})
    loader = mesh_dataloader(data, topo, global_batch_size=8)
    return _attempt(lambda: trainer.run(loader, max_epochs=1, epoch_length=3 if topo.rank == 0 else 2).iteration)


if __name__ == "__main__":  # print every message, to read them
    import sys
    import tempfile

    for fn in (_debug_scenarios, _watchdog_scenarios):
        for rank, out in enumerate(run_distributed(fn, 4, timeout=120, run_dir=tempfile.mkdtemp())):
            for key, value in out.items():
                print(f"--- rank {rank} {key}: {value}", file=sys.stdout)


# --------------------------------------------------------------------------- a process gloo aborts


def _abort_scenario(run_dir: str) -> None:
    """Debug off, dp=2 x tp=2, after two trainer steps: data rank 0 computes one metric while data rank 1
    computes another, larger one on the same dp groups: gloo aborts the receiving process (SIGABRT, "Received
    data size doesn't match"), which never gets to raise a Python error."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchmetrics import ConfusionMatrix, SumMetric

    from meshwise.metrics import MeshMetric

    topo = meshwise.init(MESH, timeout=TIMEOUT, run_dir=run_dir)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    model = meshwise.parallelize(net, topo, tp_plan={"0": ColwiseParallel(), "2": RowwiseParallel()}, dp="fsdp")
    trainer = meshwise.create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
    trainer.run([{"input": torch.ones(4, 8), "target": torch.zeros(4, 1)}] * 2, max_epochs=1)
    total = MeshMetric(SumMetric(), topo)
    confusion = MeshMetric(ConfusionMatrix(task="multiclass", num_classes=30), topo)
    total.update(torch.ones(3))
    confusion.update(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    if topo.data_rank == 0:
        total.compute()
    else:
        confusion.compute()


def test_a_process_that_gloo_aborts_leaves_every_ranks_report(tmp_path):
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(_abort_scenario, 4, str(tmp_path), timeout=60, env={"MESHWISE_DEBUG": "0"})
    text = str(failure.value)
    assert "killed by SIGABRT" in text or "Connection" in text, text
    assert "meshwise reports (last guarded calls, Python stacks)" in text
    reports = {int(p.stem.split("-")[1]): read_report(p) for p in tmp_path.glob("crash-*/rank-*.txt")}
    assert sorted(reports) == [0, 1, 2, 3], sorted(reports)
    for rank, report in reports.items():
        assert (
            f"rank {rank} (dp={rank // 2}, tp={rank % 2}) of 4" in report
            and "mesh dp=2 (batch), tp=2 (replica)" in report
        )
        assert "over dp (batch)" in report and "test_debug.py" in report, report  # dims and the call site
        assert f"{tmp_path}/crash-" in text.split(f"rank {rank}: ", 1)[1].splitlines()[0]
    aborted = [r for r, report in reports.items() if "Fatal Python error: Aborted" in report]
    assert aborted, reports
    for rank in aborted:  # its Python stack, written by faulthandler after the head
        assert "in _abort_scenario" in reports[rank].split("Fatal Python error: Aborted", 1)[1]


def test_a_gloo_abort_under_meshwise_run_points_to_the_reports(tmp_path):
    # The real launcher: a rank that gloo aborts leaves no Python error; meshwise run's output names each
    # rank's report (last guarded call, Python stacks) in the run folder.
    script = Path(__file__).parent / "debug_scripts" / "abort_mismatch.py"
    cmd = [sys.executable, "-m", "meshwise.launch", "run", "--nproc-per-node", "2", str(script), str(tmp_path)]
    done = run_command(cmd, timeout=120, check=False)
    assert done.returncode != 0
    out = done.stdout
    (folder,) = re.findall(r"each one's report \(last collectives, traceback\): (\S+/crash-\S+)", out) or [None]
    assert folder and folder.startswith(str(tmp_path)), out[-3000:]
    (first,) = re.findall(r"the first failure: rank \d .*; report (\S+/rank-\d+\.txt)\)", out) or [None]
    assert first and Path(first).is_file() and Path(first).parent == Path(folder), out[-3000:]
    assert "Fatal Python error: Aborted" in out  # the aborted rank's, from its report
    # the first failure's open collective, its dims and the script's line, read back from its report: once
    assert out.count("metric all_reduce") == 1 and out.count("over dp (batch), group [0, 1]") == 1, out[-3000:]
    assert out.count("abort_mismatch.py:17 in <module>") == 1, out[-3000:]
