"""Cost of watching a run: ``create_trainer`` with its default monitoring on against the same trainer with it off.

One launch of 4 gloo ranks at dp=2 x tp=2, one model and optimizer (bench_overhead's small transformer, TP plan +
FSDP2) shared by two trainers so memory layout and parameter values cannot favour either:

- on: ``create_trainer(...)`` (its Observer: lr, step time, samples/s, peak memory, bytes read, the FLOP count
  of the first step, one all-gather of every rank's memory at each epoch's end), a ``meshwise.engine.ProgressBar``
  (drawn to /dev/null) and a ``RunLogger`` writing JSON lines and TensorBoard every step: what docs/training.md
  shows a user;
- off: ``create_trainer(..., observe=False)`` with no bar and no logger.

Blocks alternate (on, off, off, on, ...); a block is one ``trainer.run`` of one epoch of ``--steps`` batches, so
each block pays one epoch end (the gather, a log flush) as a real epoch does, here every ``--steps`` steps
rather than every few hundred. The ratio is median block time (on) / median block time (off); the median of the
ratios of neighbouring blocks is printed beside it as a check on the noise.
Run with nothing else running: ``flock /tmp/meshwise-cpu.lock nice -n 0 .venv/bin/python benchmarks/bench_observe.py``.
Final line: ``RESULT observe_overhead_ratio=…``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import build, workload  # noqa: E402 - the same model and data as the overhead benchmark


def measure(topo, blocks: int, steps: int, run_dir: str) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    import meshwise
    from meshwise.engine import ProgressBar, RunLogger

    data, _, _ = workload(topo, steps)
    model, opt = build(topo)
    on = meshwise.create_trainer(model, opt, F.mse_loss, topo)
    sink = open(os.devnull, "w")  # noqa: SIM115 - lives for the whole measurement
    ProgressBar(topo, file=sink).attach(on)
    logger = RunLogger(run_dir, topo).attach(on)
    off = meshwise.create_trainer(model, opt, F.mse_loss, topo, observe=False)

    def timed(trainer) -> float:
        dist.barrier()
        start = time.perf_counter()
        trainer.run(data, max_epochs=1)
        return (time.perf_counter() - start) / steps

    for _ in range(2):  # warm-up both (the first "on" step runs under the FLOP counter)
        timed(on)
        timed(off)
    ons, offs = [], []
    for i in range(blocks):
        for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
            (ons if name == "on" else offs).append(timed(on if name == "on" else off))
    logger.close()
    sink.close()
    return {
        "on_s": statistics.median(ons),
        "off_s": statistics.median(offs),
        "paired": statistics.median(a / b for a, b in zip(ons, offs)),
        "observed": dict(on.state.observed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="alternating blocks per side")
    parser.add_argument("--steps", type=int, default=32, help="steps per block (one epoch)")
    args = parser.parse_args()
    from meshwise.testing import run_distributed

    with tempfile.TemporaryDirectory() as run_dir:
        r = run_distributed(measure, 4, args.blocks, args.steps, run_dir, mesh={"dp": 2, "tp": 2}, timeout=900)[0]
    ratio = r["on_s"] / r["off_s"]
    print(f"dp=2 x tp=2 (4 procs), {args.blocks} blocks of {args.steps} steps per side")
    print(f"monitoring on {r['on_s'] * 1e3:.2f} ms/step, off {r['off_s'] * 1e3:.2f} ms/step")
    print(f"ratio {ratio:.4f}, median paired ratio {r['paired']:.4f}")
    shown = {k: round(v, 4) for k, v in r["observed"].items()}
    print(f"rank 0's last observed values: {shown}")
    print(f"RESULT observe_overhead_ratio={ratio:.3f} observe_paired_ratio={r['paired']:.3f}")


if __name__ == "__main__":
    main()
