"""Cost of meshwise's hang detection: a dp=2 x tp=2 training step with debug off, debug on, and without meshwise.

One launch of 4 gloo ranks, one model and optimizer (bench_overhead's small transformer, TP plan + FSDP2),
three ways of stepping it, interleaved block by block in rotating order so machine load hits all alike:

* ``theirs`` — a hand-written torch loop: zero_grad, forward, loss, backward, an all-reduce of the loss
  over the data group, step, ``.item()``;
* ``off`` — ``meshwise.create_trainer`` with debug off (the default: the watchdog only, nothing wrapped);
* ``on`` — the same trainer with debug mode on: every collective on a topology group exchanges a
  fingerprint through the store first.

Ratios are medians over blocks of (block time / the neighbouring ``theirs`` block's time).
Run: ``.venv/bin/python benchmarks/bench_debug.py`` (``--blocks``, ``--steps``).
Final line: ``RESULT off_ratio=… on_ratio=…`` (goal: off_ratio ≤ 1.01).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import workload  # noqa: E402 - the same model, data and hand loop as the overhead benchmark


def measure(topo, blocks: int, steps: int) -> dict:
    import torch.distributed as dist

    from meshwise import debug

    data, trainer, hand_loop = workload(topo, steps)

    def theirs() -> None:
        hand_loop(data)

    def set_debug(on: bool) -> None:
        # The switch meshwise.init(debug=...) makes once, flipped here so all three share one run and one model.
        topo.debug = on
        debug.install(topo) if on else debug.uninstall()

    def off() -> None:
        trainer.run(data, max_epochs=1)

    def on() -> None:
        set_debug(True)
        try:
            trainer.run(data, max_epochs=1)
        finally:
            set_debug(False)

    modes = {"theirs": theirs, "off": off, "on": on}
    for fn in modes.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in modes}
    orders = [("theirs", "off", "on"), ("off", "on", "theirs"), ("on", "theirs", "off")]
    for i in range(blocks):
        for name in orders[i % 3]:
            dist.barrier()
            start = time.perf_counter()
            modes[name]()
            times[name].append((time.perf_counter() - start) / steps)
    # What debug off adds to a step by itself: one guarded region (the trainer step's), with nothing inside.
    n = 20000
    start = time.perf_counter()
    for i in range(n):
        with debug.guarded(topo, topo.dims, "trainer step", step=i, region=True):
            pass
    return {**times, "guard_us": (time.perf_counter() - start) / n * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from meshwise.testing import run_distributed

    start = time.perf_counter()
    results = run_distributed(
        measure, 4, args.blocks, args.steps, mesh={"dp": 2, "tp": 2}, pg_timeout=120, timeout=1800
    )
    # A step ends when the slowest rank ends it: per block, the slowest rank's time.
    guard_us = statistics.median(r.pop("guard_us") for r in results)
    times = {name: [max(r[name][i] for r in results) for i in range(args.blocks)] for name in results[0]}
    ratios = {name: statistics.median(a / b for a, b in zip(times[name], times["theirs"])) for name in ("off", "on")}
    for name, values in times.items():
        print(f"{name:>6}: median step {statistics.median(values) * 1e3:8.2f} ms over {args.blocks} blocks")
    extra_us = (statistics.median(times["off"]) - statistics.median(times["theirs"])) * 1e6
    print(f"trainer (debug off) minus hand loop: {extra_us:+.0f} us per step; {time.perf_counter() - start:.0f} s")
    print(f"the watchdog's bookkeeping per step (one guarded region, debug off): {guard_us:.1f} us")
    print(
        f"RESULT off_ratio={ratios['off']:.3f} on_ratio={ratios['on']:.3f} guard_us={guard_us:.1f} "
        f"step_ms={statistics.median(times['theirs']) * 1e3:.1f} blocks={args.blocks} steps={args.steps}"
    )


if __name__ == "__main__":
    main()
