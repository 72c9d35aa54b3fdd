"""Smoke test of the demo path: demo.py runs `meshwise run` at dp=2 x tp=2, then resumes at tp=4; numbers checked."""

from __future__ import annotations

import json
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import meshwise
from meshwise.testing import run_command, run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

import model as gpt  # noqa: E402

TINY = ["--d-model", "32", "--n-layer", "2", "--n-head", "4", "--block-size", "32", "--batch-size", "8"]


def _plain_held_out(run_dir: Path, steps: list[int]) -> list[float]:
    """Oracle, in this process with plain torch: load each checkpoint's model through DCP (no process group,
    no meshwise) and average the cross-entropy of every held-out token in one pass."""
    import torch.distributed.checkpoint as dcp

    config = json.loads((run_dir / "config.json").read_text())
    cfg = gpt.GPTConfig(**config["model"])
    data = Path(config["args"]["data_dir"]) / f"src-{Path(config['args']['source_dir']).stem}"
    tokens = np.load(data / "val.npy")
    n = min(len(tokens) // (cfg.block_size + 1), config["args"]["eval_samples"])
    w = torch.from_numpy(tokens[: n * (cfg.block_size + 1)].astype(np.int64)).view(n, cfg.block_size + 1)
    out = []
    for step in steps:
        model = gpt.GPT(cfg)
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            dcp.load(state, checkpoint_id=str(run_dir / "checkpoints" / f"step-{step}"))
        model.load_state_dict(state["model"])
        with torch.no_grad():
            logits = model(w[:, :-1])
        out.append(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="mean").item())
    return out


def _bad_input(argvs: list[list[str]]) -> list[str]:
    """Run train.py's main once per argv on every rank; return the error messages (every rank must raise)."""
    import train

    from meshwise.errors import MeshwiseError

    out = []
    for argv in argvs:
        try:
            train.main(argv)
            out.append("no error")
        except MeshwiseError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        meshwise.shutdown()
    return out


def test_demo_trains_evaluates_checkpoints_and_resumes_at_tp4(tmp_path):
    run_dir, data_dir = tmp_path / "run", tmp_path / "data"
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "json"  # real text, a few files: one is held out
    cmd = [sys.executable, str(ROOT / "examples" / "gpt" / "demo.py"), "--run-dir", str(run_dir)]
    cmd += ["--steps", "6", "--resume-steps", "3", "--", "--source-dir", str(corpus), "--data-dir", str(data_dir)]
    cmd += [
        *TINY,
        "--eval-samples",
        "20",
        "--eval-batch-size",
        "8",
        "--eval-every",
        "3",
        "--lr",
        "3e-3",
        "--warmup",
        "1",
    ]
    out = run_command(cmd, timeout=150, cwd=str(tmp_path)).stdout
    assert "meshwise demo finished" in out and "bytes read per rank" in out, out[-3000:]

    rows = [json.loads(x) for x in (run_dir / "summary.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["mesh"], r["step_from"], r["step_to"]) for r in rows] == [
        ("train", "dp=2xtp=2", 0, 6),
        ("resume", "tp=4", 6, 9),
    ]
    first, resumed = rows
    # The checkpoint resharded from dp=2 x tp=2 to tp=4 holds the same model: same held-out loss.
    assert abs(resumed["first_val_loss"] - first["val_loss"]) <= 1e-5, rows
    assert first["val_loss"] < first["first_val_loss"] - 0.2, rows  # it learns, even in 6 steps
    assert resumed["val_loss"] < first["val_loss"], rows
    # read="broadcast": only the first rank of each tensor-parallel group reads from storage.
    assert [b > 0 for b in first["bytes_read"]] == [True, False, True, False], first
    assert [b > 0 for b in resumed["bytes_read"]] == [True, False, False, False], resumed
    assert all(r["tokens_per_s"] > 0 for r in rows)

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["tag"] == "train"] == list(range(1, 10))
    val = [r for r in records if r["tag"] == "val"]
    assert [r["step"] for r in val] == [0, 3, 6, 6, 9]
    assert all(abs(r["perplexity"] - np.exp(r["loss"])) < 1e-6 * r["perplexity"] for r in val)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Exact evaluation: the mesh's held-out loss equals a plain one-process pass over the same windows.
    oracle = _plain_held_out(run_dir, [6, 9])
    assert abs(oracle[0] - first["val_loss"]) <= 1e-5, (oracle, rows)
    assert abs(oracle[1] - resumed["val_loss"]) <= 1e-5, (oracle, rows)

    # Bad input fails on every rank with a message saying what to do: a second training phase into the same
    # run folder (instead of mixing into the old run), and a corpus that does not exist (rank 0 prepares it).
    missing = ["--run-dir", str(tmp_path / "other"), "--text", str(tmp_path / "nope.txt"), "--data-dir", str(data_dir)]
    bad = [["--run-dir", str(run_dir), "--steps", "1"], missing]
    for again, absent in run_distributed(_bad_input, 2, bad, timeout=90):
        assert "already holds a run" in again and "--resume" in again, again
        assert absent.startswith("DataError") and "nope.txt" in absent, absent
