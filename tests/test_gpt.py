"""The GPT example: its TP plan with FSDP2 trains like one process (dp=2 x tp=2, tp=4), and its data split."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshwise.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

import model as gpt  # noqa: E402
import prepare  # noqa: E402

TINY = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=32)
GLOBAL_BATCH = 8
STEPS = 4


def _batches(cfg: gpt.GPTConfig, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.block_size + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _train_reference(model: torch.nn.Module, batches, lr: float, clip: float | None = None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _max_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    from torch.distributed.tensor import DTensor

    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        worst = max(worst, (got - ref[name].detach()).abs().max().item())
    return worst


def _equivalence(topo, lr: float = 1e-3, clip: float = 0.5) -> dict:
    """One process vs the TP plan (+ FSDP2 over dp): applied with torch's own APIs, and through meshwise's
    parallelize + create_trainer (token-weighted loss, loss_parallel step context, global-norm clipping)."""
    import torch.distributed as dist
    from ignite.engine import Events
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    import meshwise

    cfg = gpt.GPTConfig(**TINY)
    batches = _batches(cfg, STEPS)
    tp = topo.sizes.get("tp", 1)
    gpt.check_tp_degree(cfg, tp)
    dp = topo.data_size
    b_local = GLOBAL_BATCH // dp
    lo = topo.data_rank * b_local
    out = {}

    # 1. torch's own APIs.
    torch.manual_seed(0)
    model = gpt.GPT(cfg)  # full weights under one seed, then shard (docs/torch.md, random numbers)
    reference = copy.deepcopy(model)
    ref_losses = _train_reference(reference, batches, lr)
    if tp > 1:
        model = parallelize_module(model, topo.submesh("tp"), gpt.tp_plan(model))
    if dp > 1:
        dp_mesh = topo.submesh(topo.batch_dims)
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for x, y in batches:
        x, y = x[lo : lo + b_local], y[lo : lo + b_local]
        with loss_parallel():
            loss = gpt.token_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
        opt.step()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss.detach()
        if dp > 1:
            dist.all_reduce(value, group=topo.group(topo.batch_dims))
            value = value / dp
        losses.append(value.item())
    out["max_param_diff"] = _max_diff(model, reference)
    out["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))

    # 2. meshwise.parallelize + create_trainer, against one process with clipping.
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    reference = copy.deepcopy(model)
    ref_losses = _train_reference(reference, batches, lr, clip=clip)
    model = meshwise.parallelize(model, topo, tp_plan=gpt.tp_plan, dp="fsdp", fsdp_units=gpt.Block)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    trainer = meshwise.create_trainer(
        model, opt, gpt.token_loss, topo, grad_clip=clip, loss_weight="tokens", step_context=loss_parallel
    )
    ones = torch.ones(b_local, dtype=torch.bool)
    local = [{"input": x[lo : lo + b_local], "target": y[lo : lo + b_local], "valid": ones} for x, y in batches]
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    trainer.run(local, max_epochs=1)
    out["trainer_max_param_diff"] = _max_diff(model, reference)
    out["trainer_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    out["clipped"] = getattr(trainer.state, "grad_norm", 0.0) > clip
    return out


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"tp": 4}])
def test_tp_plan_matches_one_process(mesh):
    results = run_distributed(_equivalence, 4, mesh=mesh, timeout=90)
    for r in results:
        for key in ("max_param_diff", "loss_diff", "trainer_max_param_diff", "trainer_loss_diff"):
            assert r[key] <= 1e-5, (mesh, key, r)
        assert r["clipped"], r  # the clip was active, so the global-norm path was exercised


# --------------------------------------------------------------------------- data preparation


def _corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for i in range(20):
        sub = src / ("pkg" if i % 3 else "") / f"m{i:02d}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(f"# module {i}\n" + "x = 1\n" * (i + 1))
    (src / "site-packages").mkdir()
    (src / "site-packages" / "foreign.py").write_text("not part of the corpus\n")
    return src


def test_prepare_split_is_deterministic_and_disjoint(tmp_path):
    src = _corpus(tmp_path)
    a = prepare.prepare(tmp_path / "a", source_dir=src, val_fraction=0.2)
    b = prepare.prepare(tmp_path / "b", source_dir=src, val_fraction=0.2)
    assert a["train_files"] == b["train_files"] and a["val_files"] == b["val_files"]
    assert not set(a["train_files"]) & set(a["val_files"])
    assert sorted(a["train_files"] + a["val_files"]) == a["train_files"] + a["val_files"]  # sorted, val last
    assert not any("site-packages" in f for f in a["train_files"] + a["val_files"])
    train = np.load(tmp_path / "a" / "train.npy", mmap_mode="r")
    val = np.load(tmp_path / "a" / "val.npy", mmap_mode="r")
    assert train.dtype == np.uint8 and val.dtype == np.uint8
    assert np.array_equal(train, np.load(tmp_path / "b" / "train.npy"))
    # Independent oracle: the bytes of the files, concatenated in sorted order.
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.py") if "site-packages" not in p.parts)
    blob = b"".join((src / f).read_bytes() for f in files)
    assert bytes(train) + bytes(val) == blob
    assert bytes(val) == b"".join((src / f).read_bytes() for f in a["val_files"])
    assert 0.1 < len(val) / len(blob) < 0.4

    text = tmp_path / "book.txt"
    text.write_bytes(bytes(range(256)) * 40)
    c = prepare.prepare(tmp_path / "c", text=text, val_fraction=0.1)
    t, v = np.load(tmp_path / "c" / "train.npy"), np.load(tmp_path / "c" / "val.npy")
    assert bytes(t) + bytes(v) == text.read_bytes() and len(v) == c["val_tokens"] == 1024
    tokens = tmp_path / "tok.npy"
    np.save(tokens, np.arange(1000, dtype=np.uint16) % 300)
    d = prepare.prepare(tmp_path / "d", tokens=tokens, val_fraction=0.1)
    assert d["vocab_size"] == 300 and np.load(tmp_path / "d" / "train.npy").dtype == np.uint16


# --------------------------------------------------------------------------- pipeline stages (train.py at pp)

PP_ARGS = [*("--d-model", "32", "--n-layer", "2", "--n-head", "4", "--block-size", "16", "--batch-size", "8")]
PP_ARGS += [*("--steps", "4", "--eval-every", "2", "--eval-samples", "20", "--eval-batch-size", "8")]
PP_ARGS += [*("--lr", "3e-3", "--warmup", "1", "--no-progress", "--schedule", "1F1B", "--microbatches", "2")]


def _train_phase(run_dir: str, data_dir: str, mesh: str) -> dict:
    """train.py's main, as `meshwise run ... train.py` runs it: the summary row and the per-step losses."""
    import json
    import sysconfig

    import train

    import meshwise

    corpus = str(Path(sysconfig.get_paths()["stdlib"]) / "json")  # real text, a few files: one is held out
    argv = ["--mesh", mesh, "--run-dir", run_dir, "--overwrite", "--source-dir", corpus, "--data-dir", data_dir]
    row = train.main([*argv, *PP_ARGS])
    meshwise.shutdown()
    records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    row["losses"] = [r["loss"] for r in records if r["tag"] == "train"]
    row["val_losses"] = [r["loss"] for r in records if r["tag"] == "val"]
    return row


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gpt_pp1")
    return run_distributed(_train_phase, 1, str(tmp / "run"), str(tmp / "data"), "dp=1", timeout=120)[0]


def _check_pipeline_run(rows: list[dict], reference: dict, stage_of: list[int]) -> float:
    """Every rank reports the one-process losses (float32: summation order only), and each stage read one field;
    returns the largest loss difference."""
    worst = 0.0
    for rank, row in enumerate(rows):
        assert len(row["losses"]) == 4 and len(row["val_losses"]) == 3, row  # held out at steps 0, 2, 4
        for key in ("losses", "val_losses"):
            diff = max(abs(a - b) for a, b in zip(row[key], reference[key]))
            assert diff <= 2e-5, (rank, key, row[key], reference[key])
            worst = max(worst, diff)
        assert row["val_losses"][-1] < row["val_losses"][0] - 0.2, row  # it learns
    # Input and target windows are the same size, so each stage reads half of what one process reads: the
    # first stage only inputs, the last only targets (stage_fields), over its data-parallel ranks together.
    total = reference["bytes_read"][0]
    for stage in sorted(set(stage_of)):
        got = sum(b for b, s in zip(rows[0]["bytes_read"], stage_of) if s == stage)
        assert got * 2 == total, (stage, rows[0]["bytes_read"], total)
    return worst


def _plain_held_out(run_dir: Path, step: int) -> float:
    """Oracle in this process, plain torch: the checkpoint's model loaded through DCP without meshwise or a
    process group, the cross-entropy of every held-out token of the evaluated windows in one pass."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp

    config = json.loads((run_dir / "config.json").read_text())
    cfg, args = gpt.GPTConfig(**config["model"]), config["args"]
    tokens = np.load(Path(args["data_dir"]) / f"src-{Path(args['source_dir']).stem}" / "val.npy")
    n = min(len(tokens) // (cfg.block_size + 1), args["eval_samples"])
    w = torch.from_numpy(tokens[: n * (cfg.block_size + 1)].astype(np.int64)).view(n, cfg.block_size + 1)
    model = gpt.GPT(cfg)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(state, checkpoint_id=str(run_dir / "checkpoints" / f"step-{step}"))
    model.load_state_dict(state["model"])
    with torch.no_grad():
        return F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten()).item()


def test_train_py_at_pp2_dp2_matches_one_process(tmp_path, one_process_run):
    rows = run_distributed(_train_phase, 4, str(tmp_path / "run"), str(tmp_path / "data"), "pp=2,dp=2", timeout=200)
    worst = _check_pipeline_run(rows, one_process_run, stage_of=[0, 0, 1, 1])
    assert all(b > 0 for b in rows[0]["bytes_read"]), rows[0]  # every rank reads its own samples' field
    # the stages' checkpoint holds the whole model under its one-process names: plain torch loads it
    oracle = _plain_held_out(tmp_path / "run", 4)
    assert abs(oracle - rows[0]["val_loss"]) <= 1e-5, (oracle, rows[0]["val_loss"])
    print(
        "pp=2,dp=2: loss diff",
        worst,
        "checkpoint oracle diff",
        abs(oracle - rows[0]["val_loss"]),
        "bytes",
        rows[0]["bytes_read"],
        "one process",
        one_process_run["bytes_read"],
    )


@pytest.mark.slow
def test_train_py_at_pp2_dp2_tp2_matches_one_process(tmp_path, one_process_run):
    rows = run_distributed(
        _train_phase, 8, str(tmp_path / "run"), str(tmp_path / "data"), "pp=2,dp=2,tp=2", timeout=400
    )
    worst = _check_pipeline_run(rows, one_process_run, stage_of=[0] * 4 + [1] * 4)
    print("pp=2,dp=2,tp=2: loss diff", worst, "bytes", rows[0]["bytes_read"])
    # read="broadcast": the first rank of each tensor-parallel pair reads, the other receives
    assert [b > 0 for b in rows[0]["bytes_read"]] == [True, False] * 4, rows[0]["bytes_read"]
