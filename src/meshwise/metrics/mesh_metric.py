"""MeshMetric: a torchmetrics metric that counts every sample once on any mesh, and the fused compute of several.

:class:`MeshMetric` attaches a torchmetrics ``Metric`` or ``MetricCollection`` to a
:class:`~meshwise.Topology`: masked updates (:func:`filter_rows`), a sync over the batch + split dims only,
on the last pipeline stage; :func:`compute_all` computes several with one fused sync (see
:mod:`meshwise.metrics.sync`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric, MetricCollection

from meshwise import compat
from meshwise.debug import guarded
from meshwise.errors import CollectiveTimeoutError, MetricError, TopologyError
from meshwise.layout import Dims
from meshwise.metrics.replicas import replica_check, sync_failure
from meshwise.metrics.sync import is_fused, leaves, sync_states, to_cpu
from meshwise.topology import Topology, resolve

__all__ = ["MeshMetric", "Select", "compute_all", "filter_rows"]

Select = Callable[[Any, Mapping[str, Any]], Any]
"""``select(output, batch)``: the positional arguments of a metric's ``update`` for one evaluator batch."""

_SPLIT_INPUTS = ("parts", "whole")


# --------------------------------------------------------------------------- masked rows


def filter_rows(valid: Tensor | None, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """Keep the rows where ``valid`` is true in every tensor argument with a row axis (axis 0).

    Returns ``(args, kwargs, rows_kept)``; 0-dim tensors and non-tensors pass through. With
    ``valid=None`` nothing is filtered and ``rows_kept`` is -1. A mask that is not 1-D, or whose length
    differs from axis 0 of a batched argument, raises :class:`MetricError`.
    """
    if valid is None:
        return args, kwargs, -1
    if not isinstance(valid, Tensor):
        valid = torch.as_tensor(valid)
    if valid.ndim != 1:
        raise MetricError(
            f"the valid mask must be 1-D with one entry per row, got shape {tuple(valid.shape)}: pass "
            "batch['valid'] (torch.bool [B_local])"
        )
    if valid.dtype != torch.bool:
        if valid.is_floating_point() or valid.is_complex():
            raise MetricError(f"the valid mask must be bool (or 0/1 integers), got {valid.dtype}")
        valid = valid != 0
    rows = valid.shape[0]

    def pick(name: str, value: Any) -> Any:
        if not isinstance(value, Tensor) or value.ndim == 0:
            return value
        if value.shape[0] != rows:
            raise MetricError(
                f"the valid mask has {rows} rows but {name} has shape {tuple(value.shape)}: the mask needs one "
                "entry per row (axis 0) of every batched argument; filter or pad them to the same rows"
            )
        return value[valid.to(value.device)]

    out_args = tuple(pick(f"argument {i}", a) for i, a in enumerate(args))
    out_kwargs = {k: pick(f"argument {k!r}", v) for k, v in kwargs.items()}
    return out_args, out_kwargs, int(valid.sum())


# --------------------------------------------------------------------------- the wrapper


class MeshMetric:
    """A torchmetrics ``Metric`` or ``MetricCollection`` that syncs over ``topology.metric_dims`` only.

    ``update(*args, valid=mask, **kwargs)`` drops the rows where ``mask`` is False (zero-weight padding
    from exact evaluation) from every batched argument before the metric's own ``update``; a batch with
    no valid row is skipped. ``compute()`` reduces every state over the batch + split dims — never over
    replica dims — in one fused all-reduce (a second all-gather only for concatenated states such as
    AUROC's), on the last pipeline stage; other stages receive the result by a broadcast along the stage
    dim (``stage_result="broadcast"``) or get ``None`` (``"none"``).

    ``split_inputs``: what each rank along the ``split`` dims passes to ``update``. ``"parts"`` (default):
    its part of the samples, and the parts' sums add up (per-cell MSE over a field, a per-token loss over
    a sequence split in chunks). ``"whole"``: every split rank holds whole-sample outputs (logits after the
    model's own reduction over the split group), so only split coordinate 0 updates; for per-sample metrics.

    ``replica_check`` (default: debug mode, ``init(debug=True)`` or ``MESHWISE_DEBUG=1``) verifies after
    ``compute()`` that ranks along replica dims hold equal values (relative tolerance ``replica_rtol``), with one
    all-gather over the replica group; off, it costs nothing. ``select(output, batch)`` tells
    :func:`meshwise.create_evaluator` which arguments to pass to ``update``. ``last_collectives`` is the
    number of collectives the last ``compute()`` made (a metric left to torchmetrics' own sync counts once).
    """

    def __init__(
        self,
        metric: Metric | MetricCollection,
        topology: Topology | None = None,
        *,
        dims: Dims | None = None,
        split_inputs: Literal["parts", "whole"] = "parts",
        replica_check: bool | None = None,
        replica_rtol: float = 1e-6,
        stage_result: Literal["broadcast", "none"] = "broadcast",
        select: Select | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(metric, (Metric, MetricCollection)):
            raise MetricError(
                f"MeshMetric needs a torchmetrics Metric or MetricCollection, got {type(metric).__name__}: "
                "wrap your metric in a torchmetrics.Metric subclass"
            )
        topo = resolve(topology)
        if not isinstance(topo, Topology):
            raise MetricError(f"topology must be a meshwise.Topology, got {type(topo).__name__}")
        if split_inputs not in _SPLIT_INPUTS:
            raise MetricError(
                f"split_inputs must be 'parts' (each split rank updates with its part of the samples) or 'whole' "
                f"(every split rank holds whole samples; only split coordinate 0 updates), got {split_inputs!r}"
            )
        if stage_result not in ("broadcast", "none"):
            raise MetricError(f"stage_result must be 'broadcast' or 'none', got {stage_result!r}")
        self.metric = metric
        self.topology = topo
        self.dims = _metric_dims(topo, dims)
        self.split_inputs = split_inputs
        self.replica_check = replica_check
        self.replica_rtol = float(replica_rtol)
        self.stage_result = stage_result
        self.select = select
        self.name = name or type(metric).__name__
        self.last_collectives = 0
        self.group = topo.group(self.dims) if topo.size(self.dims) > 1 else None
        dtypes = [leaf.dtype for leaf in leaves(metric)]
        metric.to(topo.device)
        for leaf, dtype in zip(leaves(metric), dtypes):
            if leaf.dtype != dtype:  # torchmetrics' .to(device) resets set_dtype's choice to the default dtype,
                leaf.set_dtype(dtype)  # and update() would then round float64 inputs to float32 (9e-6 off)
            self._adopt(leaf)

    def _adopt(self, leaf: Metric) -> None:
        own = leaf.process_group
        if own is not None and (self.group is None or own is not self.group):
            try:
                described = f"a group of ranks {dist.get_process_group_ranks(own)}"
            except (RuntimeError, ValueError, AttributeError):
                described = repr(own)
            raise MetricError(
                f"metric {type(leaf).__name__} was built with process_group= {described}, which is not this topology's "
                f"metric group over {self.dims or '()'}: build it without process_group, meshwise picks the group "
                "from the roles (or pass dims= to choose other batch/split dims)"
            )
        if leaf.dist_sync_on_step:
            raise MetricError(
                f"metric {type(leaf).__name__} has dist_sync_on_step=True, which syncs over the whole world on "
                "every forward: build it with the default dist_sync_on_step=False; meshwise syncs at compute()"
            )
        fallback = self.group is not None and not is_fused(leaf)
        # torchmetrics must not sync by itself (it would use the world group), except for the states it
        # alone knows how to merge, which it then syncs over the right group.
        leaf.sync_on_compute = fallback
        compat.set_metric_to_sync(leaf, fallback)
        leaf.process_group = self.group if fallback else None

    # ---- the torchmetrics interface
    def update(self, *args: Any, valid: Tensor | None = None, **kwargs: Any) -> None:
        """Update with the valid rows only; a no-op off the last stage and, with ``split_inputs="whole"``, off
        split coordinate 0."""
        args, kwargs, kept = filter_rows(valid, *args, **kwargs)
        topo = self.topology
        if not topo.is_last_stage or kept == 0:
            return
        if self.split_inputs == "whole" and topo.split_dims and topo.coordinate(topo.split_dims) != 0:
            return
        self.metric.update(*args, **kwargs)

    def compute(self) -> Any:
        """The metric over every valid row of the group (same value on every rank of the group)."""
        return compute_all([self])[0]

    def reset(self) -> None:
        self.metric.reset()

    def __repr__(self) -> str:
        return f"MeshMetric({self.name}, dims={self.dims}, split_inputs={self.split_inputs!r})"


def _metric_dims(topo: Topology, dims: Dims | None) -> tuple[str, ...]:
    if dims is None:
        return topo.metric_dims
    try:
        names = topo.layout.normalize(dims)
    except TopologyError as exc:
        raise MetricError(f"metric dims {dims!r} are not part of the topology: {exc}") from None
    wrong = [d for d in names if topo.roles[d] not in ("batch", "split")]
    if wrong:
        raise MetricError(
            f"metric dims {names} include {', '.join(f'{d} ({topo.roles[d]})' for d in wrong)}: a metric sums only "
            f"over batch and split dims (replica ranks hold the same samples, counts would be multiplied by their "
            f"size); use dims from {topo.metric_dims} (the mesh: {topo.layout.dims_text()})"
        )
    return names


# --------------------------------------------------------------------------- computing several with one sync


def compute_all(metrics: Sequence[MeshMetric]) -> list[Any]:
    """Compute several :class:`MeshMetric` of one topology with one fused sync; their values, in order.

    Every rank of the group must call it with the same metrics in the same order. A rank that does not
    makes the others fail after the topology's timeout with :class:`MetricSyncTimeout`, which names the
    mesh dims, their roles and the ranks that did not arrive.
    """
    metrics = list(metrics)
    if not metrics:
        return []
    topo, dims = metrics[0].topology, metrics[0].dims
    for m in metrics:
        if not isinstance(m, MeshMetric):
            raise MetricError(
                f"compute_all() takes MeshMetric objects, got {type(m).__name__}: wrap it with "
                "MeshMetric(metric, topology)"
            )
        if m.topology is not topo or m.dims != dims:
            raise MetricError(
                f"compute_all() needs metrics of one topology and dims; {m.name} syncs over {m.dims}, "
                f"{metrics[0].name} over {dims}: compute them separately"
            )
    names = ", ".join(m.name for m in metrics)
    count = 0
    results: list[Any] = [None] * len(metrics)
    if topo.is_last_stage:
        results, count = _compute_on_last_stage(metrics, names)
    stage = topo.stage_dims
    if stage and topo.size(stage) > 1 and metrics[0].stage_result == "broadcast":
        payload = [to_cpu(results) if topo.is_last_stage else None]
        try:
            with guarded(topo, stage, "metric result broadcast"):
                dist.broadcast_object_list(payload, group=topo.group(stage), group_src=topo.size(stage) - 1)
        except (CollectiveTimeoutError, dist.DistError) as exc:
            raise sync_failure(topo, stage, f"sending metrics [{names}] from the last stage", exc) from exc
        results = payload[0]
        count += 1
    for m in metrics:
        m.last_collectives = count
    return results


def _compute_on_last_stage(metrics: list[MeshMetric], names: str) -> tuple[list[Any], int]:
    """Sync the states of ``metrics`` over their group, compute each, restore the local states; values and count."""
    topo, dims, group = metrics[0].topology, metrics[0].dims, metrics[0].group
    all_leaves = [leaf for m in metrics for leaf in leaves(m.metric)]
    for leaf in all_leaves:
        compat.clear_metric_computed(leaf)  # a cached value would skip the states set below
    count = 0
    if group is not None:
        try:
            count = sync_states(topo, dims, group, all_leaves)
        except (CollectiveTimeoutError, dist.DistError) as exc:
            raise sync_failure(topo, dims, f"computing metrics [{names}]", exc) from exc
        count += sum(1 for leaf in all_leaves if not is_fused(leaf))  # torchmetrics' own sync: counted once
    results: list[Any] = [None] * len(metrics)
    try:
        with warnings.catch_warnings():
            # ranks without a valid row never called update(); their synced states are the global ones
            warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
            for i, m in enumerate(metrics):
                if group is not None and not all(is_fused(leaf) for leaf in leaves(m.metric)):
                    with guarded(topo, dims, f"torchmetrics sync of {m.name}"):
                        results[i] = m.metric.compute()
                else:
                    results[i] = m.metric.compute()
    except (CollectiveTimeoutError, dist.DistError) as exc:  # a metric's own errors pass unchanged
        raise sync_failure(topo, dims, f"computing metrics [{names}]", exc) from exc
    finally:
        for leaf in all_leaves:
            if compat.metric_is_synced(leaf):
                leaf.unsync()  # back to the local states, so updates keep accumulating
    on = topo.debug
    checks = [
        (m.name, m.replica_rtol, value)
        for m, value in zip(metrics, results)
        if (on if m.replica_check is None else m.replica_check)
    ]
    return results, count + replica_check(topo, checks)
