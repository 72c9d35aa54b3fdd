"""ignite habits on a mesh: ``on_mesh`` for a plain ignite Engine, the supervised helpers' batch and loss,
and the checks that stop ``idist.auto_dataloader``/``auto_model`` misuse instead of training a wrong model."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from ignite.utils import convert_tensor
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from meshwise.checkpoint import check_ignite_checkpoints
from meshwise.debug import guarded
from meshwise.debug.replicas import check_replicas, needs_check
from meshwise.engine.attach_checks import check_on_attach
from meshwise.engine.batch import local_value
from meshwise.errors import DataError, ParallelError
from meshwise.metrics import adopt_ignite_metrics
from meshwise.parallel.data_parallel import check_data_parallel
from meshwise.topology import Topology, resolve

__all__ = ["check_loader", "check_model", "global_loss", "on_mesh", "prepare_batch", "run_ignite_checks"]


def check_loader(loader: Any, topology: Topology | None = None, *, padded_rows: bool = True) -> None:
    """Refuse a loader whose ``DistributedSampler`` does not split samples over the data ranks.

    ``idist.auto_dataloader`` (and a hand-made ``DistributedSampler`` with its defaults) splits the data
    over the whole world, so tp peers get different samples. Loaders of other kinds pass here; the replica
    agreement check at the first step catches them. With ``padded_rows=False`` (an engine whose step
    averages over every row, as ignite's supervised steps do) a ``mode="train"`` ``mesh_dataloader`` that
    will pad its last batch is refused too: on every rank at once, before any step, where a refusal of the
    padded batch itself would come on the padded ranks only and leave the others waiting in a collective.
    """
    _check_loader(loader, resolve(topology), padded_rows)


def _check_loader(loader: Any, topo: Topology, padded_rows: bool) -> None:
    sampler = getattr(loader, "sampler", None)
    mesh_sampler = getattr(sampler, "global_batch_size", None) is not None
    if not padded_rows and mesh_sampler and sampler.mode == "train" and not sampler.drop_last:
        if sampler.dataset_length % sampler.global_batch_size:
            raise DataError(
                f"{topo.label()}: this mode='train' mesh_dataloader pads its last batch ({sampler.dataset_length} "
                f"samples, global batch {sampler.global_batch_size}, drop_last=False), and this engine's step "
                "averages its loss over every row (ignite's create_supervised_trainer does), so padded rows would "
                "train the model: use drop_last=True, or meshwise.create_trainer, which weights by valid rows"
            )
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(batch_sampler, "sampler", None)
    if topo.world_size == 1 or not isinstance(sampler, DistributedSampler):
        return
    have, want = (sampler.num_replicas, sampler.rank), (topo.data_size, topo.data_rank)
    if have != want:
        raise DataError(
            f"{topo.label()}: the loader's {type(sampler).__name__} splits the samples over num_replicas="
            f"{have[0]} ranks as rank {have[1]}, but this mesh ({topo.layout.dims_text()}) has {want[0]} data "
            f"ranks and this rank is data rank {want[1]}: ranks across {_shared_dims(topo)} would get different "
            "samples. This is what idist.auto_dataloader does (a sampler over the whole world). Use "
            "meshwise.data.mesh_dataloader, or DistributedSampler(dataset, num_replicas=topo.data_size, "
            "rank=topo.data_rank) in a plain DataLoader"
        )


def _shared_dims(topo: Topology) -> str:
    dims = [d for d in (*topo.replica_dims, *topo.split_dims, *topo.stage_dims) if topo.sizes[d] > 1]
    return ", ".join(f"{d} ({topo.roles[d]})" for d in dims) or "the mesh's dims"


def check_model(model: nn.Module, topology: Topology | None = None) -> None:
    """Refuse a model that cannot train right on this mesh: ``idist.auto_model``'s DistributedDataParallel
    over the whole world on a mesh with replica or split dims, or a model not data parallel at all."""
    _check_model(model, resolve(topology))


def _check_model(model: nn.Module, topo: Topology) -> None:
    # A DeepSpeed engine averages its own gradients: its integration checks that its data group is the mesh's
    if "deepspeed" in sys.modules and importlib.import_module("meshwise.deepspeed").check_engine(model, topo):
        return
    kind = check_data_parallel(model)
    shared = [d for d in (*topo.replica_dims, *topo.split_dims) if topo.sizes[d] > 1]
    group = getattr(model, "process_group", None) if kind == "ddp" else None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(topo.world_size))
    # DDP over exactly the batch (+ split) group averages as the mesh does (layers with their own tensor-parallel
    # communication, e.g. Megatron's); over the world it also averages across tp/cp peers
    if kind == "ddp" and shared and ranks != topo.group_ranks(topo.metric_dims):
        raise ParallelError(
            f"{topo.label()}: the model is DistributedDataParallel over ranks {ranks} (over the world: what "
            f"idist.auto_model builds), which ignores the mesh's {_shared_dims(topo)} dims ({topo.layout.dims_text()})"
            f": pass the plain module to meshwise.parallelize(model, topo, tp_plan=...) instead of idist.auto_model, "
            f"or, for layers that do their own tensor-parallel communication (Megatron's), "
            f"DistributedDataParallel(model, process_group=topo.group(topo.metric_dims)) (ranks "
            f"{topo.group_ranks(topo.metric_dims)} here)"
        )
    if topo.size(topo.metric_dims) > 1 and kind is None:
        raise ParallelError(
            f"{topo.label()}: the model is not data parallel over the metric dims {topo.metric_dims}, so their "
            "gradients would never be averaged: call meshwise.parallelize(model, topo) first"
        )


def run_ignite_checks(engine: Engine, topology: Topology | None = None, padded_rows: bool = True) -> None:
    """What every engine on the mesh runs at STARTED: its loader (:func:`check_loader`), its ignite metrics
    made mesh-correct (``adopt_ignite_metrics``), its ignite checkpoint handlers checked
    (``check_ignite_checkpoints``). ``padded_rows``: whether the engine's step excludes padded rows."""
    _run_checks(engine, resolve(topology), padded_rows)


def _run_checks(engine: Engine, topo: Topology, padded_rows: bool) -> None:
    _check_loader(engine.state.dataloader, topo, padded_rows)
    adopt_ignite_metrics(engine, topo)
    check_ignite_checkpoints(engine, topo)


def on_mesh(engine: Engine, topology: Topology | None = None, *, model: nn.Module | None = None) -> Engine:
    """Make a plain ignite ``Engine`` (e.g. ``create_supervised_trainer``'s) safe on the mesh; returns it.

    At STARTED: :func:`run_ignite_checks` (a padding training loader refused: ignite's steps average over
    every row). At the first iteration of each run (every iteration in debug
    mode): the replica agreement check of ``engine.state.batch``, whatever its loader
    (:func:`meshwise.debug.replicas.check_replicas`). With ``model``: :func:`check_model` now.
    Calling it twice on one engine adds nothing. The topology is resolved once, here: every check, now and at
    each run's start, uses that one.
    """
    topo = resolve(topology)
    if model is not None:
        _check_model(model, topo)
    if getattr(engine, "_meshwise_on_mesh", False):
        return engine
    engine._meshwise_on_mesh = True  # type: ignore[attr-defined]
    pending = [True]

    def started(e: Engine) -> None:
        pending[0] = True
        _run_checks(e, topo, padded_rows=False)

    def compare(e: Engine) -> None:
        if pending[0] or topo.debug:
            pending[0] = False
            check_replicas(topo, e.state.batch, e.state.iteration)

    engine.add_event_handler(Events.STARTED, started)
    check_on_attach(engine, topo)  # ignite loggers leader-only, a DiskSaver of shards refused when attached
    if needs_check(topo):
        engine.add_event_handler(Events.ITERATION_STARTED, compare)
    return engine


def prepare_batch(
    topology: Topology | None = None, *, input_key: str = "input", target_key: str = "target", train: bool = True
) -> Callable[[Any, Any, bool], tuple[Any, Any]]:
    """A ``prepare_batch`` for ignite's ``create_supervised_trainer/evaluator`` that reads ``mesh_dataloader``
    dict batches: ``(batch[input_key], batch[target_key])`` on the device.

    With ``train=True`` a batch with padded rows (``valid`` False) is refused: ignite's supervised step
    averages its loss over every row. Evaluation keeps them (the metrics of ``on_mesh`` skip them by
    ``engine.state.batch["valid"]``). Tuple batches pass through as ignite's own ``prepare_batch`` does.
    """
    topo = resolve(topology)

    def prepare(batch: Any, device: Any = None, non_blocking: bool = False) -> tuple[Any, Any]:
        if not isinstance(batch, Mapping):
            x, y = batch
        else:
            valid = batch.get("valid")
            if train and isinstance(valid, torch.Tensor) and not bool(valid.all()):
                raise DataError(
                    f"{topo.label()}: a training batch has {int((~valid).sum())} padded rows (valid=False); "
                    "ignite's create_supervised_trainer averages the loss over every row, so they would train "
                    "the model: use mesh_dataloader(..., mode='train', drop_last=True), or "
                    "meshwise.create_trainer, which weights the loss by the valid rows"
                )
            x, y = batch[input_key], batch[target_key]
        device = device if device is not None else topo.device
        return (
            convert_tensor(x, device=device, non_blocking=non_blocking),
            convert_tensor(y, device=device, non_blocking=non_blocking),
        )

    return prepare


def global_loss(topology: Topology | None = None) -> Callable[[Any, Any, Any, torch.Tensor], float]:
    """An ``output_transform`` for ``create_supervised_trainer``: the loss of the GLOBAL batch (the same on
    every rank), as ``engine.state.output``, instead of this rank's local loss.

    Each rank's mean loss is weighted by its rows and summed over the metric dims (one all-reduce of two
    numbers); replica ranks hold the same loss already.
    """
    topo = resolve(topology)
    group = topo.group(topo.metric_dims) if topo.size(topo.metric_dims) > 1 else None

    def transform(x: Any, y: Any, y_pred: Any, loss: torch.Tensor) -> float:
        rows = float(y.shape[0]) if isinstance(y, torch.Tensor) and y.ndim else 1.0
        value = local_value(loss).double()
        if group is None:
            return float(value)
        vec = torch.stack([value * rows, value.new_tensor(rows)])
        with guarded(topo, topo.metric_dims, "supervised global loss", tensor=vec):
            dist.all_reduce(vec, group=group)
        total, count = vec.tolist()
        return total / count

    return transform
