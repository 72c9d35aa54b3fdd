"""Benchmark an elastic run losing a node: is the trajectory kept, and how long does recovering take?

Two `meshwise run --nnodes 1:2 --nproc-per-node 2` agents on loopback (dp=2 x tp=2, examples/elastic/train.py,
float64, a checkpoint every step) meet at a `meshwise store`; at step ``--kill-at`` (mid-epoch) one agent and its
workers are SIGKILLed. The survivor's agent restarts its workers at dp=1 x tp=2 with twice the accumulation:

* ``elastic_exact``: 1 when the run's final weights equal an uninterrupted one-process run's (max |diff| <= 1e-12);
* ``recover_s``: from the kill to the first step completed after it (the survivor's new world);
* ``restart_s``: a restart by hand, measured in the same run: `meshwise run --nproc-per-node 2` of the survivor's
  world launched on a copy of the checkpoint folder, from the launch to its first completed step (process start,
  init, checkpoint load, one step); median of ``--repeats``;
* ``recover_ratio`` = recover_s / restart_s (goal <= 1.5): what noticing the loss and the rendezvous add.

Final line: ``RESULT elastic_exact=… recover_s=… restart_s=… recover_ratio=…``. Uses the loopback helpers of
tests/elastic/agents.py.

    .venv/bin/python benchmarks/bench_elastic.py [--steps 28] [--kill-at 9] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "elastic"))

import agents  # noqa: E402


def _first_new_step(run: Path, worlds_before: int, deadline: float) -> float:
    """When the world recorded after ``worlds_before`` others completes a step past the one it resumed from."""
    while time.monotonic() < deadline:
        try:
            history = agents.worlds(run)
        except (OSError, ValueError):
            history = []
        if len(history) > worlds_before and agents.reached(run) > (history[-1]["resumed_from"] or 0):
            return time.monotonic()
        time.sleep(0.005)
    raise SystemExit("no step after the restart within the deadline")


def _elastic(tmp: Path, steps: int, kill_at: int) -> tuple[dict, float, Path]:
    run = tmp / "run"
    logs = [tmp / "a.log", tmp / "b.log"]
    with agents.store() as endpoint:
        a = agents.agent(endpoint, "bench", agents.train_args(run, steps, 0.2, tmp / "out.json"), logs[0])
        b = agents.agent(endpoint, "bench", agents.train_args(run, steps, 0.2), logs[1])
        agents.wait_for_step(run, kill_at, [a, b], world=4)
        before = len(agents.worlds(run))
        t_kill = agents.lose_node(b)
        snapshot = tmp / "at-kill"
        shutil.copytree(run, snapshot, ignore=shutil.ignore_patterns("*.tmp"))
        recover = _first_new_step(run, before, time.monotonic() + 180) - t_kill
        agents.finish([a, b], logs)
    if a.returncode != 0:
        raise SystemExit(f"the surviving agent failed:\n{logs[0].read_text()[-3000:]}")
    return json.loads((tmp / "out.json").read_text()), recover, snapshot


def _restart(tmp: Path, snapshot: Path, steps: int, i: int) -> float:
    run = tmp / f"restart-{i}"
    shutil.copytree(snapshot, run)
    (run / ".reached-step").unlink(missing_ok=True)
    before = len(agents.worlds(run))
    cmd = [agents.PY, "-m", "meshwise.launch", "run", "--nproc-per-node", "2", "--mesh", "dp=-1,tp=2"]
    env = {**os.environ, **agents.ENV, "MESHWISE_RUN_DIR": str(tmp / f"restart-{i}-reports")}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd + agents.train_args(run, steps, 0.2),
        env=env,
        cwd=agents.ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        return _first_new_step(run, before, time.monotonic() + 120) - t0
    finally:
        agents.finish([proc], [], timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--kill-at", type=int, default=9)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as folder:
        tmp = Path(folder)
        ref = agents.reference(tmp, args.steps)
        out, recover, snapshot = _elastic(tmp, args.steps, args.kill_at)
        diff = agents.max_diff(out["weights"], ref)
        restarts = [_restart(tmp, snapshot, args.steps, i) for i in range(args.repeats)]
    restart = statistics.median(restarts)
    print(f"elastic run: final world {out['world']} ranks, step {out['step']}, max |diff| to one process {diff:.3g}")
    print(f"recover {recover:.2f} s (kill -> first step of the new world); restarts by hand {restarts}")
    print(
        f"RESULT elastic_exact={int(diff <= 1e-12)} recover_s={recover:.2f} restart_s={restart:.2f} "
        f"recover_ratio={recover / restart:.2f}"
    )


if __name__ == "__main__":
    main()
