"""The meshwise demo: train the example GPT at dp=2 x tp=2, then resume its checkpoint at tp=4, and summarise.

    python examples/gpt/demo.py                       # 4 CPU processes, at most about 4 minutes on 2 cores
    python examples/gpt/demo.py --nproc 8                 # dp=4 x tp=2, resumed at dp=2 x tp=4
    python examples/gpt/demo.py -- --d-model 256 --n-layer 6 --text book.txt   # after --: train.py options

Each phase is one ``meshwise run`` of examples/gpt/train.py; the run folder (default runs/gpt) is
started afresh. Everything after ``--`` goes to train.py in both phases (see ``train.py --help``); on the
resume the model size, data and batch size come from the run folder, so only run options matter there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def launch(nproc: int, mesh: str, script_args: list[str]) -> None:
    cmd = [sys.executable, "-m", "meshwise.launch", "run", "--nproc-per-node", str(nproc), "--mesh", mesh]
    cmd += [str(HERE / "train.py"), *script_args]
    print(f"\n$ meshwise run --nproc-per-node {nproc} --mesh {mesh} examples/gpt/train.py {' '.join(script_args)}")
    sys.stdout.flush()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(cmd, env=env)
    if result.returncode:
        raise SystemExit(f"demo: the phase at mesh {mesh} failed with exit code {result.returncode}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="processes per phase (default 4)")
    p.add_argument("--mesh", default="dp=-1,tp=2", help="mesh of the training phase (default dp=-1,tp=2: dp=2 x tp=2)")
    p.add_argument("--resume-mesh", default="dp=-1,tp=4", help="mesh of the resume phase (default dp=-1,tp=4: tp=4)")
    p.add_argument("--steps", type=int, default=250, help="training steps (default 250, about 2 minutes on 2 cores)")
    p.add_argument(
        "--time-budget", type=float, default=120.0, help="stop training after this many seconds (default 120; 0: off)"
    )
    p.add_argument("--resume-steps", type=int, default=20, help="steps after the resume (default 20)")
    p.add_argument("--run-dir", default="runs/gpt", help="run folder, started afresh (default runs/gpt)")
    a = p.parse_args(argv)
    started = time.perf_counter()
    budget = ["--time-budget", str(a.time_budget)]
    launch(a.nproc, a.mesh, ["--run-dir", a.run_dir, "--overwrite", "--steps", str(a.steps), *budget, *extra])
    launch(a.nproc, a.resume_mesh, ["--resume", a.run_dir, "--steps", str(a.resume_steps), *extra])
    from train import format_summary  # this script's folder is on sys.path

    rows = [json.loads(x) for x in (Path(a.run_dir) / "summary.jsonl").read_text().splitlines() if x.strip()]
    first, last = rows[0]["first_val_loss"], rows[-1]["val_loss"]
    print(f"\nmeshwise demo finished in {time.perf_counter() - started:.0f} s\n")
    print(format_summary(rows))
    print(
        f"\nheld-out loss {first:.3f} -> {last:.3f} nats/byte (perplexity {rows[-1]['val_ppl']:.2f}); "
        f"the resume at {rows[-1]['mesh']} started from held-out loss {rows[-1]['first_val_loss']:.6f}, "
        f"the {rows[0]['mesh']} run ended at {rows[0]['val_loss']:.6f}"
    )
    print(f"run folder {a.run_dir}: metrics.jsonl, tensorboard/, loss.png, summary.jsonl, checkpoints/")


if __name__ == "__main__":
    main()
