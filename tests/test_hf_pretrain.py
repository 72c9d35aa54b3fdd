"""examples/hf_pretrain/train.py run as `meshwise run` runs it: a run stopped after step k and resumed in the same
folder continues mid-epoch with exactly the losses of an unbroken run: packed rows of a `datasets.Dataset` at
dp=2 x tp=2 against one process, and (slow: three more launches, at dp=2) a `datasets` stream with padded labels
against an unbroken run on the same mesh (tests/test_streaming_sources.py compares streams with one process at
dp=2 x cp=2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshwise.testing import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "hf_pretrain" / "train.py"
# the stream's data-rank split needs only dp
MESHES = {"packed": ("4", "dp=2,tp=2"), "mixture": ("4", "dp=2,tp=2"), "streaming": ("2", "dp=2")}
STEPS, STOP = 6, 3


def _losses(run_dir: Path, source: str, *extra: str, one_process: bool = False) -> tuple[dict[int, float], str]:
    """One run of the unmodified script as `meshwise run` runs it (or as one plain process), on forked ranks
    (`run_script`; the launcher itself is tested in test_topology/test_first_hour); the per-step losses rank 0
    printed, by step, and the last line."""
    args = ["--run-dir", str(run_dir), "--steps", str(STEPS), "--double", *extra]
    nproc, mesh = ("1", None) if one_process else MESHES[source]
    args = [*args, "--mesh", "dp=1"] if one_process else args
    out = run_script(SCRIPT, int(nproc), args, mesh=mesh, timeout=240, env={"HF_DATASETS_OFFLINE": "1"})[0]
    losses = {int(w[1]): float(w[3]) for w in (x.split() for x in out.splitlines()) if w[:1] == ["step"]}
    tail = [x for x in out.splitlines() if x.startswith(("done ", "mixture "))]
    return losses, " / ".join(tail[-2:] if "--mix" in extra else tail[-1:])


@pytest.mark.parametrize("source", ["packed", "mixture", pytest.param("streaming", marks=pytest.mark.slow)])
def test_stopped_and_resumed_run_matches_an_unbroken_one(tmp_path, source):
    extra = {"streaming": ["--streaming"], "mixture": ["--mix"]}.get(source, [])
    # packed rows (one source, or a mixture of two with scheduled weights): the unbroken reference is one process
    # (an exact resume and a mesh equal to one process, both); a stream is divided by data rank (its shard files),
    # so one process reads other global batches: same mesh
    unbroken, whole = _losses(tmp_path / "unbroken", source, *extra, one_process=source != "streaming")
    assert sorted(unbroken) == list(range(1, STEPS + 1)) and f"done steps 0-{STEPS} " in whole, whole
    first, last = _losses(tmp_path / "resumed", source, "--stop-at", str(STOP), *extra)
    assert sorted(first) == list(range(1, STOP + 1)) and f"done steps 0-{STOP} " in last, last
    resumed, last = _losses(tmp_path / "resumed", source, *extra)  # same folder: continues from the step-3 checkpoint
    assert sorted(resumed) == list(range(STOP + 1, STEPS + 1)) and f"done steps {STOP}-{STEPS} " in last
    if source == "mixture":  # each source gave as many rows as in the unbroken run
        assert last.split(" / ")[0] == whole.split(" / ")[0] and "json=" in last, (last, whole)
    worst = 0.0
    for step in range(1, STEPS + 1):
        got = first[step] if step <= STOP else resumed[step]
        assert abs(got - unbroken[step]) <= 1e-12, (step, got, unbroken[step])
        worst = max(worst, abs(got - unbroken[step]))
    print(source, "losses", unbroken, "largest stopped/resumed difference", worst)
    assert unbroken[STEPS] < unbroken[1] - 0.2, unbroken  # it learns
    # (had the resume lost the loader cursor, it would retrain rows 0.. of the epoch and steps 4-6 would differ)
