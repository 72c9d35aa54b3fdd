"""``create_evaluator``: an ignite Engine that runs the forward on every rank and computes exact mesh metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from ignite.engine import Engine, Events
from ignite.metrics import Metric as IgniteMetric
from torch import nn
from torchmetrics import Metric, MetricCollection

from meshwise.causal_lm import Batch, loss_input, target_of
from meshwise.data import MeshSampler
from meshwise.debug import guarded
from meshwise.engine.attach_checks import check_on_attach
from meshwise.engine.batch import full_tensors, ready_batch
from meshwise.engine.pipeline_steps import PipelineEvalStep
from meshwise.errors import MetricError
from meshwise.metrics import MeshMetric, Select, adopt_ignite_metrics, compute_all
from meshwise.parallel.data_parallel import reshard
from meshwise.parallel.stages import pipeline_of
from meshwise.topology import Topology, resolve

__all__ = ["EvalMetrics", "check_eval_loader", "create_evaluator"]


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return float(value) if value.ndim == 0 else value
    return value


class EvalMetrics:
    """The metrics of an evaluator: reset at every epoch start, computed with fused syncs at its end.

    ``metrics`` maps names to :class:`~meshwise.metrics.MeshMetric` objects (kept as given: hold your own
    references to read them later) or plain torchmetrics ``Metric``/``MetricCollection`` objects, wrapped as
    ``MeshMetric(metric, topology, split_inputs=split_inputs, replica_check=replica_check, name=name)``.
    :meth:`attach` registers the reset and the compute; at ``EPOCH_COMPLETED`` ``engine.state.metrics``
    gets the values, the same on every rank: Python floats for scalars, CPU tensors otherwise; a
    ``MetricCollection`` contributes its own keys. Metrics syncing over the same dims share one sync.
    ignite metrics (``ignite.metrics.Metric``) are attached the ignite way (:meth:`attach`) and made
    mesh-correct by :func:`~meshwise.metrics.adopt_ignite_metrics` when the run starts.
    """

    def __init__(
        self,
        metrics: Mapping[str, Metric | MetricCollection | MeshMetric | IgniteMetric] | None,
        topology: Topology | None = None,
        *,
        split_inputs: str = "parts",
        replica_check: bool | None = None,
        sources: Sequence[str] | Any = None,
    ) -> None:
        topo = resolve(topology)
        metrics = {} if metrics is None else metrics
        if not isinstance(metrics, Mapping):
            raise MetricError(
                f"metrics must be a dict name -> torchmetrics Metric/MetricCollection/MeshMetric or ignite Metric, "
                f"got {type(metrics)}"
            )
        self.sources = _source_names(sources)
        self.by_source: dict[str, int] = {}  # per-source metric name -> the source's index (the batch's "source")
        if self.sources:
            metrics = {**metrics, **_per_source(metrics, self.sources, self.by_source)}
        self.metrics: dict[str, MeshMetric] = {}
        self.ignite: dict[str, IgniteMetric] = {}
        for name, metric in metrics.items():
            if isinstance(metric, MeshMetric):
                if metric.topology is not topo:
                    raise MetricError(f"metric {name!r} is attached to another topology: attach it to this one")
                self.metrics[name] = metric
            elif isinstance(metric, (Metric, MetricCollection)):
                self.metrics[name] = MeshMetric(
                    metric, topo, split_inputs=split_inputs, replica_check=replica_check, name=name
                )
            elif isinstance(metric, IgniteMetric):
                self.ignite[name] = metric
            else:
                raise MetricError(
                    f"metric {name!r} is a {type(metric).__name__}, not a torchmetrics Metric, MetricCollection, "
                    "MeshMetric or ignite Metric: wrap it in a torchmetrics.Metric"
                )
        self.groups: dict[tuple[str, ...], list[str]] = {}
        for name, m in self.metrics.items():
            self.groups.setdefault(m.dims, []).append(name)

    def attach(self, engine: Engine) -> EvalMetrics:
        """Reset the metrics at ``EPOCH_STARTED`` and put their values in ``engine.state.metrics`` at its end."""
        engine.add_event_handler(Events.EPOCH_STARTED, lambda _: self.reset())
        engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: e.state.metrics.update(self.compute()))
        for name, metric in self.ignite.items():
            metric.attach(engine, name)  # they read engine.state.output, (y_pred, y) as select gives it
        return self

    def reset(self) -> None:
        for m in self.metrics.values():
            m.reset()

    def update(self, output: Any, batch: Batch, select: Select) -> None:
        """Update every metric with its ``select(output, batch)`` (a MeshMetric's own ``select`` wins)."""
        valid = batch.get("valid")
        source = batch.get("source") if self.by_source else None
        if self.by_source and not isinstance(source, torch.Tensor):
            raise MetricError(
                f"the evaluator reports metrics per source {self.sources}, but the batch has no 'source' field: "
                "evaluate a loader of the mixture (mesh_dataloader(mix(...), mode='eval')), or drop sources="
            )
        for name, m in self.metrics.items():
            args = (m.select or select)(output, batch)
            if not isinstance(args, tuple):
                args = (args,)
            rows = valid
            if name in self.by_source:
                mine = source.to(args[0].device if isinstance(args[0], torch.Tensor) else "cpu") == self.by_source[name]
                rows = mine if valid is None else valid.to(mine.device) & mine
            m.update(*args, valid=rows)

    def compute(self) -> dict[str, Any]:
        """Every metric's value by name (one fused sync per group of dims); collection keys are merged in."""
        out: dict[str, Any] = {}
        for names in self.groups.values():
            values = compute_all([self.metrics[n] for n in names])
            for name, value in zip(names, values):
                items = value.items() if isinstance(value, Mapping) else [(name, value)]
                for key, v in items:
                    if key in out:
                        raise MetricError(
                            f"two metrics are named {key!r} (one from collection {name!r}): give the "
                            "MetricCollection a prefix= or rename the metric"
                        )
                    out[key] = _plain(v)
        return out


def _source_names(sources: Sequence[str] | Any) -> list[str]:
    """The source names of ``sources=``: a mixture (``meshwise.data.mix``) or its names."""
    if sources is None:
        return []
    blend = getattr(sources, "blend", None)
    names = list(blend.names) if blend is not None else list(sources) if not isinstance(sources, str) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise MetricError(f"sources= takes a mixture made by meshwise.data.mix() or its source names, got {sources!r}")
    return names


def _per_source(metrics: Mapping[str, Any], sources: list[str], index: dict[str, int]) -> dict[str, Any]:
    """A copy of every torchmetrics metric for each source, named ``"{name}/{source}"`` (collections: keys too)."""
    out = {}
    for name, metric in metrics.items():
        if not isinstance(metric, (Metric, MetricCollection)):
            raise MetricError(
                f"metric {name!r} is a {type(metric).__name__}: per-source metrics (sources=) are copies of plain "
                "torchmetrics Metric/MetricCollection objects; pass the torchmetrics object itself"
            )
        for i, source in enumerate(sources):
            key = f"{name}/{source}"
            if key in metrics:
                raise MetricError(f"metric name {key!r} is also a per-source name: rename the metric")
            copy = metric.clone(postfix=f"/{source}") if isinstance(metric, MetricCollection) else metric.clone()
            out[key], index[key] = copy, i
    return out


def check_eval_loader(data: Any) -> None:
    """Refuse a ``mesh_dataloader(..., mode="train")`` loader: it shuffles and may drop samples."""
    sampler = getattr(data, "sampler", None)
    if not isinstance(sampler, MeshSampler) or sampler.mode != "train":
        return
    total = sampler.dataset_length
    seen = len(sampler) * sampler.global_batch_size if sampler.drop_last else total
    how = "the last partial batch dropped" if sampler.drop_last else "the last batch padded"
    raise MetricError(
        f"the evaluator got a loader made with mode='train': it would evaluate {min(seen, total)} of {total} "
        f"samples in shuffled order, {how}; make the evaluation loader with "
        "mesh_dataloader(..., mode='eval'), which yields every sample exactly once"
    )


class _EvalStep:
    """The evaluator's process function: forward on every rank under ``no_grad``, then the metric updates."""

    def __init__(
        self,
        model: Any,
        topo: Topology,
        metrics: EvalMetrics,
        forward: Callable[[Any, Batch], Any],
        select: Select,
        prepare: Callable[[Batch], Batch] | None,
    ) -> None:
        self.model, self.topology, self.metrics = model, topo, metrics
        self.forward, self.select, self.prepare = forward, select, prepare

    def __call__(self, engine: Engine, batch: Batch) -> Any:
        topo = self.topology
        # Every rank runs the forward (tensor-parallel collectives inside): a rank that is missing is named.
        with guarded(topo, topo.dims, "evaluator step", step=engine.state.iteration, region=True):
            batch = ready_batch(batch, self.prepare, topo.device, "evaluator", MetricError)
            engine.state.batch = batch  # ignite metrics leave out the rows its "valid" marks as padding
            with torch.no_grad():
                output = full_tensors(loss_input(self.forward(self.model, batch)))  # as the trainer
                self.metrics.update(output, batch, self.select)
            # ignite's convention for an evaluator's output: what its metrics update with, (y_pred, y)
            return self.select(output, batch)


def create_evaluator(
    model: nn.Module | Callable[..., Any],
    topology: Topology | None = None,
    metrics: Mapping[str, Metric | MetricCollection | MeshMetric | IgniteMetric] | None = None,
    *,
    forward: Callable[[Any, Batch], Any] | None = None,
    select: Select | None = None,
    prepare: Callable[[Batch], Batch] | None = None,
    input_key: str = "input",
    target_key: str = "target",
    replica_check: bool | None = None,
    split_inputs: str | None = None,
    sources: Sequence[str] | Any = None,
) -> Engine:
    """An ignite ``Engine`` that evaluates ``model`` on this rank's batches and fills ``engine.state.metrics``.

    Every rank runs the forward on every batch (tensor-parallel layers have collectives inside), in eval
    mode under ``torch.no_grad()``: ``output = forward(model, batch)`` (default ``model(batch[input_key])``;
    a transformers ``ModelOutput`` becomes its ``logits``, as in the trainer; a DTensor output its full tensor).
    Each metric then updates with ``select(output, batch)``
    (default ``(output, batch[target_key])``, or the batch's ``shift_labels`` field where it has one, as the
    trainer's target; a :class:`MeshMetric`'s own ``select`` wins), keeping only the
    rows where ``batch["valid"]`` is True. The metrics are held by an :class:`EvalMetrics` handler: reset at
    every epoch start; at ``EPOCH_COMPLETED`` computed with one fused sync over the topology's batch + split
    dims, and ``engine.state.metrics`` holds the same values on every rank. A plain ``Metric`` or
    ``MetricCollection`` is wrapped as ``MeshMetric(metric, topology, split_inputs=split_inputs,
    replica_check=replica_check)``; to read a metric's state after a run, pass your own ``MeshMetric``.
    ``engine.state.output`` is ``select(output, batch)``, ``(y_pred, y)`` by default, as ignite metrics expect:
    ignite metrics given in ``metrics`` or attached to the engine the ignite way (``Accuracy().attach(evaluator,
    "acc")``) are made mesh-correct at ``STARTED`` by :func:`~meshwise.metrics.adopt_ignite_metrics` (padded rows
    left out, reductions over the batch + split dims only, fused). ``split_inputs`` defaults to ``"parts"`` for
    torchmetrics and to ``"whole"`` for ignite metrics, which count samples (rows); give it to choose for both.

    ``sources`` (a mixture made by :func:`meshwise.data.mix`, or its source names) adds a copy of every
    torchmetrics metric per source, named ``"{name}/{source}"`` (a ``MetricCollection``'s keys get the
    ``/{source}`` postfix), updated with the rows whose ``source`` field is that source: each source's metrics
    are exact on any mesh, as the overall ones.

    At ``STARTED`` a loader made with ``mesh_dataloader(..., mode="train")`` is refused with
    :class:`MetricError` (it shuffles and drops the last partial batch). When the run completes, FSDP2
    modules are resharded (a forward without backward leaves them gathered) and the model's training mode
    is restored.
    """
    topo = resolve(topology)
    if not callable(model):
        raise MetricError(f"create_evaluator() needs a model (nn.Module or callable), got {type(model).__name__}")
    handler = EvalMetrics(
        metrics, topo, split_inputs=split_inputs or "parts", replica_check=replica_check, sources=sources
    )
    step = _EvalStep(
        model,
        topo,
        handler,
        forward or (lambda m, b: m(b[input_key])),
        select or (lambda output, batch: (output, target_of(batch, target_key))),
        prepare,
    )
    if isinstance(model, nn.Module) and pipeline_of(model) is not None:  # a forward schedule (docs/pipeline.md)
        step = PipelineEvalStep(step, input_key, forward)
    engine = Engine(step)
    was_training: list[bool] = []

    def started(e: Engine) -> None:
        check_eval_loader(e.state.dataloader)
        # ignite metrics count samples: across split dims only whole-sample outputs can count them once
        adopt_ignite_metrics(e, topo, split_inputs=split_inputs or "whole")
        if isinstance(model, nn.Module):
            was_training[:] = [model.training]
            model.eval()

    def completed(_: Engine) -> None:
        if isinstance(model, nn.Module):
            # parameters() must again be the tensors the optimizer holds, and a checkpoint taken now
            # must see the sharded ones.
            reshard(model)
            if was_training and was_training[0]:
                model.train()

    engine.add_event_handler(Events.STARTED, started)
    handler.attach(engine)
    engine.add_event_handler(Events.COMPLETED, completed)
    return check_on_attach(engine, topo)  # ignite loggers leader-only, a DiskSaver of shards refused when attached
