"""A user's first hour with ``meshwise run``, by real launches (torchrun underneath, 2-4 gloo ranks):
a failed run ends with its root cause, Ctrl-C stops every rank with a checkpoint and one resume line,
the script is checked before any worker starts, a mesh in code must agree with --mesh, --version works."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from meshwise import launch
from meshwise.errors import PlacementWarning
from meshwise.testing import run_command

SCRIPT = Path(__file__).resolve().parent / "first_hour_scripts" / "train.py"
ROOT = Path(__file__).resolve().parents[1]
MESHWISE = [sys.executable, "-m", "meshwise.launch"]


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.strip()]


def _left_processes(marker: str) -> list[int]:
    """Processes still running whose command line holds ``marker`` (a run folder of this test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_the_command_line_checks_before_any_worker_starts(tmp_path):
    version = run_command([*MESHWISE, "--version"], timeout=60)
    assert re.fullmatch(r"meshwise \d+\.\d+\.\d+\S*", version.stdout.strip()), version.stdout

    helps = run_command([*MESHWISE, "run", "--help"], timeout=60).stdout
    assert helps.startswith("usage: meshwise run"), helps[:200]
    assert helps.index("--mesh") < helps.index("--rdzv-endpoint"), helps  # meshwise's own options first
    assert "docs/cluster.md" in helps and "--help-torchrun" in helps
    section = "## `meshwise run`"  # the section the help points at exists
    assert section in (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text()

    started = time.monotonic()
    missing = run_command([*MESHWISE, "run", "--nproc-per-node", "4", str(tmp_path / "nope.py")], check=False)
    assert missing.returncode == 2, missing.stdout
    assert _lines(missing.stdout) == [
        f"meshwise run: error: script '{tmp_path / 'nope.py'}' not found (working directory {os.getcwd()}): "
        "check the path"
    ]
    bad = tmp_path / "bad.py"
    bad.write_text("import meshwise\nif True\n    pass\n")
    broken = run_command([*MESHWISE, "run", "--nproc-per-node", "4", str(bad)], check=False)
    assert broken.returncode == 2 and len(_lines(broken.stdout)) == 1, broken.stdout
    assert f"{bad}:2:" in broken.stdout and "no process was started" in broken.stdout
    assert time.monotonic() - started < 30  # no worker started: a launch of 4 takes longer than this on 2 cores


def test_a_failed_run_ends_with_the_first_root_cause(tmp_path):
    """Rank 2 raises in a training step; its peers then fail in the step's collectives. The last lines name
    rank 2, its message and its line, not the peers' collective errors nor torchrun's ``error_file`` noise."""
    cmd = [*MESHWISE, "run", "--nproc-per-node", "4", "--mesh", "dp=2,tp=2", str(SCRIPT)]
    cmd += ["--run-dir", str(tmp_path), "--fail-rank", "2", "--fail-at", "3"]
    result = run_command(cmd, timeout=150, check=False, cwd=str(tmp_path))
    assert result.returncode == 1, result.stdout
    lines = _lines(result.stdout)
    assert lines[-1] == "ValueError: sample file shard-2.npy is truncated: regenerate it with prepare.py", lines[-6:]
    assert re.fullmatch(
        r"meshwise run: the first error, on rank 2 \(dp=1, tp=0\) at .*train\.py:\d+ in _each_step:", lines[-2]
    )
    assert (
        lines[-3].startswith("meshwise run: ranks ")
        and "failed after it (CollectiveTimeoutError)" in lines[-3]
        or ("failed" in lines[-3])
    )
    assert "error_file" not in result.stdout and "Root Cause" not in result.stdout
    assert "returned a view tensor" not in result.stdout  # FSDP2 over a model ending in a RowwiseParallel layer
    assert result.stdout.count("ValueError: sample file") == 2  # rank 2's traceback once, the summary once
    reports = sorted((tmp_path / "runs").glob("crash-*/rank-*.txt"))
    assert len(reports) >= 3, (reports, result.stdout)
    for report in reports:
        data = report.read_bytes()
        assert b"\0" not in data and b" " * 80 not in data, report  # compact: no padded head
        assert data.startswith(b"rank "), data[:100]
    assert b"ValueError: sample file" in (tmp_path / "runs").glob("crash-*/rank-00002.txt").__next__().read_bytes()
    print(f"failed 4-rank run: {len(result.stdout.splitlines())} lines")


def test_a_mesh_in_code_that_differs_from_the_launchers_is_an_error(tmp_path):
    cmd = [*MESHWISE, "run", "--nproc-per-node", "2", "--mesh", "dp=2", str(SCRIPT)]
    cmd += ["--run-dir", str(tmp_path), "--mesh-in-code", "dp=1,tp=2"]
    result = run_command(cmd, timeout=120, check=False, cwd=str(tmp_path))
    assert result.returncode == 1, result.stdout
    last = _lines(result.stdout)[-1]
    assert last.startswith("TopologyError: meshwise.init() was given the mesh dp=1,tp=2 but the launcher's is dp=2"), (
        last
    )
    assert result.stdout.count("Traceback") == 1  # the second rank's identical error is one line


def _stopped_mid_epoch(tmp_path: Path, send: str) -> tuple[Path, re.Match]:
    """Start the test script under `meshwise run` at dp=2, signal it in the middle of epoch 2 (``send``: "SIGINT"
    to the launcher's process group, as a terminal's Ctrl-C; "SIGUSR1" to the launcher alone, as a scheduler's
    warning reaches the step's task), and check the stop: every rank after the same step, a checkpoint there, exit
    128 + the signal, one last line and no rank left."""
    run = tmp_path / "run"
    cmd = [*MESHWISE, "run", "--nproc-per-node", "2", "--mesh", "dp=2", str(SCRIPT)]
    cmd += ["--run-dir", str(run), "--epochs", "3", "--sleep", "0.2"]
    run.mkdir()
    log = tmp_path / "out.txt"
    sig = getattr(signal, send)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(tmp_path), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        progress = run / "progress.txt"
        while time.monotonic() < deadline and proc.poll() is None:
            if progress.exists() and len(progress.read_text().splitlines()) >= 15:  # epoch 2 (12 steps an epoch)
                break
            time.sleep(0.1)
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        sent = time.monotonic()
        rc = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 128 + sig, text
    assert took < 15, took
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "Connection closed" not in text, text
    last = _lines(text)[-1]
    found = re.fullmatch(
        rf"meshwise run: stopped by {send} after step (\d+) \(epoch 2, step (\d+) of 12\); checkpoint saved at step "
        r"(\d+) in (\S+)\. Resume: (.*)",
        last,
    )
    assert found, last
    step = int(found.group(1))
    assert int(found.group(3)) == step and found.group(4) == str(run / "checkpoints")
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{step}"
    time.sleep(0.5)
    assert _left_processes(str(run)) == [], "a rank outlived the stop"
    print(f"{send}: {len(text.splitlines())} lines, stopped in {took:.1f}s at step {step}")
    return run, found


def test_a_schedulers_warning_signal_saves_and_asks_to_be_requeued(tmp_path):
    """SIGUSR1 (SLURM's --signal=USR1@120, before a time limit's kill) to `meshwise run`: torchrun's agent passes it
    to the ranks, which stop after one step with a checkpoint; exit code 138, which a batch script requeues."""
    _stopped_mid_epoch(tmp_path, "SIGUSR1")


def test_ctrl_c_stops_every_rank_with_a_checkpoint_and_one_resume_line(tmp_path):
    """SIGINT to the launcher's process group, as a terminal's Ctrl-C sends it, in the middle of epoch 2; the
    resume line's command then finishes the run, equal to one process trained without a break."""
    run, found = _stopped_mid_epoch(tmp_path, "SIGINT")

    resume = shlex.split(found.group(5))
    assert resume[:2] == ["meshwise", "run"]
    resumed = run_command([*MESHWISE, *resume[1:]], timeout=120, cwd=str(tmp_path))
    assert "Traceback" not in resumed.stdout
    whole = tmp_path / "whole"
    whole.mkdir()
    run_command([sys.executable, str(SCRIPT), "--run-dir", str(whole), "--epochs", "3"], timeout=120)
    a = json.loads((run / "final.json").read_text())
    b = json.loads((whole / "final.json").read_text())
    worst = max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in b)
    assert worst <= 1e-12, worst
    print(f"interrupted and resumed at dp=2 vs one process unbroken: max abs difference {worst:.1e}")


def test_the_readmes_dry_run_line_works_and_a_replica_dim_without_a_plan_warns(tmp_path, monkeypatch, capsys):
    """In this process (torch's fake backend): the README's dry-run line on the quick start (and no FSDP2
    view warning), then the test script at dp=2 x tp=2 with its plan forgotten, which trains every tp rank on
    the same work."""
    monkeypatch.chdir(tmp_path)
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith("meshwise run --dry-run"))
    argv = [str(ROOT / "examples" / "quickstart.py") if a == "train.py" else a for a in shlex.split(line)[1:]]
    assert "#" in argv  # the comment
    with warnings.catch_warnings(record=True) as caught:  # dp=32 x tp=2, FSDP2 over a RowwiseParallel output
        warnings.simplefilter("always")
        assert launch.main(argv[: argv.index("#")]) == 0, capsys.readouterr()
    assert not [w for w in caught if "returned a view tensor" in str(w.message)], "FSDP2's view warning"
    argv = ["run", "--dry-run", "--world-size", "4", "--rank", "0", "--mesh", "dp=2,tp=2", str(SCRIPT)]
    with pytest.warns(
        PlacementWarning, match=r"replica dim\(s\) \['tp'\] of 2 ranks but parallelize\(\) got no tp_plan"
    ):
        assert launch.main([*argv, "--run-dir", str(tmp_path / "r"), "--epochs", "1", "--no-plan"]) == 0
