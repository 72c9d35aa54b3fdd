"""DeepSpeed engines driven by ignite with meshwise's loader and metrics, on real gloo groups (docs/deepspeed.md).

Written as a DeepSpeed user writes their script: ``deepspeed.init_distributed(dist_backend="gloo")``, their model,
``deepspeed.initialize`` with a torch optimizer and a config, an ignite ``Engine(train_step)`` whose step calls
``engine.backward(loss); engine.step()`` (a ``PipelineEngine``: ``engine.train_batch``), ignite's metrics attached to
the evaluator. meshwise adds the topology (DeepSpeed's own groups adopted), the loader and the metrics. One launch
per engine kind: ZeRO stage 1 at dp=4, and a ``PipelineModule`` at pp=2 x dp=2 (ZeRO stage 1 too). The oracle is
the same model trained in this process with plain torch on the same global batches, in float32 (DeepSpeed reduces
only float32/16 gradients: float64 is refused by its all-reduce).

Tolerance: ``TOL = 1e-6``. A data rank's gradient is the mean over its rows and DeepSpeed averages those over the
data group, where one process takes the mean over the global batch in one matmul: the same sums in another order,
so parameters differ by float32 rounding (eps 1.2e-7) over 10 steps (measured 4.5e-8, losses 1.2e-7); a batch fed to the
wrong rank, a sample twice or a gradient averaged twice is off by 1e-3 or more.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshwise.testing import run_distributed

pytest.importorskip("deepspeed")

TOL = 1e-6
N_TRAIN, N_EVAL, FEATURES, CLASSES = 40, 13, 6, 3  # 13 held-out samples: not a multiple of any data size
GLOBAL_BATCH, EPOCHS, LR, MOMENTUM = 8, 2, 0.1, 0.9
CLIP = 1.0  # DeepSpeed 0.19's default gradient_clipping, written out: its global norm over ZeRO partitions and stages


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, n).astype(np.int64)


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES)]


def _config(dp: int, accumulation: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp // accumulation,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,  # a torch SGD given to ZeRO
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
    }


def _start_deepspeed() -> object:
    import deepspeed

    import meshwise.deepspeed

    meshwise.deepspeed.skip_shm_build()  # else init_distributed compiles a C++ op for ~2 minutes (docs/deepspeed.md)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _loaders(topo):
    from meshwise.data import ArrayDataset, mesh_dataloader

    x, y = _data(N_TRAIN, 1)
    ex, ey = _data(N_EVAL, 2)
    train = mesh_dataloader(ArrayDataset({"input": x, "target": y}), topo, global_batch_size=GLOBAL_BATCH, seed=3)
    held = mesh_dataloader(ArrayDataset({"input": ex, "target": ey}), topo, global_batch_size=GLOBAL_BATCH, mode="eval")
    return train, held


def _seen(engine, ids: list) -> None:
    ids.append(engine.state.batch["index"].tolist())


def _refusal(call, kind: type, fragments: list[str]) -> str:
    try:
        call()
    except kind as exc:
        text = str(exc)
        missing = [f for f in fragments if f not in text]
        assert not missing, (missing, text)
        return text
    raise AssertionError(f"no {kind.__name__}; expected one saying {fragments}")


# --------------------------------------------------------------------------- the users' scripts (every rank)


class _Zero1Run:
    """One user's ZeRO-1 run: the model, ``deepspeed.initialize``, an ignite ``Engine`` whose step calls
    ``engine.backward(loss); engine.step()``, the training samples and losses it saw."""

    def __init__(self, deepspeed, topo=None) -> None:
        from ignite.engine import Engine, Events

        import meshwise.deepspeed
        from meshwise.engine import on_mesh

        model = nn.Sequential(*_layers())
        sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        config = _config(dp=4, accumulation=1)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=sgd, config=config)
        self.topo = topo or meshwise.deepspeed.adopt(self.engine)
        self.train, self.held = _loaders(self.topo)
        self.trainer = on_mesh(Engine(self.step), self.topo, model=self.engine)
        self.ids: list = []
        self.losses: list = []
        self.trainer.add_event_handler(Events.ITERATION_COMPLETED, _seen, self.ids)
        self.trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: self.losses.append(e.state.output))

    def step(self, _, batch: dict) -> float:
        import meshwise.deepspeed

        self.engine.train()
        loss = F.cross_entropy(self.engine(batch["input"]), batch["target"])
        self.engine.backward(loss)
        self.engine.step()
        return meshwise.deepspeed.global_loss(loss, self.topo)

    def params(self) -> dict:
        return {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}


def zero1_script(folder: str) -> dict:
    """ZeRO stage 1 at dp=4: a user's ignite Engine around engine.backward/engine.step, ignite metrics attached to
    the evaluator; then DeepSpeed's own checkpoint with the loader's and trainer's state in its client_state, saved
    mid-epoch and resumed by a fresh engine; then the meshwise roads that would go wrong, refused."""
    from ignite.engine import Engine, Events
    from ignite.metrics import Accuracy, Loss
    from torchmetrics.classification import MulticlassAccuracy

    import meshwise
    from meshwise.engine import on_mesh
    from meshwise.errors import CheckpointError, ParallelError

    deepspeed = _start_deepspeed()
    run = _Zero1Run(deepspeed)
    topo, engine = run.topo, run.engine
    run.trainer.run(run.train, max_epochs=EPOCHS)

    evaluator = meshwise.create_evaluator(engine, topo, metrics={"acc": MulticlassAccuracy(CLASSES, average="micro")})
    Accuracy().attach(evaluator, "ignite_acc")
    Loss(F.cross_entropy).attach(evaluator, "ignite_loss")
    eval_ids: list = []
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: eval_ids.append(_valid_ids(e.state.batch)))
    evaluator.run(run.held)

    # stopped after step 7 (mid-epoch 2), saved with DeepSpeed's checkpoint, resumed by a fresh engine
    ds_folder = os.path.join(folder, "deepspeed")
    first = _Zero1Run(deepspeed, topo)

    def save_and_stop(e: Engine) -> None:
        state = {"loader": first.train.state_dict(), "trainer": e.state_dict()}
        first.engine.save_checkpoint(ds_folder, tag="step7", client_state=state)
        e.terminate()

    first.trainer.add_event_handler(Events.ITERATION_COMPLETED(once=7), save_and_stop)
    first.trainer.run(first.train, max_epochs=EPOCHS)
    second = _Zero1Run(deepspeed, topo)
    _, client = second.engine.load_checkpoint(ds_folder, tag="step7")
    second.train.load_state_dict(client["loader"])
    second.trainer.load_state_dict(client["trainer"])
    second.trainer.run(second.train, max_epochs=EPOCHS)

    refused = {
        "trainer": _refusal(
            lambda: meshwise.create_trainer(engine, run.optimizer, F.cross_entropy, topo),
            ParallelError,
            ["DeepSpeed engine", "engine.backward(loss); engine.step()", "meshwise.deepspeed.adopt(engine)"],
        ),
        "checkpoint": _refusal(
            lambda: meshwise.Checkpointer(folder, topo).save(1, model=engine, optimizer=run.optimizer),
            CheckpointError,
            ["cannot checkpoint model=DeepSpeedEngine", "engine.save_checkpoint(", "client_state="],
        ),
    }
    coords = (topo.dims, topo.data_rank, topo.group("data") is engine.data_parallel_group)
    meshwise.shutdown()
    # a mesh of meshwise's own beside the engine: dp=2 x tp=2 feeds the engine's 4 data ranks 2 sample streams
    other = meshwise.init({"dp": 2, "tp": 2})
    refused["mesh"] = _refusal(
        lambda: on_mesh(Engine(run.step), other, model=engine),
        ParallelError,
        ["averages gradients over its data group [0, 1, 2, 3]", "meshwise.deepspeed.adopt(engine)"],
    )
    meshwise.shutdown()
    return {
        "coords": coords,
        "params": run.params(),
        "losses": run.losses,
        "ids": run.ids,
        "eval_ids": eval_ids,
        "metrics": dict(evaluator.state.metrics),
        "refused": refused,
        "resumed": {"params": second.params(), "ids": first.ids + second.ids, "losses": first.losses + second.losses},
    }


def pipeline_script() -> dict:
    """A PipelineModule at pp=2 x dp=2 (ZeRO stage 1, 2 micro-batches): engine.train_batch in the ignite step."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from ignite.engine import Engine, Events
    from torchmetrics.classification import MulticlassAccuracy

    import meshwise
    import meshwise.deepspeed
    from meshwise.engine import on_mesh
    from meshwise.metrics import MeanLoss

    deepspeed = _start_deepspeed()
    grid = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    net = PipelineModule(layers=_layers(), num_stages=2, topology=grid, loss_fn=F.cross_entropy)
    sgd = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    accumulation = 2
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=sgd, config=_config(dp=2, accumulation=accumulation))
    topo = meshwise.deepspeed.adopt(engine)
    train, held = _loaders(topo)

    def train_step(_: Engine, batch: dict) -> float:
        x, y = batch["input"].chunk(accumulation), batch["target"].chunk(accumulation)
        return engine.train_batch(iter(zip(x, y))).item()  # the global batch's mean loss, on every stage

    trainer = on_mesh(Engine(train_step), topo, model=engine)
    ids: list = []
    losses: list = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, _seen, ids)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    trainer.run(train, max_epochs=EPOCHS)

    metrics = {
        "acc": MulticlassAccuracy(CLASSES, average="micro"),
        "loss": MeanLoss(_per_sample_loss),
    }
    evaluator = meshwise.create_evaluator(
        engine,
        topo,
        metrics=metrics,
        forward=meshwise.deepspeed.pipeline_forward(),
    )
    eval_ids: list = []
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: eval_ids.append(_valid_ids(e.state.batch)))
    evaluator.run(held)
    coords = (topo.dims, topo.data_rank, topo.coordinate("pipe"), engine.grid.get_data_parallel_rank())
    params = {k: v.detach().clone() for k, v in net.state_dict().items()}
    meshwise.shutdown()
    return {
        "coords": coords,
        "params": params,
        "losses": losses,
        "ids": ids,
        "eval_ids": eval_ids,
        "metrics": dict(evaluator.state.metrics),
    }


def _per_sample_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction="none")


def _valid_ids(batch: dict) -> list[int]:
    return batch["index"][batch["valid"]].tolist()


# --------------------------------------------------------------------------- one process, plain torch


def _one_process() -> dict:
    """The oracle: the same model, SGD and global batches (the loader's order does not depend on the mesh)."""
    from meshwise.data import MeshSampler

    x, y = (torch.from_numpy(a) for a in _data(N_TRAIN, 1))
    model = nn.Sequential(*_layers())
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sampler = MeshSampler(N_TRAIN, GLOBAL_BATCH, mode="train", seed=3)
    batches, losses = [], []
    for epoch in range(EPOCHS):
        order = sampler.order(epoch)
        for step in range(N_TRAIN // GLOBAL_BATCH):
            rows = torch.from_numpy(np.asarray(order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]))
            sgd.zero_grad()
            loss = F.cross_entropy(model(x[rows]), y[rows])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            sgd.step()
            batches.append(sorted(rows.tolist()))
            losses.append(loss.item())
    ex, ey = (torch.from_numpy(a) for a in _data(N_EVAL, 2))
    with torch.no_grad():
        logits = model(ex)
    metrics = {
        "acc": (logits.argmax(1) == ey).double().mean().item(),
        "loss": F.cross_entropy(logits.double(), ey).item(),
    }
    return {"params": model.state_dict(), "batches": batches, "losses": losses, "metrics": metrics}


def _worst(params: dict, oracle: dict) -> float:
    return max((params[k] - oracle[k]).abs().max().item() for k in params)


def _check_samples(results: list[dict], data_ranks: list[int], oracle: dict) -> None:
    """Each training sample once per step across the data ranks (the oracle's global batch), the ranks of one
    data rank (pipeline stages) fed the same ones; each held-out sample once."""
    for step, batch in enumerate(oracle["batches"]):
        by_data: dict[int, list[int]] = {}
        for r, d in zip(results, data_ranks):
            assert by_data.setdefault(d, r["ids"][step]) == r["ids"][step], (step, d)
        seen = sorted(i for ids in by_data.values() for i in ids)
        assert seen == batch, (step, seen, batch)
    held: dict[int, list[int]] = {}
    for r, d in zip(results, data_ranks):
        mine = [i for ids in r["eval_ids"] for i in ids]
        assert held.setdefault(d, mine) == mine
    assert sorted(i for ids in held.values() for i in ids) == list(range(N_EVAL))


# --------------------------------------------------------------------------- tests


def test_zero1_dp4_driven_by_ignite_equals_one_process(tmp_path) -> None:
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    results = run_distributed(zero1_script, 4, str(tmp_path / "ckpt"), timeout=240, env=env)
    oracle = _one_process()
    assert [r["coords"] for r in results] == [(("data",), d, True) for d in range(4)]
    _check_samples(results, [0, 1, 2, 3], oracle)
    for r in results:
        assert _worst(r["params"], oracle["params"]) <= TOL
        assert np.allclose(r["losses"], oracle["losses"], rtol=0, atol=TOL)
        m = r["metrics"]
        assert round(m["acc"] * N_EVAL) == round(m["ignite_acc"] * N_EVAL) == round(oracle["metrics"]["acc"] * N_EVAL)
        assert m["ignite_loss"] == pytest.approx(oracle["metrics"]["loss"], abs=TOL)
    assert not os.path.exists(tmp_path / "ckpt" / "step-1")  # refused before anything was written
    for r in results:  # stopped after step 7, saved by DeepSpeed, resumed by a fresh engine: the unbroken run
        assert r["resumed"]["ids"] == r["ids"]
        assert r["resumed"]["losses"] == r["losses"]
        assert _worst(r["resumed"]["params"], r["params"]) == 0.0


def test_pipeline_module_pp2_dp2_driven_by_ignite_equals_one_process() -> None:
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    results = run_distributed(pipeline_script, 4, timeout=240, env=env)
    oracle = _one_process()
    # PipeModelDataParallelTopology numbers ranks (pipe, data, model) row-major; model=1 is left out of the mesh
    assert [r["coords"] for r in results] == [(("pipe", "data"), r % 2, r // 2, r % 2) for r in range(4)]
    _check_samples(results, [r % 2 for r in range(4)], oracle)
    merged: dict = {}
    for r in results:
        merged.update(r["params"])  # stage 0 holds layers 0 and 2, stage 1 layer 4: keys as in nn.Sequential
        assert np.allclose(r["losses"], oracle["losses"], rtol=0, atol=TOL)
        assert round(r["metrics"]["acc"] * N_EVAL) == round(oracle["metrics"]["acc"] * N_EVAL)  # torchmetrics: float32
        assert r["metrics"]["loss"] == pytest.approx(oracle["metrics"]["loss"], abs=TOL)
    assert sorted(merged) == sorted(oracle["params"])
    assert _worst(merged, oracle["params"]) <= TOL
