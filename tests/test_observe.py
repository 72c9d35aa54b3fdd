"""A run you can watch (rate, lr, memory, data read, MFU from torch's FLOP counter in the bar and the log; `meshwise
report`) and ignite habits handled when attached (ignite bars/loggers on every rank, ModelCheckpoint of shards,
TensorDataset tuples, quiet logging on other ranks): one 4-rank launch at dp=2 x tp=2, then checks in this process."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import pytest

from meshwise.testing import run_distributed

IN, HID, OUT, GLOBAL_BATCH, SAMPLES, LR, PEAK = 16, 32, 8, 8, 32, 0.05, 1e12


def linear_flops(batch: int) -> int:
    """The oracle: 2*m*n*k per matmul; forward and weight gradient for both layers, the input gradient for the
    second only (the data needs none), so 3x the forward for the second layer and 2x for the first."""
    first, second = 2 * batch * IN * HID, 2 * batch * HID * OUT
    return 2 * first + 3 * second


def _net():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT)).double()


def _data():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, IN, generator=g, dtype=torch.float64), torch.randn(
        SAMPLES, OUT, generator=g, dtype=torch.float64
    )


def _ranks_body(topo, run_dir: str) -> dict:
    """Everything a user writes on every rank, with this rank's stdout/stderr captured."""
    import torch
    import torch.nn.functional as F
    from ignite.contrib.handlers import TensorboardLogger
    from ignite.contrib.handlers.tensorboard_logger import OutputHandler
    from ignite.engine import Events
    from ignite.handlers import ModelCheckpoint
    from ignite.handlers import ProgressBar as IgniteBar
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.utils.data import TensorDataset

    import meshwise
    from meshwise import compat
    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.engine import ProgressBar, RunLogger, setup_logging
    from meshwise.engine.observe import observer_of
    from meshwise.errors import CheckpointError, MeshwiseError

    out: dict = {}
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        setup_logging(topo)
        out["root_level"] = logging.getLogger().level
        logging.getLogger("ignite.engine.engine.Engine").info("an ignite INFO line")
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        x, y = _data()

        def make(dataset):
            model = meshwise.parallelize(_net(), topo, tp_plan=plan)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            loader = mesh_dataloader(dataset, topo, global_batch_size=GLOBAL_BATCH)
            return model, opt, meshwise.create_trainer(model, opt, F.mse_loss, topo), loader

        model, opt, trainer, loader = make(ArrayDataset({"input": x.numpy(), "target": y.numpy()}))
        observer = observer_of(trainer)
        observer.peak_flops = PEAK
        bar_text = io.StringIO()
        ProgressBar(topo, file=bar_text, ncols=200, mininterval=0).attach(trainer)
        RunLogger(run_dir, topo, tensorboard=False).attach(trainer)
        # a user's ignite habits, on every rank
        ignite_bar_text = io.StringIO()
        IgniteBar(file=ignite_bar_text, mininterval=0).attach(trainer)
        tb = TensorboardLogger(log_dir=str(Path(run_dir) / f"ignite_tb_{topo.rank}"))
        tb.attach(trainer, OutputHandler(tag="train", output_transform=lambda o: o), Events.ITERATION_COMPLETED)
        evaluator = meshwise.create_evaluator(model, topo)
        try:
            evaluator.add_event_handler(
                Events.COMPLETED, ModelCheckpoint(str(Path(run_dir) / f"ck{topo.rank}"), "m"), {"model": model}
            )
            out["checkpoint_refused"] = None
        except CheckpointError as exc:
            out["checkpoint_refused"] = str(exc)
        out["checkpoint_left"] = sum(
            type(h).__name__ == "ModelCheckpoint" for _, h, _, _ in compat.event_handlers(evaluator)
        )
        trainer.run(loader, max_epochs=2)
        tb.close()
        torch.distributed.barrier()  # every rank's epoch-end record was posted and read
        store = compat.default_store()
        keys = [f"meshwise/observe/{s}/{r}" for s in range(1, trainer.state.iteration + 1) for r in range(4)]
        out["records_left"] = [k for k in keys if store.check([k])]
        out["ignite_handlers"] = sum(
            type(h).__name__ == "_OutputHandler" for _, h, _, _ in compat.event_handlers(trainer)
        )
        out["observed"] = dict(trainer.state.observed)
        out["flops_per_step"] = observer.flops_per_step
        out["losses_dict"] = None
        # TensorDataset: the same data as tuples trains the same (named input/target); three fields are refused
        _, _, trainer2, loader2 = make(TensorDataset(x, y))
        losses = []
        trainer2.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
        trainer2.run(loader2, max_epochs=1)
        out["losses_tuple"] = losses
        _, _, trainer3, loader3 = make(TensorDataset(x, y, y))
        try:
            trainer3.run(loader3, max_epochs=1)
            out["three_fields"] = None
        except MeshwiseError as exc:
            out["three_fields"] = str(exc)
        # the refused first step ran under the FLOP counter: it is left (no torch mode goes on counting)
        out["counter_left"] = observer_of(trainer3)._counter is not None
        logging.getLogger().handlers.clear()
    out["bar"] = bar_text.getvalue()
    out["ignite_bar"] = ignite_bar_text.getvalue()
    out["output"] = buffer.getvalue()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("observe")
    return run_dir, run_distributed(_ranks_body, 4, str(run_dir), mesh={"dp": 2, "tp": 2}, timeout=150)


def test_bar_and_log_carry_rate_lr_memory_and_mfu(run):
    run_dir, ranks = run
    bar = ranks[0]["bar"]
    assert "epoch 2/2" in bar and "lr=0.05" in bar and "samples/s=" in bar and "mem=" in bar and "mfu=" in bar, bar
    assert all(r["bar"] == "" for r in ranks[1:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["tag"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    for r in train:
        assert r["lr"] == LR and r["peak_mem_mb"] > 10 and r["flops_per_step"] == linear_flops(GLOBAL_BATCH)
    for r in train[1:]:  # the first step ran under the FLOP counter: no rate from it
        assert r["samples_per_s"] == pytest.approx(GLOBAL_BATCH / r["step_time_s"], rel=1e-9)
        assert r["mfu"] == pytest.approx(r["flops_per_step"] / r["step_time_s"] / (4 * PEAK), rel=1e-9)
    assert all(r["records_left"] == [] for r in ranks)  # read once, not kept in the store for every epoch
    per_rank = {r["tag"]: r for r in records if r["tag"].startswith("rank")}
    assert sorted(per_rank) == ["rank0", "rank1", "rank2", "rank3"]
    for r in per_rank.values():
        assert r["peak_mem_mb"] > 10 and r["data_mb_read"] > 0
    # dp peers read different halves, tp peers the same samples
    assert per_rank["rank0"]["data_mb_read"] == per_rank["rank1"]["data_mb_read"]
    for r in ranks:
        assert r["flops_per_step"] == linear_flops(GLOBAL_BATCH)  # sum over ranks / tp: the one-process count


def test_ignite_habits_handled_when_attached(run):
    run_dir, ranks = run
    assert "8/8" in ranks[0]["ignite_bar"] or "4/4" in ranks[0]["ignite_bar"], ranks[0]["ignite_bar"]
    assert all(r["ignite_bar"] == "" for r in ranks[1:])  # ignite's bar kept on rank 0 only
    assert [r["ignite_handlers"] for r in ranks] == [1, 0, 0, 0]  # the TensorboardLogger's handler too
    said = "UserWarning: ignite's TensorboardLogger is attached on every rank"
    assert ranks[0]["output"].count(said) == 1 and "if topo.rank == 0" in ranks[0]["output"], ranks[0]["output"]
    assert all(said not in r["output"] for r in ranks[1:])
    for r in ranks:  # refused at attach, before any training; nothing left attached
        assert r["checkpoint_refused"] and "MeshSaver" in r["checkpoint_refused"] and r["checkpoint_left"] == 0
        assert r["three_fields"] and "'0', '1', '2'" in r["three_fields"] and "prepare=" in r["three_fields"]
        assert r["counter_left"] is False
    assert ranks[0]["root_level"] == logging.INFO and all(r["root_level"] == logging.WARNING for r in ranks[1:])
    assert all("an ignite INFO line" not in r["output"] for r in ranks)


def test_tensor_dataset_trains_like_dict_samples(run):
    _, ranks = run
    import torch
    import torch.nn.functional as F
    from ignite.engine import Events

    import meshwise
    from meshwise.data import ArrayDataset, mesh_dataloader

    topo = meshwise.init({"dp": 1})
    try:
        model = meshwise.parallelize(_net(), topo)
        trainer = meshwise.create_trainer(model, torch.optim.SGD(model.parameters(), lr=LR), F.mse_loss, topo)
        x, y = _data()
        losses = []
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
        trainer.run(mesh_dataloader(ArrayDataset({"input": x, "target": y}), topo, global_batch_size=8), max_epochs=1)
        flops = trainer.state.observed["flops_per_step"]
    finally:
        meshwise.shutdown()
    assert flops == linear_flops(GLOBAL_BATCH)  # one process counts what dp=2 x tp=2 counts
    for r in ranks:
        assert r["losses_tuple"] == pytest.approx(losses, abs=1e-12)


def test_report_and_smoothed_plot(run, capsys):
    run_dir, _ = run
    ck = run_dir / "checkpoints"
    for step in (4, 8):
        (ck / f"step-{step}").mkdir(parents=True)
    (ck / "latest").write_text("step-8")
    from meshwise.launch import main

    assert main(["report", str(run_dir)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert len(lines) <= 24, text
    for piece in (
        "steps      1 to 8, epoch 2",
        "samples/s",
        "lr         0.05 to 0.05",
        "MFU",
        "peak MB    r0=",
        "read MB",
    ):
        assert piece in text, text
    assert f"checkpoint {ck}: step-4, step-8, latest = step-8" in text
    from meshwise.plot import plot_run, smoothed

    assert smoothed([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no pull towards 0
    assert smoothed([0.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3])
    assert Path(plot_run(run_dir, smooth=0.8)).read_bytes()[:4] == b"\x89PNG"
