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
        assert r["counts"] == r["ref_counts"], "engine.state.loss_count is not the global count of scored tokens"


def test_logs_written_once_and_plotted(run, tmp_path, capsys):
    run_dir, ranks = run
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["tag"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # one writer, not four
    assert all(r["epoch"] == 1 for r in train)
    assert [r["loss"] for r in train] == pytest.approx(ranks[0]["losses"], abs=1e-12)
    # every rank's peak memory once, at the run's end (the observer's one gather; tests/test_observe.py)
    assert sorted(r["tag"] for r in lines if r["tag"] != "train") == ["rank0", "rank1", "rank2", "rank3"]
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "tensorboard"]

    from meshwise.launch import main

    assert main(["plot", str(run_dir)]) == 0  # the `meshwise plot RUN_DIR` command, in this process
    assert capsys.readouterr().out.strip() == str(run_dir / "curves.png")
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from meshwise.errors import MeshwiseError
    from meshwise.plot import panels, plot_run, read_metrics

    records = [{"tag": t, "step": s, "loss": 1.0 / s, "acc": s / 10} for t in ("train", "val") for s in (1, 2, 3)]
    # a mixture's run: per-source metrics of the evaluator (sources=) and the realised shares of the trainer
    records += [{"tag": "val", "step": s, "acc/web": s / 20, "acc/code": s / 30} for s in (1, 2, 3)]
    records += [{"tag": "train", "step": s, "mix/web": 0.7, "mix/code": 0.3} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)))
    assert read_metrics(tmp_path)["acc"]["val"] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    grouped = panels(read_metrics(tmp_path))  # one panel a metric, a line per tag and source
    assert sorted(grouped) == ["acc", "loss", "mix"] and sorted(grouped["mix"]) == ["train code", "train web"]
    assert sorted(grouped["acc"]) == ["train", "val", "val code", "val web"]
    assert grouped["acc"]["val web"] == [(1, 0.05), (2, 0.1), (3, 0.15)]
    png = plot_run(tmp_path, tmp_path / "out" / "p.png")
    assert Path(png).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(MeshwiseError, match="RunLogger"):
        plot_run(tmp_path / "missing")


# --------------------------------------------------------------------------- one process: the step and the handlers


@pytest.fixture
def topo():
    import meshwise

    topology = meshwise.init({"dp": 1})  # a world of one needs no launch
    yield topology
    meshwise.shutdown()


def _regression(n: int = 12, seed: int = 0) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return [{"input": x[i : i + 4], "target": x[i : i + 4].sum(1, keepdim=True)} for i in range(0, n, 4)]


def test_train_step_alone_keeps_its_state(topo):
    import torch
    import torch.nn.functional as F

    from meshwise.engine import TrainStep

    torch.manual_seed(0)
    model, reference = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, grad_clip=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert (step.reference, step.loss_count, step.grad_norm) == (1.0, None, None)
    batches = _regression()
    batches[1] = {**batches[1], "valid": torch.tensor([True, False, True, True])}  # one padding row
    for batch in batches:
        keep = batch.get("valid", torch.ones(4, dtype=torch.bool))
        loss = F.mse_loss(reference(batch["input"][keep]), batch["target"][keep])
        ref_opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        assert step.train(batch) == pytest.approx(loss.item(), abs=1e-7)
        assert step.loss_count == step.reference == float(keep.sum())
        assert step.grad_norm == pytest.approx(norm.item(), rel=1e-6)
    assert torch.allclose(model.weight, reference.weight, atol=1e-7)


@pytest.mark.parametrize("weight", ["labels", "samples"])
def test_a_resumed_run_with_changing_counts_equals_an_unbroken_one(topo, weight):
    """Counts that change every step (ignored labels, padding rows) resume bit-equal: under "labels" backward is
    scaled by the step's own count; otherwise the step's reference (last global count) is in the engine state."""
    import torch
    import torch.nn.functional as F

    from meshwise.engine import create_trainer

    g = torch.Generator().manual_seed(5)
    batches = []
    for units in (5, 3, 4, 2):  # counts change every step; the resume follows a count of 3 (no power of two)
        target = torch.randint(0, 5, (6,), generator=g)
        valid = torch.arange(6) < units
        batch = {"input": torch.randn(6, 3, generator=g, dtype=torch.float64), "target": target}
        batches.append(
            {**batch, "target": target.masked_fill(~valid, -100)} if weight == "labels" else {**batch, "valid": valid}
        )

    class Float32Island(torch.nn.Module):  # as Hugging Face's RMSNorm inside a float64 model: backward rounds
        def forward(self, x):
            return torch.tanh(x.float()).to(x.dtype)

    def trainer_for():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), Float32Island(), torch.nn.Linear(8, 5)).double()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, opt, create_trainer(model, opt, F.cross_entropy, loss_weight=weight)

    model, _, trainer = trainer_for()
    trainer.run(batches, max_epochs=1)
    model2, opt2, trainer2 = trainer_for()
    trainer2.run(batches[:2], max_epochs=1)
    saved = (trainer2.state_dict(), model2.state_dict(), opt2.state_dict())
    model3, opt3, trainer3 = trainer_for()
    trainer3.load_state_dict({**saved[0], "epoch_length": 4})  # the same run, now told its full length
    model3.load_state_dict(saved[1])
    opt3.load_state_dict(saved[2])
    trainer3.run(batches[2:], max_epochs=1)  # a list has no cursor: hand it the batches left
    assert trainer3.state.iteration == 4
    assert all(torch.equal(a, b) for a, b in zip(model3.parameters(), model.parameters()))


def test_progress_bar_periodic_evaluation_and_time_budget(topo):
    import io

    import torch
    import torch.nn.functional as F
    from ignite.engine import Events
    from torchmetrics import MeanSquaredError

    import meshwise
    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.engine import PeriodicEvaluation, ProgressBar, TimeBudget, create_evaluator
    from meshwise.errors import MeshwiseError

    model = torch.nn.Linear(3, 1)
    trainer = meshwise.create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    x = torch.randn(10, 3)
    val = mesh_dataloader(
        ArrayDataset({"input": x, "target": x.sum(1, keepdim=True)}), global_batch_size=4, mode="eval"
    )
    evaluator = create_evaluator(model, metrics={"mse": MeanSquaredError()})
    periodic = PeriodicEvaluation(evaluator, val, every=2, at_start=True).attach(trainer)
    out = io.StringIO()
    bar = ProgressBar(total=5, desc="fit", file=out).attach(trainer, evaluators={"val": evaluator})
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(bar.postfix(e)))
    trainer.run(_regression(20), max_epochs=1)
    # evaluated before the first step, at 2 and 4, and at the end (5)
    assert [h["iteration"] for h in periodic.history] == [0, 2, 4, 5]
    assert periodic.latest == periodic.history[-1]["metrics"] == evaluator.state.metrics
    assert "fit[5/5]" in out.getvalue() and "val_mse=" in out.getvalue()
    # the loss, then the trainer's observer (lr, rate, memory), then the evaluator's metrics
    assert list(seen[-1]) == ["loss", "lr", "samples/s", "mem", "val_mse"]
    assert seen[-1]["loss"] == trainer.state.output and seen[-1]["lr"] == "0.1"
    again = PeriodicEvaluation(evaluator, val, every=2)
    again.load_state_dict(periodic.state_dict())
    assert again.history == periodic.history

    budget = TimeBudget(1e-9, check_every=3).attach(trainer)  # long over after 3 iterations
    trainer.run(_regression(40), max_epochs=1)
    assert trainer.state.iteration == 3 and budget.iterations == 3
    with pytest.raises(MeshwiseError, match="every must be a positive int"):
        PeriodicEvaluation(evaluator, val, every=0)
    with pytest.raises(MeshwiseError, match="positive number of seconds"):
        TimeBudget(0)


def _fit(root, max_epochs: int, batches: int = 3):
    import torch
    import torch.nn.functional as F

    import meshwise
    from meshwise.engine import Checkpointing

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss)
    ckpt = meshwise.Checkpointer(root, keep_last=2)
    handler = Checkpointing(ckpt, every_epochs=1, model=model, optimizer=opt).attach(trainer)
    trainer.run(_regression(4 * batches), max_epochs=max_epochs)
    ckpt.close()
    return trainer, handler, model


def test_checkpointing_resumes_and_says_when_nothing_is_left(topo, tmp_path, caplog):
    import logging

    import torch

    from meshwise.engine import Checkpointing
    from meshwise.errors import CheckpointError

    first, handler, model = _fit(tmp_path, max_epochs=2)
    assert handler.resumed is None and first.state.iteration == 6 and first.state.output is not None
    with caplog.at_level(logging.INFO, logger="meshwise.engine.handlers"):
        again, handler, resumed = _fit(tmp_path, max_epochs=2)
    assert handler.resumed.step == 6 and again.state.iteration == 6 and again.state.output is None
    said = f"checkpoint step 6 in {handler.checkpointer.root} already completes this run (max_epochs=2): nothing left"
    assert said in caplog.text and "delete that folder or give the run another one" in caplog.text, caplog.text
    assert torch.equal(resumed.weight, model.weight)
    more, handler, _ = _fit(tmp_path, max_epochs=3)  # one more epoch from the checkpoint of epoch 2
    assert handler.resumed.step == 6 and more.state.iteration == 9 and more.state.epoch == 3
    with pytest.raises(CheckpointError, match="iterations per epoch"):
        _fit(tmp_path, max_epochs=5, batches=4)  # another epoch length: another dataset or batch size
    with pytest.raises(CheckpointError, match="past this run's max_epochs=2"):
        _fit(tmp_path, max_epochs=2)
    with pytest.raises(CheckpointError, match="needs a meshwise.Checkpointer"):
        Checkpointing(object(), every_epochs=1)


def test_checkpointing_keeps_the_best_by_a_metric_of_the_trainer(topo, tmp_path):
    import torch
    import torch.nn.functional as F
    from ignite.engine import Events

    import meshwise
    from meshwise.engine import Checkpointing
    from meshwise.errors import CheckpointError

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss)
    scores = {1: 0.5, 2: 0.9, 3: 0.7, 4: 0.6}  # the best is epoch 2

    @trainer.on(Events.EPOCH_COMPLETED)
    def score(engine):
        engine.state.metrics["acc"] = scores[engine.state.epoch]

    ckpt = meshwise.Checkpointer(tmp_path, keep_last=1, keep_best=1, score="acc", mode="max")
    with pytest.raises(CheckpointError, match="cannot checkpoint steps=int"):
        Checkpointing(ckpt, every_epochs=1, model=model, steps=3)  # refused when built, not at the first save
    Checkpointing(ckpt, every_epochs=1, model=model, optimizer=opt).attach(trainer)
    trainer.run(_regression(8), max_epochs=4)
    ckpt.close()
    # the trainer is saved wrapped (EngineState): its state.metrics must still reach the score
    assert ckpt.steps() == [4, 8]
