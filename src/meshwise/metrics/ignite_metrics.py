"""ignite's own metrics on the mesh: masked updates and fused reductions over the topology's batch + split dims.

:func:`adopt_ignite_metrics` finds every ``ignite.metrics.Metric`` attached to an ignite ``Engine`` and makes it
count every valid sample once. ignite itself is not edited: while an adopted metric updates or computes,
``ignite.distributed``'s collective functions are routed to the metric group, and the metrics that complete
together are computed once each, their reductions fused (:mod:`~meshwise.metrics.ignite_compute`).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import ignite.distributed as idist
import torch.distributed as dist
from ignite.engine import Engine
from ignite.exceptions import NotComputableError
from ignite.metrics import Metric, MetricsLambda, RunningAverage, VariableAccumulation
from ignite.metrics.epoch_metric import EpochMetric
from torch import Tensor

from meshwise import compat
from meshwise.debug import guarded
from meshwise.errors import MetricError
from meshwise.metrics.ignite_compute import Frame, bump, current_session, fused_compute, gather_refusal, routed, version
from meshwise.topology import Topology, resolve

__all__ = ["adopt_ignite_metrics"]

_FLAGS = "_meshwise_structure_only"  # per-rank entry meshwise adds to a state_dict: which states do not count


# --------------------------------------------------------------------------- one adopted metric


@dataclass(eq=False)
class _Adoption:
    """What meshwise keeps about one adopted metric: its original methods, its group, its update flags."""

    metric: Metric
    topo: Topology
    dims: tuple[str, ...]
    group: dist.ProcessGroup | None
    split_inputs: str
    gathers_right: bool = False  # a gather over the group counts each sample once (no replica or split dims)
    engine: Any = None  # weakref to the engine whose batches hold the valid mask
    masked: bool = False  # updated by the engine: its rows are masked
    local: bool = False  # compute makes no reduction (RunningAverage): computed as is
    members: list[_Adoption] = field(default_factory=list)  # metrics computed with it in one fused sync
    contributed: bool = False  # updated with valid rows (or restored) since the last reset
    structure_only: bool = False  # updated with rows that do not count, only to give the state its shape
    pending: tuple[int, bool, Any] | None = None  # (version, ok, result or error) computed ahead of its call
    executed: int = -1  # the version of the states its compute() last ran on
    orig_update: Callable[..., Any] = field(init=False)
    orig_compute: Callable[..., Any] = field(init=False)
    orig_reset: Callable[..., Any] = field(init=False)
    orig_state_dict: Callable[..., Any] = field(init=False)
    orig_load_state_dict: Callable[..., Any] = field(init=False)

    def __post_init__(self) -> None:
        cls, m = type(self.metric), self.metric
        self.orig_update = cls.update.__get__(m)
        self.orig_compute = cls.compute.__get__(m)
        self.orig_reset = cls.reset.__get__(m)
        self.orig_state_dict = cls.state_dict.__get__(m)
        self.orig_load_state_dict = cls.load_state_dict.__get__(m)
        m.__dict__.update(
            update=self.update,
            compute=self.compute,
            reset=self.reset,
            state_dict=self.state_dict,
            load_state_dict=self.load_state_dict,
        )

    @property
    def name(self) -> str:
        return type(self.metric).__name__

    @property
    def contributes(self) -> bool:
        return not self.structure_only

    # ---- the methods installed on the metric
    def reset(self) -> None:
        bump()
        self.orig_reset()
        self.contributed = self.structure_only = False

    def update(self, output: Any) -> None:
        bump()
        with routed(Frame(self)):
            if not self.masked:
                self._update_unmasked(output)
                return
            kept, rows, masked = self._masked(output)
            topo = self.topo
            if self.split_inputs == "whole" and topo.split_dims and topo.coordinate(topo.split_dims) != 0:
                kept = 0  # whole samples: split coordinate 0 counts them, the others only learn the state's shape
            if kept != 0:
                if self.structure_only:
                    self.orig_reset()
                    self.structure_only = False
                self.orig_update(masked)
                self.contributed = True
            elif not self.contributed and not self.structure_only and rows != 0:
                # A rank with no valid row yet must still make the same reductions as the others (Precision's
                # `_updated`, a ConfusionMatrix's shape): it updates with rows that are then never counted.
                self.orig_update(output)
                self.structure_only = True

    def _update_unmasked(self, output: Any) -> None:
        try:
            self.orig_update(output)
        except NotComputableError:
            # RunningAverage(src) computes its source every batch: a batch that is padding on every rank of the
            # group (so on this one) has nothing to add, as in one process where such a batch does not exist
            src = getattr(self.metric, "src", None) if isinstance(self.metric, RunningAverage) else None
            if src is None or self._masked(None)[0] != 0:
                raise
            src.reset()

    def compute(self) -> Any:
        session = current_session()
        if session is not None:  # a MetricsLambda's call of its source, inside a compute
            return session.compute(self)
        if self.local:
            with routed(Frame(self)):
                return self.orig_compute()
        now = version()
        if self.pending is not None and self.pending[0] == now:
            _, ok, value = self.pending  # computed ahead, in the fused compute of the first metric of its event
            self.pending = None
        else:
            # the others of its event that will be asked for the first time since their states changed are
            # computed now, with it, in one sync; each compute() call of ignite runs the metric's compute() once
            run = [
                m
                for m in (self.members if self in self.members else [self])
                if m is self or (m.executed != now and (m.pending is None or m.pending[0] != now))
            ]
            results = fused_compute(run, _reachable(run))
            for m in run:
                if m is not self:
                    m.pending = (now, *results[id(m)])
            ok, value = results[id(self)]
        if not ok:
            raise value
        return value

    # ---- state_dict: which states count travels with them
    def state_dict(self) -> OrderedDict:
        """ignite's state_dict, each rank's entry also saying which of its states were updated only for their
        shape (a padding-only rank's), so that a restored metric counts what it counted."""
        state = self.orig_state_dict()
        flags = [a.structure_only for a in _reachable([self])]
        (key,) = state
        entries = state[key]
        if len(entries) > 1:
            every: list[Any] = [None] * len(entries)
            with guarded(self.topo, self.topo.dims, f"ignite {self.name} state_dict flags"):
                dist.all_gather_object(every, flags)
        else:
            every = [flags]
        for entry, rank_flags in zip(entries, every):
            if isinstance(entry, dict):
                entry[_FLAGS] = rank_flags
        return state

    def load_state_dict(self, state_dict: Mapping) -> None:
        """ignite's load_state_dict; the restored states count as they did when saved (a state saved without
        meshwise counts)."""
        flags: list[bool] | None = None
        if isinstance(state_dict, Mapping) and len(state_dict) == 1:
            (key,) = state_dict
            entries = state_dict[key]
            if isinstance(entries, list) and all(isinstance(e, Mapping) for e in entries):
                rank = idist.get_rank()
                if 0 <= rank < len(entries):
                    flags = entries[rank].get(_FLAGS)
                entries = [{k: v for k, v in e.items() if k != _FLAGS} for e in entries]
                state_dict = OrderedDict([(key, entries)])
        bump()
        self.orig_load_state_dict(state_dict)
        nodes = _reachable([self])
        if flags is None or len(flags) != len(nodes):
            flags = [False] * len(nodes)
        for a, only_shape in zip(nodes, flags):
            a.structure_only = bool(only_shape)
            a.contributed = not a.structure_only

    # ---- masking
    def _masked(self, output: Any) -> tuple[int, int, Any]:
        """(valid rows, rows, output with the padded rows dropped); -1 valid rows when there is no mask."""
        engine = self.engine() if self.engine is not None else None
        batch = getattr(getattr(engine, "state", None), "batch", None)
        valid = batch.get("valid") if isinstance(batch, Mapping) else None
        if not isinstance(valid, Tensor):
            return -1, -1, output
        if valid.ndim != 1 or valid.is_floating_point():
            raise MetricError(
                f"batch['valid'] must be a 1-D bool mask (one entry per row), got {valid.dtype}{list(valid.shape)}"
            )
        valid = valid != 0
        rows, kept = int(valid.shape[0]), int(valid.sum())
        if kept == rows:
            return kept, rows, output
        # VariableAccumulation (Average...) takes a 1-D tensor as one sample: only its 2-D outputs have rows
        row_ndim = 2 if isinstance(self.metric, VariableAccumulation) else 1
        return kept, rows, _take(output, valid, rows, self.name, row_ndim)


def _take(value: Any, valid: Tensor, rows: int, name: str, row_ndim: int) -> Any:
    """``value`` with the rows where ``valid`` is False dropped from every tensor that has a row axis."""
    if isinstance(value, Tensor):
        if value.ndim < row_ndim:
            return value
        if value.shape[0] != rows:
            raise MetricError(
                f"ignite metric {name} got a tensor of shape {list(value.shape)} but the batch has {rows} rows, "
                f"{rows - int(valid.sum())} of them padding: meshwise can only leave padded rows out of tensors with "
                "one row per sample; give the metric per-sample values (output_transform=) or skip_unrolling=True"
            )
        return value[valid.to(value.device)]
    if isinstance(value, Mapping):
        return type(value)({k: _take(v, valid, rows, name, row_ndim) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        return type(value)(_take(v, valid, rows, name, row_ndim) for v in value)
    return value


# --------------------------------------------------------------------------- finding the metrics of an engine


_KEY = "_meshwise_adoption"  # in the metric's __dict__: ignite's Metric.__getattr__ answers any missing name


def _adoption(metric: Metric) -> _Adoption | None:
    return metric.__dict__.get(_KEY)


def _attached(engine: Engine) -> tuple[dict[Any, list[Metric]], list[Metric]]:
    """The metrics computed at each event (their ``completed`` handler) and those the engine updates."""
    tops: dict[Any, list[Metric]] = {}
    updated: list[Metric] = []
    for event, handler, _args, _kwargs in compat.event_handlers(engine):
        handler = compat.handler_parent(handler)  # an event filter's wrapper stands for its handler
        owner = getattr(handler, "__self__", None)
        if not isinstance(owner, Metric):
            continue
        name = getattr(handler, "__name__", "")
        if name == "completed" and owner not in tops.setdefault(event, []):
            tops[event].append(owner)
        elif name == "iteration_completed" and owner not in updated:
            updated.append(owner)
    return tops, updated


def _sources(metric: Metric) -> list[Metric]:
    if isinstance(metric, MetricsLambda):
        return [m for m in [*metric.args, *metric.kwargs.values()] if isinstance(m, Metric)]
    if isinstance(metric, RunningAverage) and isinstance(metric.src, Metric):
        return [metric.src]
    return []


def adopt_ignite_metrics(
    engine: Engine, topology: Topology | None = None, *, split_inputs: Literal["parts", "whole"] = "whole"
) -> None:
    """Make every ignite ``Metric`` attached to ``engine`` count every valid sample exactly once on the mesh.

    Each metric the engine updates leaves out the padded rows (``engine.state.batch["valid"]`` False, as
    ``mesh_dataloader(..., mode="eval")`` pads) from every tensor of its transformed output with one row per
    sample; a batch with no valid row is not counted (no NaN, no error). ignite's ``idist`` reductions
    (``sync_all_reduce`` and direct ``idist.all_reduce`` calls) go to the group of ``topology.metric_dims``
    (batch + split dims, never replica dims). The metrics computed at the same event are computed together,
    each ``compute()`` once: the states their ``sync_all_reduce`` names go in one fused all-reduce, whatever
    their number, and every rank of the group gets the same value or the same error.
    ``split_inputs`` as for :class:`~meshwise.metrics.MeshMetric`, but
    ``"whole"`` by default since ignite's metrics count samples (rows): split coordinate 0 counts them;
    ``"parts"`` sums every split rank's part (right for a ratio of sums over equal parts, e.g. ``Loss`` of a
    per-token loss over a sequence split in equal chunks).

    Call it after attaching the metrics and before ``run`` (``create_evaluator`` calls it at ``STARTED``);
    calling it again adopts the metrics attached since. Raises :class:`MetricError` on a mesh with pipeline
    stages, and for a metric that gathers (``EpochMetric`` and its family) where a gather would count a sample
    several times: with more than one rank in the metric group on a mesh with replica or split dims.
    """
    topo = resolve(topology)
    if split_inputs not in ("parts", "whole"):
        raise MetricError(f"split_inputs must be 'parts' or 'whole', got {split_inputs!r}")
    tops, updated = _attached(engine)
    found = [m for ms in tops.values() for m in ms] + updated
    seen: list[Metric] = []
    while found:
        m = found.pop()
        if m not in seen:
            seen.append(m)
            found.extend(_sources(m))
    if not seen:
        return
    if topo.stage_dims and topo.size(topo.stage_dims) > 1:
        raise MetricError(
            f"ignite metrics {sorted({type(m).__name__ for m in seen})} on a mesh with pipeline stages "
            f"({topo.layout.dims_text()}): only the last stage has outputs; use torchmetrics in "
            "create_evaluator(metrics=...), which computes on the last stage and sends the values to the others"
        )
    dims = topo.metric_dims
    group = topo.group(dims) if topo.size(dims) > 1 else None
    # a gather over the metric group is the gather of one process when every rank of it holds other samples
    gathers_right = group is None or topo.size((*topo.replica_dims, *topo.split_dims)) == 1
    ref = weakref.ref(engine)
    for m in seen:
        a = _adoption(m)
        if a is None:
            a = m.__dict__[_KEY] = _Adoption(m, topo, dims, group, split_inputs)
        elif a.topo is not topo:
            raise MetricError(f"ignite metric {a.name} was adopted on another topology: attach a new metric")
        a.gathers_right = gathers_right
        if isinstance(m, EpochMetric) and not gathers_right:
            raise MetricError(gather_refusal(a, "idist.all_gather in compute() (it is an EpochMetric)"))
        a.split_inputs = split_inputs
        a.local = isinstance(m, RunningAverage)
        a.engine = ref
        a.masked = m in updated and not a.local
    for ms in tops.values():
        members = [a for a in map(_adoption, ms) if a is not None and not a.local]
        for a in members:
            a.members = members


def _reachable(members: list[_Adoption]) -> list[_Adoption]:
    """``members`` and every adopted metric their computes reach (a MetricsLambda's or RunningAverage's sources)."""
    out: list[_Adoption] = []
    todo = list(members)
    while todo:
        a = todo.pop(0)
        if a not in out:
            out.append(a)
            todo.extend(b for b in map(_adoption, _sources(a.metric)) if b is not None)
    return out
