"""The CUDA/NCCL path (``make gpu-check``): each script in tests/cuda_scripts run on every GPU, skipped without one.

A check is a plain script started as a user starts one: ``python check_x.py`` on one GPU, ``meshwise run
--nproc-per-node N check_x.py`` on N (the largest of 1, 2, 4, 8 that ``torch.cuda.device_count()`` allows). It
passes when it exits 0 and every rank printed its ``MESHWISE_CHECK`` line; what each one checks is in its own
docstring and in docs/gpu.md. ``MESHWISE_CHECK_DEVICE=cpu`` (with ``MESHWISE_CHECK_NPROC``, default 2) runs the
same scripts on CPU/gloo by hand, to debug their logic where no GPU is; ``make test`` only ever skips them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from meshwise.testing import run_command

SCRIPTS = Path(__file__).parent / "cuda_scripts"
CHECKS = ["groups", "tp", "fsdp_bf16", "pipeline", "async_checkpoint", "cp_attention", "loader_device"]
DEVICE = os.environ.get("MESHWISE_CHECK_DEVICE", "cuda").strip().lower()
RUNS = DEVICE == "cpu" or torch.cuda.is_available()

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not RUNS,
        reason="needs a CUDA GPU and a CUDA build of torch (make gpu-check); MESHWISE_CHECK_DEVICE=cpu runs these "
        "checks on CPU/gloo by hand",
    ),
]


def nproc() -> int:
    """Ranks per check: every GPU up to 8, in a power of two (the checks' meshes are built of dims of 2)."""
    count = int(os.environ.get("MESHWISE_CHECK_NPROC", "2")) if DEVICE == "cpu" else torch.cuda.device_count()
    return max(n for n in (1, 2, 4, 8) if n <= max(count, 1))


@pytest.mark.parametrize("check", CHECKS)
def test_cuda_check(check: str, tmp_path: Path) -> None:
    n = nproc()
    script = str(SCRIPTS / f"check_{check}.py")
    launch = (
        [sys.executable, script]
        if n == 1
        else [sys.executable, "-m", "meshwise.launch", "run", "--nproc-per-node", str(n), script]
    )
    env = {
        "MESHWISE_CHECK_DEVICE": DEVICE,
        "MESHWISE_RUN_DIR": str(tmp_path / "runs"),
        "MESHWISE_CHECK_DIR": str(tmp_path),
    }
    proc = run_command(launch, timeout=240, env=env, cwd=str(SCRIPTS), check=False)
    lines = [
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("MESHWISE_CHECK ")
    ]
    assert proc.returncode == 0, f"check_{check}.py on {n} rank(s) exited {proc.returncode}:\n{proc.stdout[-8000:]}"
    assert sorted(r["rank"] for r in lines) == list(range(n)), f"result lines of ranks {[r['rank'] for r in lines]}"
    assert all(r["check"] == check and r["world_size"] == n for r in lines), lines
    if DEVICE == "cuda":
        assert {r["backend"] for r in lines} == {"nccl"}, lines
        assert sorted(r["device"] for r in lines) == [f"cuda:{i}" for i in range(n)], lines
    print(json.dumps(min(lines, key=lambda r: r["rank"]), sort_keys=True))  # make gpu-check shows what was measured
