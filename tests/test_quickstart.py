"""The README's quick start run twice in one folder, as its help says: the second run resumes the finished
checkpoint, says there is nothing left to train, evaluates again and prints the same held-out MSE."""

from __future__ import annotations

import sys
from pathlib import Path

from meshwise.testing import run_command

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_run_twice_resumes_the_finished_run_and_evaluates(tmp_path):
    runs = [run_command([sys.executable, str(SCRIPT)], cwd=str(tmp_path), timeout=120) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0]
    first, second = ([x for x in r.stdout.splitlines() if "held-out mse" in x][-1] for r in runs)
    assert "last train loss" in first, first
    assert "checkpoint step 24 already completes 3 epochs" in second, second
    assert first.split("held-out mse")[1] == second.split("held-out mse")[1]  # the same model, evaluated again
    assert (tmp_path / "runs" / "quickstart" / "checkpoints" / "latest").read_text().strip() == "step-24"
