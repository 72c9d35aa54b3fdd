"""A 4-process ``meshwise run`` draws one progress bar, writes one JSON-lines/TensorBoard log, tags other ranks'
warnings, trains like one process with loss_parallel + token weighting; ``meshwise plot`` renders its PNG."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from meshwise.testing import run_command

ROOT = Path(__file__).resolve().parents[1]
MESHWISE = [sys.executable, "-m", "meshwise.launch"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cmd = [*MESHWISE, "run", "--nproc-per-node", "4", "--mesh", "dp=2,tp=2", str(ROOT / "tests" / "engine_script.py")]
    out = run_command([*cmd, str(run_dir)], timeout=120, cwd=str(ROOT)).stdout
    return run_dir, out


def test_one_progress_bar_and_tagged_warnings(run):
    _, out = run
    assert re.findall(r"rank (\d) bar True", out) == ["0"], out
    assert sorted(re.findall(r"rank (\d) bar False", out)) == ["1", "2", "3"], out
    assert "train-bar-of-rank-0" in out, out  # the bar was drawn ...
    assert not re.search(r"train-bar-of-rank-[123]", out), out  # ... by rank 0 only
    assert "/6]" in out, out
    assert re.search(r"\[rank 1 \(dp=0, tp=1\)\] WARNING py\.warnings: .*a warning from rank 1", out), out
    assert re.search(r"\[rank 3 \(dp=1, tp=1\)\] WARNING py\.warnings: .*a warning from rank 3", out), out


def test_loss_parallel_token_weighting_matches_one_process(run):
    _, out = run
    checks = re.findall(r"CHECK rank=(\d) param_diff=(\S+) loss_diff=(\S+) losses=(\[[^\]]*\])", out)
    assert sorted(c[0] for c in checks) == ["0", "1", "2", "3"], out
    for _, param_diff, loss_diff, _ in checks:
        assert float(param_diff) <= 1e-5 and float(loss_diff) <= 1e-6, out
    assert len({c[3] for c in checks}) == 1, "engine.state.output differs between ranks"


def test_logs_written_once_and_plotted(run, tmp_path, capsys):
    run_dir, out = run
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]  # one writer, not four
    assert all(r["tag"] == "train" and isinstance(r["loss"], float) for r in lines)
    losses = json.loads(re.search(r"CHECK rank=0 \S+ \S+ losses=(\[[^\]]*\])", out).group(1))
    assert [r["loss"] for r in lines] == pytest.approx(losses, abs=1e-12)
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "tensorboard"]

    from meshwise.launch import main

    assert main(["plot", str(run_dir)]) == 0  # the `meshwise plot RUN_DIR` command, in this process
    assert capsys.readouterr().out.strip() == str(run_dir / "curves.png")
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from meshwise.plot import plot_run

    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps({"tag": t, "step": s, "loss": 1.0 / s, "acc": s / 10})
            for t in ("train", "val")
            for s in (1, 2, 3)
        )
    )
    png = plot_run(tmp_path, tmp_path / "out" / "p.png")
    assert Path(png).read_bytes()[:4] == b"\x89PNG"
    from meshwise.errors import MeshwiseError

    with pytest.raises(MeshwiseError, match="RunLogger"):
        plot_run(tmp_path / "missing")
