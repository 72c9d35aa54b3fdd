"""meshwise run --dry-run: the GPT and domain examples as ranks of 1,024- and 16,384-rank worlds, checked
against a real 4-rank run and the local tensors; the bad-input errors of a real launch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshwise import launch
from meshwise.testing import process_context, run_distributed

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


def _heat(out: Path, samples: int, size: int = 16) -> None:
    """The domain example's Zarr layout (input ``[n, 2, size, size]``, target ``[n, 1, size, size]``, one sample a
    shard, half-width chunks), with no chunk written: a dry run reads one or two samples a rank, which come back
    as zeros, and the planned job's dataset costs no time or disk here."""
    import zarr

    for split, n in (("train", samples), ("test", 512)):
        root = zarr.open_group(str(out / f"heat_{split}.zarr"), mode="w")
        for name, c in (("input", 2), ("target", 1)):
            shape = (n, c, size, size)
            root.create_array(
                name, shape=shape, dtype="float32", chunks=(1, c, size, size // 2), shards=(1, *shape[1:])
            )


def _dry_run_in_a_fresh_process(argv: list[str]) -> tuple[int, str, str]:
    """``meshwise run --dry-run ...`` as the command line runs it, in this (fresh) process: code, stdout, stderr."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = launch.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_dry_runs_of_the_examples_match_a_real_run(tmp_path: Path) -> None:
    np.save(tmp_path / "tokens.npy", (np.arange(800_000) * 7 % 61).astype(np.uint16))
    _heat(tmp_path / "heat", 8192)
    small = _gpt_args(tmp_path, 4)
    runs = {("gpt", 4, r): _dry(GPT, 4, r, "dp=-1,tp=2", small, tmp_path / f"g4-{r}.json") for r in range(4)}
    # the first, a middle and the last rank of 1,024- and 16,384-rank worlds: the GPT at tp=4 (its global batch
    # one sample per data rank), the domain example at domain=2
    for world in (1024, 16384):
        for r in (0, world // 2 - 1, world - 1):
            gpt = _gpt_args(tmp_path, world // 4)
            runs[("gpt", world, r)] = _dry(GPT, world, r, "dp=-1,tp=4", gpt, tmp_path / f"g{world}-{r}.json")
            domain = ["--data", str(tmp_path / "heat"), "--batch", str(world // 2)]
            out = tmp_path / f"d{world}-{r}.json"
            runs[("domain", world, r)] = _dry(DOMAIN / "train.py", world, r, "dp=-1,domain=2", domain, out)
    # one process per dry run: the first through the command line (GPT rank 0 prepares the corpus), then the
    # others two at a time, each in a fresh process forked with torch imported (as 16 command lines they spent
    # most of a minute importing torch; the command line itself is the first run's and the next test's)
    argvs = list(runs.values())
    first = subprocess.run(
        [sys.executable, "-m", "meshwise.launch", *argvs[0]], capture_output=True, text=True, timeout=240
    )
    with ProcessPoolExecutor(2, mp_context=process_context(), max_tasks_per_child=1) as pool:
        rest = list(pool.map(_dry_run_in_a_fresh_process, argvs[1:], timeout=240))
    for code, stdout, stderr in [(first.returncode, first.stdout, first.stderr), *rest]:
        assert code == 0, stderr[-3000:]
        assert "meshwise dry run (fake backend" in stdout
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
        # bounded at 2 steps: the GPT's --steps 5 asked for more, the domain example's epoch is 16 steps at 1,024
        # ranks (8,192 samples, global batch 512) and one at 16,384
        assert len(f["trainer_steps"]) == (1 if (name, world) == ("domain", 16384) else 2)
        if name == "gpt" and world > 4:
            # tp=4 of the 4-rank run's tp=2: the same columns, halved again; FSDP then shards dim 0 over world/4
            assert topo["coordinates"] == {"dp": rank // 4, "tp": rank % 4}
            assert [len(s["samples"]) for s in f["trainer_steps"]] == [1, 1]
            q = next(p for p in f["models"][0]["parameters"] if p["name"].endswith("attn.q.weight"))
            assert q["local_shape"] == [1 if rank // 4 < 4 else 0, 16]
        if name == "domain":
            # one sample a data rank: the input's columns 0-7 or 8-15 by the domain coordinate, with the model's one
            # halo column; the target's without
            assert topo["coordinates"] == {"dp": rank // 2, "domain": rank % 2}
            assert all(len(s["samples"]) == 1 for s in f["trainer_steps"])
            parts = f["loaders"][0]["parts"]
            assert parts["input"]["regions"][0][-1] == [[0, 9], [7, 16]][rank % 2]
            assert parts["target"]["regions"][0][-1] == [[0, 8], [8, 16]][rank % 2]
    for name, world in (("gpt", 1024), ("gpt", 16384), ("domain", 1024), ("domain", 16384)):
        samples = [f["trainer_steps"][0]["samples"][0] for (n, w, _), f in facts.items() if (n, w) == (name, world)]
        assert len(set(samples)) == 3, (name, world)  # three data ranks read three different samples


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


SCRIPT = '''
"""A user's script: samples made from their shapes (nothing prepared on disk), a map-style and a streaming
loader, checkpoints every step into a run folder that already holds a run, and a resume at the end."""
import sys

import torch
from torch.utils.data import Dataset, IterableDataset

import meshwise
from meshwise.data import mesh_dataloader
from meshwise.engine.handlers import Checkpointing


def sample(i):
    g = torch.Generator().manual_seed(i)
    return {"input": torch.randn(8, generator=g, dtype=torch.float64), "target": torch.randn(1, dtype=torch.float64)}


class Shapes(Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        return sample(int(i))


class Stream(IterableDataset):
    def __iter__(self):
        i = 0
        while True:
            yield sample(i)
            i += 1


topo = meshwise.init()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).double()
model = meshwise.parallelize(net, topo, dp="fsdp")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mapped = mesh_dataloader(Shapes(), topo, global_batch_size=2 * topo.data_size, mode="train")
stream = mesh_dataloader(Stream(), topo, global_batch_size=2 * topo.data_size, mode="train")
ckpt = meshwise.Checkpointer(sys.argv[1] + "/checkpoints", topo, keep_last=1)
for loader in (mapped, stream):
    trainer = meshwise.create_trainer(model, opt, torch.nn.functional.mse_loss, topo)
    Checkpointing(ckpt, every_iterations=1, model=model, optimizer=opt).attach(trainer)
    trainer.run(loader, max_epochs=1)
info = ckpt.load("latest", model=model, optimizer=opt)
print("resumed:", info.message)
ckpt.close()
meshwise.shutdown()
'''


def _tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``root``: size, modification time and bytes."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in root.rglob("*")
        if p.is_file()
    }


def test_a_dry_run_ignores_an_existing_run_folder_and_describes_both_loaders(tmp_path: Path) -> None:
    script, run, out = tmp_path / "train.py", tmp_path / "run", tmp_path / "report.json"
    script.write_text(SCRIPT)
    # a run folder that holds a run: a committed-looking step whose files are junk, and 'latest' naming it; a read
    # of either (a resume, a retention pass, a root check) fails or changes them
    (run / "checkpoints" / "step-7").mkdir(parents=True)
    (run / "checkpoints" / "step-7" / "meshwise.json").write_text("not json")
    (run / "checkpoints" / "latest").write_text("7\n")
    (run / "notes.txt").write_text("the first phase\n")
    before = _tree(run)
    world, rank = 4096, 4095
    argv = ["run", "--dry-run", "--world-size", str(world), "--rank", str(rank)]
    argv += ["--mesh", "dp=-1", "--report-json", str(out), str(script), str(run)]
    done = subprocess.run(
        [sys.executable, "-m", "meshwise.launch", *argv], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _tree(run) == before  # nothing read into, written to or removed from the run folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "run", "train.py"]  # no hang-report folder
    facts = json.loads(out.read_text())
    mapped, stream = facts["loaders"]
    assert mapped["kind"] == "map-style" and mapped["dataset"].endswith("Shapes")
    assert (mapped["dataset_length"], mapped["steps_per_epoch"], mapped["local_batch_size"]) == (1 << 20, 128, 2)
    assert (mapped["data_rank"], mapped["data_size"]) == (rank, world)
    assert stream["kind"] == "stream" and stream["dataset"].endswith("Stream")
    assert (stream["dataset_length"], stream["steps_per_epoch"], stream["local_batch_size"]) == (None, None, 2)
    assert "(map-style, train)" in done.stdout and "(stream, train): __main__.Stream, a stream" in done.stdout
    # the 2 planned steps (the default) on the first trainer; a later trainer stops after its first step. Each step
    # saved (planned, not written); the load at the end read nothing
    assert [len(s["samples"]) for s in facts["trainer_steps"]] == [2, 2, 2]
    assert [c["folder"] for c in facts["checkpoints"]] == [f"{run}/checkpoints/step-{i}" for i in (1, 2, 1)]
    assert facts["loads"] == [{"folder": f"{run}/checkpoints", "entry": "latest", "objects": ["model", "optimizer"]}]
    assert "resumed: dry run: checkpoint 'latest'" in done.stdout
    # every parameter has fewer rows than the 4,096 data ranks: one piece of advice, once (not per step or trainer)
    advice = [a for a in facts["advice"] if "FSDP2" in a]
    assert len(advice) == 1 and done.stderr.count("PlacementWarning: FSDP2") == 1
    for name in ("0.weight (64 along dim 0)", "0.bias (64 along dim 0)", "2.weight (1 along dim 0)", "2.bias (1 "):
        assert name in advice[0]
    assert "shard_placement_fn" in advice[0] and "dp='replicate'" in advice[0]


def _gpt_example() -> Any:
    """examples/gpt/train.py as a module (its sibling modules imported the way the script imports them)."""
    names = ("train", "model", "prepare")  # other examples (imported by earlier tests) have modules of these names
    others = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    sys.path.insert(0, str(GPT.parent))
    try:
        import train
    finally:
        sys.path.remove(str(GPT.parent))
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(others)
    return train


def test_a_dry_run_of_the_gpt_example_leaves_its_run_folder_and_log_alone(tmp_path: Path) -> None:
    import meshwise
    from meshwise import dryrun
    from meshwise.engine import RunLogger
    from meshwise.errors import MeshwiseError

    train = _gpt_example()
    run = tmp_path / "run"
    (run / "checkpoints" / "step-7").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("7\n")
    (run / "config.json").write_text('{"model": {}, "args": {}}')
    (run / "metrics.jsonl").write_text('{"tag": "train", "step": 7, "loss": 1.5}\n')
    before, paths = _tree(run), sorted(tmp_path.rglob("*"))
    topo = meshwise.init({"dp": 1})  # rank 0: the rank that would clear the folder and write the log
    try:
        recorder = dryrun.begin(2)
        try:
            for argv in (
                ["--run-dir", str(run)],  # a real run refuses: the folder holds a run
                ["--run-dir", str(run), "--overwrite"],  # a real run deletes it
                ["--resume", str(tmp_path / "none")],  # a real run reads its config.json (and refuses: none there)
            ):
                assert train.open_run_folder(train.parse_args(argv), topo) == Path(argv[1])
            for folder in (run, tmp_path / "new"):
                logger = RunLogger(folder, topo)
                assert not logger.enabled
                logger.log("train", {"loss": 0.25}, step=8, epoch=1)
                logger.close()
        finally:
            assert dryrun.end() is recorder
        assert _tree(run) == before and sorted(tmp_path.rglob("*")) == paths
        # the same calls outside a dry run: the refusal and the log the dry run left out
        with pytest.raises(MeshwiseError, match="already holds a run: pass --resume"):
            train.open_run_folder(train.parse_args(["--run-dir", str(run)]), topo)
        with RunLogger(tmp_path / "new", topo, tensorboard=False) as logger:
            logger.log("train", {"loss": 0.25}, step=8, epoch=1)
        assert json.loads((tmp_path / "new" / "metrics.jsonl").read_text())["loss"] == 0.25
    finally:
        meshwise.shutdown()
