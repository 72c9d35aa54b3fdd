"""ignite habits on a mesh, written as an ignite user writes them: create_supervised_trainer/evaluator on
mesh_dataloader batches (global loss, gradients of one process), idist with the topology's groups, and
idist.auto_dataloader / a world-sharded loader / idist.auto_model stopped with a named error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshwise.testing import run_distributed


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    return {"input": x, "target": x.sin().sum(1, keepdim=True)}


def _model(topo):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import meshwise

    torch.manual_seed(0)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()} if topo.replica_dims else None
    return meshwise.parallelize(MLP().double(), topo, tp_plan=plan, dp="fsdp")


def _full(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def _supervised(topo) -> dict:
    """ignite's own create_supervised_trainer on mesh_dataloader batches, with meshwise's prepare_batch and
    output_transform; the evaluator likewise. Runs unchanged in one process and on the mesh."""
    import ignite.distributed as idist
    from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
    from ignite.metrics import MeanSquaredError

    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.engine import ignite_engine as habits
    from meshwise.testing import CollectiveCounter

    model = _model(topo)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = mesh_dataloader(ArrayDataset(_data(96)), topo, global_batch_size=16, mode="train")
    trainer = create_supervised_trainer(
        model,
        opt,
        nn.functional.mse_loss,
        device=topo.device,
        prepare_batch=habits.prepare_batch(topo),
        output_transform=habits.global_loss(topo),
    )
    losses, gathers = [], []
    counter = CollectiveCounter(("all_gather",))

    @trainer.on(Events.ITERATION_STARTED)
    def _count_start(_):
        counter.calls.clear()
        counter.__enter__()

    @trainer.on(Events.ITERATION_COMPLETED)
    def _record(engine):
        counter.__exit__()
        gathers.append(len(counter.calls))
        losses.append(engine.state.output)

    habits.on_mesh(trainer, topo, model=model)  # after the counter's handler: its check runs inside the count
    trainer.run(train, max_epochs=2)
    # the topology's groups for idist: a count over the metric dims is the global count, not ×tp
    count = idist.all_reduce(torch.tensor(float(topo.data_rank < 99)), group=topo.group(topo.metric_dims))
    val = mesh_dataloader(ArrayDataset(_data(13, 1)), topo, global_batch_size=8, mode="eval")
    outputs = []
    evaluator = create_supervised_evaluator(
        model, device=topo.device, prepare_batch=habits.prepare_batch(topo, train=False)
    )
    MeanSquaredError().attach(evaluator, "mse")  # ignite's own metric: padded rows left out by on_mesh
    habits.on_mesh(evaluator, topo)
    evaluator.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: outputs.append((e.state.output[0].shape[0], int(e.state.batch["valid"].sum()))),
    )
    evaluator.run(val)
    params = _full(model)
    stop_epoch, scores = _early_stopping(topo, train, val)
    return {
        "stop_epoch": stop_epoch,
        "scores": scores,
        "params": params,
        "losses": losses,
        "gathers": gathers,
        "count": float(count),
        "eval": outputs,
        "mse": evaluator.state.metrics["mse"],
    }


def _early_stopping(topo, train, val) -> tuple[int, list[float]]:
    """ignite's EarlyStopping on the held-out MSE of ignite's own metric, evaluated after every epoch: the score is
    the same on every rank, so every rank stops at the same epoch (a per-rank score would stop ranks apart)."""
    from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
    from ignite.handlers import EarlyStopping
    from ignite.metrics import MeanSquaredError

    from meshwise.engine import ignite_engine as habits

    model = _model(topo)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"device": topo.device, "prepare_batch": habits.prepare_batch(topo)}
    trainer = create_supervised_trainer(
        model, opt, nn.functional.mse_loss, output_transform=habits.global_loss(topo), **kw
    )
    evaluator = create_supervised_evaluator(
        model, device=topo.device, prepare_batch=habits.prepare_batch(topo, train=False)
    )
    MeanSquaredError().attach(evaluator, "mse")
    habits.on_mesh(trainer, topo, model=model)
    habits.on_mesh(evaluator, topo)
    scores: list[float] = []
    evaluator.add_event_handler(Events.COMPLETED, lambda e: scores.append(e.state.metrics["mse"]))
    stopper = EarlyStopping(patience=2, score_function=lambda e: -e.state.metrics["mse"], trainer=trainer)
    evaluator.add_event_handler(Events.COMPLETED, stopper)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(val))
    trainer.run(train, max_epochs=20)
    return trainer.state.epoch, scores


def _caught(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _misuse(topo) -> dict:
    """The habits that would train a wrong model on dp=2 x tp=2, each stopped before an optimizer step."""
    import ignite.distributed as idist
    from ignite.engine import create_supervised_trainer
    from torch.utils.data import DataLoader, Subset, TensorDataset

    import meshwise
    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.engine import ignite_engine as habits

    data = _data(64)
    pairs = TensorDataset(data["input"], data["target"])
    out: dict = {}

    def fresh():
        model = _model(topo)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), _full(model)

    # 1. ignite's tutorial habit: auto_dataloader (a DistributedSampler over the whole world)
    model, opt, before = fresh()
    trainer = habits.on_mesh(create_supervised_trainer(model, opt, nn.functional.mse_loss), topo, model=model)
    loader = idist.auto_dataloader(pairs, batch_size=16, shuffle=True)
    out["auto_dataloader"] = _caught(lambda: trainer.run(loader, max_epochs=1))
    out["auto_dataloader_iteration"] = trainer.state.iteration
    out["auto_dataloader_unchanged"] = all(torch.equal(before[k], v) for k, v in _full(model).items())

    # 2. a hand-made per-rank shard (no DistributedSampler to inspect), tuple batches: the step-1 agreement check
    shard = DataLoader(Subset(pairs, range(topo.rank, 64, topo.world_size)), batch_size=4)
    model, opt, before = fresh()
    trainer = habits.on_mesh(create_supervised_trainer(model, opt, nn.functional.mse_loss), topo)
    out["shard"] = _caught(lambda: trainer.run(shard, max_epochs=1))
    out["shard_iteration"] = trainer.state.iteration
    out["shard_unchanged"] = all(torch.equal(before[k], v) for k, v in _full(model).items())

    # 3. meshwise's own trainer with the same loaders: the sampler check, then the agreement check (dicts via prepare)
    model, opt, before = fresh()
    trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo)
    out["trainer_auto"] = _caught(lambda: trainer.run(loader, max_epochs=1))
    as_dict = meshwise.create_trainer(
        model, opt, nn.functional.mse_loss, topo, prepare=lambda b: {"input": b[0], "target": b[1]}
    )
    out["trainer_shard"] = _caught(lambda: as_dict.run(shard, max_epochs=1))
    out["trainer_unchanged"] = all(torch.equal(before[k], v) for k, v in _full(model).items())

    # 4. padded rows in a supervised training step
    padded = mesh_dataloader(ArrayDataset(_data(40)), topo, global_batch_size=16, mode="train", drop_last=False)
    trainer = create_supervised_trainer(model, opt, nn.functional.mse_loss, prepare_batch=habits.prepare_batch(topo))
    habits.on_mesh(trainer, topo)
    out["padded"] = _caught(lambda: trainer.run(padded, max_epochs=1))

    # 5. auto_model: DDP over the whole world, refused by on_mesh and create_trainer; after parallelize: torch's error
    torch.manual_seed(0)
    ddp = idist.auto_model(MLP().double())
    out["auto_model"] = _caught(
        lambda: habits.on_mesh(create_supervised_trainer(ddp, opt, nn.functional.mse_loss), topo, model=ddp)
    )
    out["auto_model_trainer"] = _caught(lambda: meshwise.create_trainer(ddp, opt, nn.functional.mse_loss, topo))
    out["auto_model_after_parallelize"] = _caught(lambda: idist.auto_model(_model(topo)))
    return out


def _split_mesh(topo) -> dict:
    """dp=2 x cp=2: mesh_dataloader parts differ across cp but their samples agree; a world shard does not."""
    from ignite.engine import Engine
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from meshwise.data import ArrayDataset, Shard, mesh_dataloader
    from meshwise.engine import ignite_engine as habits

    seq = {"input": torch.arange(32 * 8, dtype=torch.float64).reshape(32, 8)}
    loader = mesh_dataloader(ArrayDataset(seq), topo, global_batch_size=8, parts={"input": Shard(0)})
    engine = habits.on_mesh(Engine(lambda e, b: b["input"].shape), topo)
    engine.run(loader, max_epochs=1)
    pairs = TensorDataset(seq["input"])
    shard = DataLoader(Subset(pairs, range(topo.rank, 32, topo.world_size)), batch_size=2)
    engine = habits.on_mesh(Engine(lambda e, b: None), topo)
    return {"shard": _caught(lambda: engine.run(shard))}


@pytest.fixture(scope="module")
def reference():
    import meshwise

    topo = meshwise.init({"dp": 1})
    try:
        return _supervised(topo)
    finally:
        meshwise.shutdown()


@pytest.mark.slow
def test_supervised_helpers_match_one_process_and_misuse_is_stopped(reference):
    ranks = run_distributed(_supervised, 4, mesh={"dp": 2, "tp": 2}, timeout=240)
    for r in ranks:
        for k, v in reference["params"].items():
            assert torch.allclose(r["params"][k], v, rtol=0, atol=1e-12), k
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-12, abs=0)  # the GLOBAL loss, every rank
        assert r["gathers"] == [1] + [0] * (len(r["gathers"]) - 1)  # the agreement check: step 1 only
        assert r["count"] == 2.0  # idist.all_reduce over topo.group(topo.metric_dims): dp ranks, not x tp
        # evaluation keeps padded rows in (y_pred, y): 13 samples, 2 batches of 4 rows per data rank
        assert all(n == 4 for n, _ in r["eval"])
        assert r["mse"] == pytest.approx(reference["mse"], rel=1e-12, abs=0)  # 13 samples, each once
    assert sum(v for _, v in ranks[0]["eval"]) + sum(v for _, v in ranks[2]["eval"]) == 13
    # EarlyStopping (patience 2): the held-out MSE rises twice in a row before epoch 20 in one process; every
    # rank of the mesh sees the same scores and stops at the same epoch
    stop = reference["stop_epoch"]
    assert 3 <= stop < 20 and len(reference["scores"]) == stop
    assert reference["scores"][-1] > min(reference["scores"]) and reference["scores"][-2] > min(reference["scores"])
    for r in ranks:
        assert r["stop_epoch"] == stop
        # ignite's MeanSquaredError sums in a float32 tensor (its reset makes torch.tensor(0.0)): the mesh adds the
        # same squared errors in another order, so the scores agree to float32 rounding (measured ≤ 1.1e-7)
        assert r["scores"] == pytest.approx(reference["scores"], rel=1e-6, abs=0)

    out = run_distributed(_misuse, 4, mesh={"dp": 2, "tp": 2}, timeout=240)
    for r in out:
        assert r["auto_dataloader"].startswith("DataError") and "idist.auto_dataloader" in r["auto_dataloader"]
        assert "num_replicas=4" in r["auto_dataloader"] and "tp (replica)" in r["auto_dataloader"]
        assert r["auto_dataloader_iteration"] == 0 and r["auto_dataloader_unchanged"]
        assert r["shard"].startswith("DataError") and "at step 1 the tp (replica) ranks" in r["shard"], r["shard"]
        assert "rank 0 (dp=0, tp=0); rank 1 (dp=0, tp=1)" in r["shard"] and "auto_dataloader" in r["shard"]
        assert r["shard_iteration"] == 1 and r["shard_unchanged"]
        assert r["trainer_auto"].startswith("DataError") and "num_replicas=4" in r["trainer_auto"]
        assert r["trainer_shard"].startswith("DataError") and "tp (replica) ranks" in r["trainer_shard"]
        assert r["trainer_unchanged"]
        assert r["padded"].startswith("DataError") and "padded rows" in r["padded"]
        assert r["auto_model"].startswith("ParallelError") and "idist.auto_model" in r["auto_model"]
        assert r["auto_model_trainer"].startswith("ParallelError") and "idist.auto_model" in r["auto_model_trainer"]
        assert r["auto_model_after_parallelize"] != "no error"


def test_agreement_check_on_a_split_dim_compares_samples_not_parts():
    out = run_distributed(_split_mesh, 4, mesh={"dp": 2, "cp": 2}, timeout=120)
    for r in out:
        assert r["shard"].startswith("DataError") and "cp (split) ranks" in r["shard"] and "index" in r["shard"]


def _idist_after_shutdown() -> tuple[int, int, str | None]:
    import ignite.distributed as idist

    import meshwise

    meshwise.init({"dp": 1})
    inside = idist.get_world_size()  # ignite finds meshwise's one-process gloo group and keeps it
    meshwise.shutdown()
    return inside, idist.get_world_size(), idist.backend()


def test_idist_forgets_the_group_meshwise_destroyed():
    # A notebook or a test file runs several meshwise runs in one process: after shutdown, ignite's idist
    # must not answer from the destroyed group (it raised "Default process group has not been initialized").
    assert run_distributed(_idist_after_shutdown, 1) == [(1, 1, None)]
