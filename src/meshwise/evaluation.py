"""``create_evaluator``: an ignite Engine that runs the forward on every rank and computes exact mesh metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn
from torch.distributed.tensor import DTensor
from torchmetrics import Metric, MetricCollection

from meshwise.debug import guarded
from meshwise.engine import ready_batch
from meshwise.errors import MetricError
from meshwise.metrics import MeshMetric, Select, _resolve, compute_all
from meshwise.topology import Topology

Batch = Mapping[str, Any]


def _full(value: Any) -> Any:
    """Model outputs as plain tensors: a DTensor becomes its full value (a collective every TP rank makes)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, Mapping):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return float(value) if value.ndim == 0 else value
    return value


def create_evaluator(
    model: nn.Module | Callable[..., Any],
    topology: Topology | None = None,
    metrics: Mapping[str, Metric | MetricCollection | MeshMetric] | None = None,
    *,
    forward: Callable[[Any, Batch], Any] | None = None,
    select: Select | None = None,
    prepare: Callable[[Batch], Batch] | None = None,
    input_key: str = "input",
    target_key: str = "target",
    replica_check: bool | None = None,
    split: str = "parts",
) -> Engine:
    """An ignite ``Engine`` that evaluates ``model`` on this rank's batches and fills ``engine.state.metrics``.

    Every rank runs the forward on every batch (tensor-parallel layers have collectives inside), in eval
    mode under ``torch.no_grad()``: ``output = forward(model, batch)`` (default ``model(batch[input_key])``;
    a DTensor output becomes its full tensor). Each metric then updates with ``select(output, batch)``
    (default ``(output, batch[target_key])``; a :class:`MeshMetric`'s own ``select`` wins), keeping only the
    rows where ``batch["valid"]`` is True. Metrics are reset at every epoch start; at ``EPOCH_COMPLETED``
    they are computed with one fused sync over the topology's batch + split dims and
    ``engine.state.metrics`` holds the same values on every rank: Python floats for scalars, CPU tensors
    otherwise; a ``MetricCollection`` contributes its own keys. A plain ``Metric``/``MetricCollection`` is
    wrapped as ``MeshMetric(metric, topology, split=split, replica_check=replica_check)``. The model's
    training mode is restored when the run completes.
    """
    topo = _resolve(topology)
    if not callable(model):
        raise MetricError(f"create_evaluator() needs a model (nn.Module or callable), got {type(model).__name__}")
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise MetricError(
            f"metrics must be a dict name -> torchmetrics Metric/MetricCollection/MeshMetric, got {type(metrics)}"
        )
    wrapped: dict[str, MeshMetric] = {}
    for name, metric in metrics.items():
        if isinstance(metric, MeshMetric):
            if metric.topology is not topo:
                raise MetricError(f"metric {name!r} is attached to another topology: attach it to this one")
            wrapped[name] = metric
        elif isinstance(metric, (Metric, MetricCollection)):
            wrapped[name] = MeshMetric(metric, topo, split=split, replica_check=replica_check, name=name)
        else:
            raise MetricError(
                f"metric {name!r} is a {type(metric).__name__}, not a torchmetrics Metric, MetricCollection or "
                "MeshMetric: wrap it in a torchmetrics.Metric"
            )
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, m in wrapped.items():
        groups.setdefault(m.dims, []).append(name)
    device = topo.device
    run_forward = forward or (lambda m, b: m(b[input_key]))
    default_select = select or (lambda output, batch: (output, batch[target_key]))

    def step(engine: Engine, batch: Batch) -> Any:
        # Every rank runs the forward (tensor-parallel collectives inside): a rank that is missing is named.
        with guarded(topo, topo.dims, "evaluator step", step=engine.state.iteration, region=True):
            return eval_step(batch)

    def eval_step(batch: Batch) -> Any:
        batch = ready_batch(batch, prepare, device, "evaluator", MetricError)
        with torch.no_grad():
            output = _full(run_forward(model, batch))
            valid = batch.get("valid")
            for m in wrapped.values():
                args = (m.select or default_select)(output, batch)
                if not isinstance(args, tuple):
                    args = (args,)
                m.update(*args, valid=valid)
        return output

    engine = Engine(step)
    engine.topology = topo  # type: ignore[attr-defined]
    engine.mesh_metrics = wrapped  # type: ignore[attr-defined]
    mode: dict[str, bool] = {}

    @engine.on(Events.STARTED)
    def _eval_mode(_: Engine) -> None:
        if isinstance(model, nn.Module):
            mode["training"] = model.training
            model.eval()

    @engine.on(Events.EPOCH_STARTED)
    def _reset(_: Engine) -> None:
        for m in wrapped.values():
            m.reset()

    @engine.on(Events.EPOCH_COMPLETED)
    def _compute(e: Engine) -> None:
        out: dict[str, Any] = {}
        for names in groups.values():
            values = compute_all([wrapped[n] for n in names])
            for name, value in zip(names, values):
                items = value.items() if isinstance(value, Mapping) else [(name, value)]
                for key, v in items:
                    if key in out:
                        raise MetricError(
                            f"two metrics are named {key!r} (one from collection {name!r}): give the "
                            "MetricCollection a prefix= or rename the metric"
                        )
                    out[key] = _plain(v)
        e.state.metrics.update(out)

    @engine.on(Events.COMPLETED)
    def _restore(_: Engine) -> None:
        if isinstance(model, nn.Module):
            # A forward without backward leaves FSDP2's root unsharded: parameters() would then not be the
            # tensors the optimizer holds, and a checkpoint taken now would refuse the pair.
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            if mode.get("training"):
                model.train()

    return engine
