"""meshwise run --dry-run: the GPT and domain examples as ranks of 1,024- and 16,384-rank worlds, checked
against a real 4-rank run and the local tensors; the bad-input errors of a real launch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshwise import launch
from meshwise.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt" / "train.py"
DOMAIN = ROOT / "examples" / "domain"


def _gpt_args(tmp: Path, batch: int) -> list[str]:
    return [
        *("--run-dir", str(tmp / "run"), "--overwrite", "--data-dir", str(tmp / "data"), "--tokens"),
        *(str(tmp / "tokens.npy"), "--d-model", "16", "--n-layer", "1", "--n-head", "4", "--block-size", "8"),
        *("--batch-size", str(batch), "--eval-batch-size", str(batch), "--eval-samples", str(batch)),
        *("--eval-every", "1000", "--steps", "5", "--no-progress"),
    ]


def _dry(script: Path, world: int, rank: int, mesh: str, args: list[str], out: Path, roles: str = "") -> list[str]:
    extra = ["--roles", roles] if roles else []
    return [
        *("run", "--dry-run", "--world-size", str(world), "--rank", str(rank), "--nproc-per-node", str(min(8, world))),
        *("--mesh", mesh, *extra, "--report-json", str(out), str(script), *args),
    ]


def _real_gpt_rank(args: list[str]) -> dict:
    """One rank of a real 4-rank GPT run, recording what a dry run reports (checkpoint plan only)."""
    sys.path.insert(0, str(GPT.parent))
    import train

    from meshwise import dryrun

    recorder = dryrun.begin(2)
    try:
        train.main(args)
    finally:
        dryrun.end()
    return json.loads(json.dumps(recorder.facts()))


def _comparable(facts: dict) -> dict:
    """What a dry run and a real run must agree on: coordinates, data slice and parts, local shapes and bytes."""
    topo = facts["topology"]
    return {
        "coordinates": topo["coordinates"],
        "data_rank": topo["data_rank"],
        "loaders": [{k: v for k, v in x.items() if k != "bytes_read"} for x in facts["loaders"]],
        "samples": [s["samples"] for s in facts["trainer_steps"]],
        "shapes": [s["shapes"] for s in facts["trainer_steps"]],
        "bytes_per_step": [s["bytes_read"] for s in facts["trainer_steps"]],
        "models": facts["models"],
        "optimizer_bytes": facts["optimizer_bytes"],
        "checkpoint_files": [[f["path"] for f in c["files"]] for c in facts["checkpoints"]],
    }


def _check_bytes(facts: dict) -> None:
    """The report's bytes per rank are its local tensors' bytes (float32 here), and no more than the model."""
    for model in facts["models"]:
        local = sum(4 * math.prod(p["local_shape"]) for p in model["parameters"])
        assert model["parameter_bytes"] == local == sum(p["bytes"] for p in model["parameters"])
        assert model["gradient_bytes"] == local
        assert local <= 4 * model["numel"]


@pytest.mark.slow
def test_dry_runs_of_the_examples_match_a_real_run(tmp_path: Path) -> None:
    np.save(tmp_path / "tokens.npy", (np.arange(800_000) * 7 % 61).astype(np.uint16))
    subprocess.run(
        [sys.executable, str(DOMAIN / "generate.py"), "--out", str(tmp_path / "heat"), "--samples", "512"]
        + ["--test-samples", "512", "--size", "16", "--steps", "2"],
        check=True,
        capture_output=True,
    )
    small, big = _gpt_args(tmp_path, 4), _gpt_args(tmp_path, 4096)
    runs = {("gpt", 4, r): _dry(GPT, 4, r, "dp=-1,tp=2", small, tmp_path / f"g4-{r}.json") for r in range(4)}
    for r in (0, 8191, 16383):
        runs[("gpt", 16384, r)] = _dry(GPT, 16384, r, "dp=-1,tp=4", big, tmp_path / f"g16k-{r}.json")
    domain = ["--data", str(tmp_path / "heat"), "--batch", "512"]
    runs[("domain", 1024, 1023)] = _dry(DOMAIN / "train.py", 1024, 1023, "dp=-1,domain=2", domain, tmp_path / "d.json")
    for argv in runs.values():  # one process per dry run, as the CLI runs them
        done = subprocess.run([sys.executable, "-m", "meshwise.launch", *argv], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "meshwise dry run (fake backend" in done.stdout
    facts = {key: json.loads(Path(argv[argv.index("--report-json") + 1]).read_text()) for key, argv in runs.items()}

    real = run_distributed(_real_gpt_rank, 4, small, env={"MESHWISE_MESH": "dp=-1,tp=2"}, timeout=300)
    for r in range(4):
        assert _comparable(facts[("gpt", 4, r)]) == _comparable(real[r])
        _check_bytes(real[r])
    for (name, world, rank), f in facts.items():
        topo = f["topology"]
        assert (topo["world_size"], topo["rank"], topo["backend"]) == (world, rank, "fake")
        _check_bytes(f)
        assert f["checkpoints"] or name == "domain"
        # bounded: the GPT's --steps 5 asked for more; the domain example's one epoch is one step of 512
        assert len(f["trainer_steps"]) == (2 if name == "gpt" else 1)
        if world == 16384:
            # tp=4 of the 4-rank run's tp=2: the same columns, halved again; FSDP then shards dim 0 over 4096
            assert topo["coordinates"] == {"dp": rank // 4, "tp": rank % 4}
            assert [len(s["samples"]) for s in f["trainer_steps"]] == [1, 1]
            q = next(p for p in f["models"][0]["parameters"] if p["name"].endswith("attn.q.weight"))
            assert q["local_shape"] == [1 if rank // 4 < 4 else 0, 16]
    samples = [f["trainer_steps"][0]["samples"][0] for (n, w, _), f in facts.items() if w == 16384]
    assert len(set(samples)) == 3  # three data ranks read three different samples
    d = facts[("domain", 1024, 1023)]
    assert d["topology"]["coordinates"] == {"dp": 511, "domain": 1}
    part = d["loaders"][0]["parts"]
    assert all(p["shape"][-1] < p["sample_shape"][-1] for p in part.values())  # half of each field (+ halo)


def test_bad_input_fails_as_a_real_launch(capsys: pytest.CaptureFixture[str]) -> None:
    before = dict(os.environ)
    assert launch.main(["run", "--dry-run", "--world-size", "8", "--rank", "8", "--mesh", "dp=-1", str(GPT)]) == 2
    assert "dry-run rank 8 is outside the world of 8 ranks" in capsys.readouterr().err
    assert launch.main(["run", "--dry-run", "--world-size", "8", "--rank", "0", "--mesh", "dp=3,tp=2", str(GPT)]) == 2
    assert "holds 6 ranks but the world size is 8" in capsys.readouterr().err
    argv = ["run", "--dry-run", "--world-size", "8", "--rank", "0", "--nproc-per-node", "3", str(GPT)]
    assert launch.main(argv) == 2
    assert "does not divide the world size 8" in capsys.readouterr().err
    assert dict(os.environ) == before  # a refused plan leaves the caller's environment as it was


def test_describe_summarises_a_large_world(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["describe", "--mesh", "dp=-1,cp=4,tp=16", "--world-size", "16384", "--nproc-per-node", "8"]
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 10 and "tp groups: 1024 of 16 ranks, 1 apart (the first: 0-15)" in out
    assert launch.main([*argv[:-4], "--world-size", "64", "--all-ranks"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 64 + 3
