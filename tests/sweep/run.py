"""`make test-sweep`: runs the conformance sweep (conformance.py), writes its results as JSON, prints the summary
and every failure, and fails when a family trains differently or fails with anything but a MeshwiseError, unless
that failure is one of the open ones listed in known.py (and fails when a listed one passes).

    .venv/bin/python tests/sweep/run.py [--out runs/sweep/results.json] [--families llama,qwen3] [--modes tp,cp]

``MESHWISE_SWEEP_RESULTS`` names the output when ``--out`` is not given. The table in docs/hf-sweep.md is made from the
results by ``tests/sweep/table.py``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks import conformance/families by these names

import conformance  # noqa: E402
import known  # noqa: E402
import table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("MESHWISE_SWEEP_RESULTS", "runs/sweep/results.json"))
    parser.add_argument("--families", help="comma-separated model types (default: every causal-LM family)")
    parser.add_argument("--modes", help=f"comma-separated, of {list(conformance.MODES)} (default: all)")
    parser.add_argument("--work", help="folder for references and per-launch records (default: a temporary one)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    results = conformance.run(
        args.out,
        types=args.families.split(",") if args.families else None,
        modes=args.modes.split(",") if args.modes else None,
        work=args.work,
    )
    print(table.summary(results))
    failed = conformance.failures(results)
    unexpected = [f for f in failed if tuple(f.split(":")[0].split(" ")) not in known.KNOWN]
    for line in failed:
        print("FAIL" if line in unexpected else "FAIL (known)", line.splitlines()[0][:400])
    ran = {(t, m): r["verdict"] for t, e in results["families"].items() for m, r in e.get("modes", {}).items()}
    fixed = [k for k in known.KNOWN if k in ran and ran[k] != "FAIL"]
    for family, mode in fixed:
        print(f"FIXED {family} {mode}: {ran[family, mode]}; remove it from tests/sweep/known.py")
    stale = table.stale(results)
    if stale:
        print("docs/hf-sweep.md's table differs from these results (regenerate: tests/sweep/table.py):", *stale[:20])
    print(
        f"sweep: {len(failed)} failure(s), {len(unexpected)} not in tests/sweep/known.py, {len(fixed)} listed there "
        f"that passed; results in {args.out}, {time.monotonic() - t0:.0f} s"
    )
    return 1 if unexpected or fixed else 0


if __name__ == "__main__":
    sys.exit(main())
