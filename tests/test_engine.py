"""A 4-rank run draws one progress bar, writes one JSON-lines/TensorBoard log and tags other ranks' warnings;
the trainer matches one process with loss_parallel + token weighting; ``meshwise plot`` renders the PNG."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import engine_script
import pytest

from meshwise.testing import run_distributed


def _captured(topo, run_dir: str) -> dict:
    """Run the script's training with this rank's stdout and stderr captured (tqdm, logging, warnings)."""
    import logging
    import sys

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        result = engine_script.train(topo, run_dir)
        logging.getLogger().handlers.clear()  # the handler holds the captured stream
    sys.stderr.flush()
    return {**result, "output": buffer.getvalue()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return run_dir, run_distributed(_captured, 4, str(run_dir), mesh={"dp": 2, "tp": 2}, timeout=120)


def test_one_progress_bar_and_tagged_warnings(run):
    _, ranks = run
    assert [r["bar"] for r in ranks] == [True, False, False, False]
    assert "train-bar-of-rank-0" in ranks[0]["output"] and "/6]" in ranks[0]["output"]
    for r in ranks[1:]:
        assert "train-bar-of" not in r["output"] and "%|" not in r["output"], r["output"]  # no bar drawn
    for rank, label in ((1, r"rank 1 \(dp=0, tp=1\)"), (3, r"rank 3 \(dp=1, tp=1\)")):
        pattern = rf"\[{label}\] WARNING py\.warnings: .*a warning from rank {rank}"
        assert re.search(pattern, ranks[rank]["output"]), ranks[rank]["output"]
    assert "WARNING py.warnings" not in ranks[0]["output"] + ranks[2]["output"]


def test_loss_parallel_token_weighting_matches_one_process(run):
    _, ranks = run
    for r in ranks:
        assert r["param_diff"] <= 1e-5 and r["loss_diff"] <= 1e-6, r
        assert r["losses"] == ranks[0]["losses"], "engine.state.output differs between ranks"


def test_logs_written_once_and_plotted(run, tmp_path, capsys):
    run_dir, ranks = run
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]  # one writer, not four
    assert all(r["tag"] == "train" and r["epoch"] == 1 for r in lines)
    assert [r["loss"] for r in lines] == pytest.approx(ranks[0]["losses"], abs=1e-12)
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "tensorboard"]

    from meshwise.launch import main

    assert main(["plot", str(run_dir)]) == 0  # the `meshwise plot RUN_DIR` command, in this process
    assert capsys.readouterr().out.strip() == str(run_dir / "curves.png")
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from meshwise.errors import MeshwiseError
    from meshwise.plot import plot_run, read_metrics

    records = [{"tag": t, "step": s, "loss": 1.0 / s, "acc": s / 10} for t in ("train", "val") for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)))
    assert read_metrics(tmp_path)["acc"]["val"] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    png = plot_run(tmp_path, tmp_path / "out" / "p.png")
    assert Path(png).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(MeshwiseError, match="RunLogger"):
        plot_run(tmp_path / "missing")
