"""ignite's own metrics on the mesh: masked updates and fused reductions over the topology's batch + split dims.

:func:`adopt_ignite_metrics` finds every ``ignite.metrics.Metric`` attached to an ignite ``Engine`` and makes it
count every valid sample once. ignite itself is not edited: while an adopted metric updates or computes,
``ignite.distributed``'s collective functions are routed to the metric group; a ``compute()`` first runs with
its reductions recorded, then one fused all-reduce serves them all, then the metric's own ``compute()`` is
replayed on the global values.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Engine
from ignite.exceptions import NotComputableError
from ignite.metrics import Metric, MetricsLambda, RunningAverage, VariableAccumulation
from ignite.metrics.epoch_metric import EpochMetric
from torch import Tensor

from meshwise import compat
from meshwise.debug import guarded
from meshwise.errors import CollectiveTimeoutError, MetricError
from meshwise.metrics.sync import replica_check, sync_failure
from meshwise.topology import Topology, resolve

__all__ = ["adopt_ignite_metrics"]

_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AND", "OR")
_ROUTED = ("all_reduce", "get_world_size", "get_rank", "all_gather", "broadcast", "barrier")
_GATHERS = ("all_gather", "broadcast", "barrier", "all_gather_tensors_with_shapes")


class _Unsupported(Exception):
    """A metric's compute asked for a collective meshwise cannot fuse (a gather or a broadcast)."""


# --------------------------------------------------------------------------- one adopted metric


@dataclass(eq=False)
class _Adoption:
    """What meshwise keeps about one adopted metric: its original methods, its group, its update flags."""

    metric: Metric
    topo: Topology
    dims: tuple[str, ...]
    group: dist.ProcessGroup | None
    split_inputs: str
    engine: Any = None  # weakref to the engine whose batches hold the valid mask
    masked: bool = False  # updated by the engine: its rows are masked
    local: bool = False  # compute makes no reduction (RunningAverage): computed as is
    members: list[_Adoption] = field(default_factory=list)  # metrics computed with it in one fused sync
    contributed: bool = False  # updated with valid rows since the last reset
    structure_only: bool = False  # updated with rows that do not count, only to give the state its shape
    pending: tuple[int, Any] | None = None  # (version, result or exception) from a fused compute
    orig_update: Callable[..., Any] = field(init=False)
    orig_compute: Callable[..., Any] = field(init=False)
    orig_reset: Callable[..., Any] = field(init=False)

    def __post_init__(self) -> None:
        cls = type(self.metric)
        self.orig_update = cls.update.__get__(self.metric)
        self.orig_compute = cls.compute.__get__(self.metric)
        self.orig_reset = cls.reset.__get__(self.metric)
        self.metric.__dict__.update(update=self.update, compute=self.compute, reset=self.reset)

    @property
    def name(self) -> str:
        return type(self.metric).__name__

    @property
    def contributes(self) -> bool:
        return self.contributed and not self.structure_only

    # ---- the methods installed on the metric
    def reset(self) -> None:
        _bump()
        self.orig_reset()
        self.contributed = self.structure_only = False

    def update(self, output: Any) -> None:
        _bump()
        with _frame(_Frame("direct", self)):
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
        if _STACK and _STACK[-1].kind in ("record", "replay"):
            session = _STACK[-1].session
            session.owners.append(self)
            try:
                return self.orig_compute()
            finally:
                session.owners.pop()
        if self.local:
            with _frame(_Frame("direct", self)):
                return self.orig_compute()
        if self.pending is not None and self.pending[0] == _VERSION[0]:
            result = self.pending[1]
            self.pending = None
            if isinstance(result, BaseException):
                raise result
            return result
        members = self.members if self in self.members else [self]
        results = _fused_compute(members)
        for m, r in zip(members, results):
            m.pending = (_VERSION[0], r)
        return self.compute()

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


# --------------------------------------------------------------------------- routing idist


_VERSION = [0]  # bumped on every update and reset of an adopted metric: a fused result older than that is stale
_STACK: list[_Frame] = []
_SAVED: dict[str, Any] = {}


def _bump() -> None:
    _VERSION[0] += 1


@dataclass
class _Call:
    owner: _Adoption | None
    op: str
    value: Any  # the local tensor or number
    contributes: bool

    @property
    def numel(self) -> int:
        return self.value.numel() if isinstance(self.value, Tensor) else 1

    def flat(self) -> Tensor:
        if isinstance(self.value, Tensor):
            if self.value.is_complex():
                raise MetricError(f"ignite metric {self.owner.name if self.owner else ''}: complex states cannot sync")
            return self.value.detach().reshape(-1).to("cpu", torch.float64)
        return torch.tensor([float(self.value)], dtype=torch.float64)

    def out(self, flat: Tensor) -> Any:
        """The reduced value in the form the metric gave it: a tensor like the local one, or a number."""
        v = self.value
        if isinstance(v, Tensor):
            if not v.is_floating_point():
                flat = flat.round()
            return flat.view(v.shape).to(dtype=v.dtype, device=v.device)
        if isinstance(v, bool):
            return bool(flat[0])
        return int(round(float(flat[0]))) if isinstance(v, int) else float(flat[0])


@dataclass
class _Session:
    """The reductions a fused compute recorded, and (after the sync) their global values to replay."""

    size: int
    rank: int
    calls: list[_Call] = field(default_factory=list)
    owners: list[_Adoption] = field(default_factory=list)
    unsupported: str = ""
    values: list[Tensor] = field(default_factory=list)
    cursor: int = 0
    end: int = 0


@dataclass
class _Frame:
    kind: Literal["direct", "record", "replay"]
    adoption: _Adoption | None = None
    session: _Session | None = None


class _frame:
    """Route ``ignite.distributed``'s collectives through ``frame`` while the block runs (frames nest)."""

    def __init__(self, frame: _Frame) -> None:
        self.frame = frame

    def __enter__(self) -> None:
        if not _STACK:
            for name in _ROUTED:
                _SAVED[name] = getattr(idist, name)
                setattr(idist, name, _ROUTES[name])
        _STACK.append(self.frame)

    def __exit__(self, *exc: object) -> None:
        _STACK.pop()
        if not _STACK:
            for name, real in _SAVED.items():
                setattr(idist, name, real)


def _group_of(frame: _Frame) -> tuple[int, int]:
    if frame.session is not None:
        return frame.session.size, frame.session.rank
    a = frame.adoption
    if a is None or a.group is None:
        return 1, 0
    return dist.get_world_size(a.group), dist.get_rank(a.group)


def _all_reduce(tensor: Any, op: str = "SUM", group: Any = None) -> Any:
    frame = _STACK[-1]
    op = op.upper()
    if op not in _OPS:
        raise MetricError(f"ignite all_reduce op {op!r} is not one meshwise routes ({', '.join(_OPS)})")
    if frame.kind == "direct":
        a = frame.adoption
        if a is None or a.group is None:
            return tensor.clone() if isinstance(tensor, Tensor) else tensor
        with guarded(a.topo, a.dims, f"ignite {a.name} all_reduce"):
            return _SAVED["all_reduce"](tensor, op, group=a.group)
    session = frame.session
    assert session is not None
    if frame.kind == "record":
        owner = session.owners[-1] if session.owners else None
        contributes = owner is None or not owner.masked or owner.contributes
        session.calls.append(_Call(owner, op, tensor, contributes))
        return tensor.clone() if isinstance(tensor, Tensor) else tensor
    i = session.cursor
    numel = tensor.numel() if isinstance(tensor, Tensor) else 1
    if i >= session.end or session.calls[i].numel != numel or session.calls[i].op != op:
        raise MetricError(
            "an ignite metric's compute() made other reductions when replayed on the global values than on the "
            "local ones (its reductions depend on its data): make every reduction unconditional, e.g. with "
            "sync_all_reduce on the attributes"
        )
    session.cursor += 1
    return session.calls[i].out(session.values[i])


def _get_world_size() -> int:
    return _group_of(_STACK[-1])[0]


def _get_rank() -> int:
    return _group_of(_STACK[-1])[1]


def _unsupported(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        frame = _STACK[-1]
        if frame.session is not None:
            frame.session.unsupported = frame.session.unsupported or name
        raise _Unsupported(name)

    return refuse


_ROUTES: dict[str, Callable[..., Any]] = {
    "all_reduce": _all_reduce,
    "get_world_size": _get_world_size,
    "get_rank": _get_rank,
    "all_gather": _unsupported("all_gather"),
    "broadcast": _unsupported("broadcast"),
    "barrier": _unsupported("barrier"),
}


# --------------------------------------------------------------------------- the fused compute


def _fused_compute(members: list[_Adoption]) -> list[Any]:
    """Compute ``members`` with one fused sync: record their reductions, reduce them together, replay."""
    first = members[0]
    topo, dims, group = first.topo, first.dims, first.group
    size, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    session = _Session(size, rank)
    if group is None:
        # ignite skips sync_all_reduce on one rank, so a state updated only for its shape would count: with no
        # other rank to agree with, it goes back to the empty state it stands for
        for a in _reachable(members):
            if a.structure_only:
                a.orig_reset()
                a.structure_only = False
    segments = []
    for m in members:
        start = len(session.calls)
        session.owners = [m]
        with _frame(_Frame("record", m, session)):
            try:
                m.orig_compute()
            except Exception:  # noqa: BLE001 - local values only; the replay below raises what matters
                pass
        segments.append((start, len(session.calls)))
    names = ", ".join(m.name for m in members)
    try:
        session.values = _reduce(topo, dims, group, session, names)
    except (CollectiveTimeoutError, dist.DistError) as exc:
        raise sync_failure(topo, dims, f"computing ignite metrics [{names}]", exc) from exc
    results: list[Any] = []
    for m, (start, end) in zip(members, segments):
        session.cursor, session.end, session.owners = start, end, [m]
        with _frame(_Frame("replay", m, session)):
            try:
                results.append(m.orig_compute())
            except MetricError:
                raise
            except Exception as exc:  # noqa: BLE001 - the metric's own error, the same on every rank: its compute raises it
                results.append(exc)
    if topo.debug:
        checks = [(m.name, 1e-6, r) for m, r in zip(members, results) if not isinstance(r, BaseException)]
        replica_check(topo, checks)
    return results


def _reachable(members: list[_Adoption]) -> list[_Adoption]:
    out: list[_Adoption] = []
    todo = list(members)
    while todo:
        a = todo.pop()
        if a not in out:
            out.append(a)
            todo.extend(b for b in map(_adoption, _sources(a.metric)) if b is not None)
    return out


def _signature(calls: list[_Call]) -> int:
    sig = len(calls)
    for c in calls:
        sig = (sig * 1_000_003 + c.numel * 8 + _OPS.index(c.op) + (4 if isinstance(c.value, Tensor) else 0)) % (1 << 50)
    return sig


def _reduce(
    topo: Topology, dims: tuple[str, ...], group: dist.ProcessGroup | None, session: _Session, names: str
) -> list[Tensor]:
    """Every recorded reduction's global value: a layout check, then one all-reduce of all of them."""
    calls, size, me = session.calls, session.size, session.rank
    if group is not None:
        # Ranks must agree on the reductions before their values share a buffer (a size mismatch aborts gloo).
        meta = torch.zeros(size, 4, dtype=torch.int64, device=topo.device)
        meta[me] = torch.tensor([len(calls), sum(c.numel for c in calls), _signature(calls), bool(session.unsupported)])
        with guarded(topo, dims, "ignite metric layout all_reduce", tensor=meta):
            dist.all_reduce(meta, group=group)
        _check_layout(topo, dims, meta.cpu(), session, names)
    elif session.unsupported:
        _check_layout(topo, dims, torch.tensor([[0, 0, 0, 1]]), session, names)
    sums = [c for c in calls if c.op == "SUM"]
    slots = [c for c in calls if c.op != "SUM"]
    sum_n = sum(c.numel for c in sums)
    slot_n = sum(c.numel + 1 for c in slots)
    buf = torch.zeros(sum_n + size * slot_n, dtype=torch.float64)
    offset = 0
    for c in sums:
        if c.contributes:
            buf[offset : offset + c.numel] = c.flat()
        offset += c.numel
    offset = sum_n + me * slot_n
    for c in slots:
        buf[offset] = float(c.contributes)
        buf[offset + 1 : offset + 1 + c.numel] = c.flat()
        offset += c.numel + 1
    if group is not None and buf.numel():
        buf = buf.to(topo.device)
        with guarded(topo, dims, "ignite metric all_reduce", tensor=buf):
            dist.all_reduce(buf, group=group)
        buf = buf.cpu()
    out: dict[int, Tensor] = {}
    offset = 0
    for c in sums:
        out[id(c)] = buf[offset : offset + c.numel]
        offset += c.numel
    per_rank = buf[sum_n:].view(size, slot_n)
    offset = 0
    for c in slots:
        flags = per_rank[:, offset] > 0
        values = per_rank[:, offset + 1 : offset + 1 + c.numel]
        values = values[flags] if bool(flags.any()) else values[:1] * 0
        offset += c.numel + 1
        if c.op == "PRODUCT":
            out[id(c)] = values.prod(0)
        elif c.op in ("MIN", "AND"):
            out[id(c)] = values.amin(0)
        else:
            out[id(c)] = values.amax(0)
    return [out[id(c)] for c in calls]


def _check_layout(topo: Topology, dims: tuple[str, ...], meta: Tensor, session: _Session, names: str) -> None:
    ranks = topo.group_ranks(dims) if dims else [topo.rank]
    bad = [ranks[r] for r in range(meta.shape[0]) if int(meta[r, 3])]
    if bad:
        what = session.unsupported or "a gather"
        raise MetricError(
            f"ignite metrics [{names}]: compute() calls idist.{what} on ranks {bad}; meshwise fuses only "
            "all_reduce (sync_all_reduce) reductions, and a gathering metric (EpochMetric, ROC_AUC, "
            "AveragePrecision...) would gather on the wrong group: use torchmetrics' equivalent in "
            "create_evaluator(metrics=...), which meshwise syncs over the batch + split dims"
        )
    if bool((meta[:, :3] == meta[0, :3]).all()):
        return
    rows = ", ".join(
        f"rank {ranks[r]}: {int(meta[r, 0])} reductions of {int(meta[r, 1])} values" for r in range(len(ranks))
    )
    raise MetricError(
        f"ignite metrics [{names}]: ranks of the group over {', '.join(dims)} would reduce different states ({rows}); "
        "a rank whose metric saw no batch at all cannot take part: give every rank the same number of batches "
        "(mesh_dataloader(..., mode='eval') does) or make the metric's states the same shape on every rank"
    )


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
    (batch + split dims, never replica dims). The metrics computed at the same event are computed together:
    one small layout all-reduce and one fused all-reduce of every state, whatever their number; every rank
    of the group gets the same value. ``split_inputs`` as for :class:`~meshwise.metrics.MeshMetric`, but
    ``"whole"`` by default since ignite's metrics count samples (rows): split coordinate 0 counts them;
    ``"parts"`` sums every split rank's part (right for a ratio of sums over equal parts, e.g. ``Loss`` of a
    per-token loss over a sequence split in equal chunks).

    Call it after attaching the metrics and before ``run`` (``create_evaluator`` calls it at ``STARTED``);
    calling it again adopts the metrics attached since. Raises :class:`MetricError` for a metric that gathers
    in ``compute()`` (``EpochMetric`` and its family) and on a mesh with pipeline stages.
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
    for m in seen:
        if isinstance(m, EpochMetric):
            raise MetricError(
                f"ignite's {type(m).__name__} gathers every prediction to one rank (an EpochMetric), which meshwise "
                "cannot route to the metric group: use torchmetrics' equivalent (e.g. BinaryAUROC) in "
                "create_evaluator(metrics=...), synced over the batch + split dims"
            )
    dims = topo.metric_dims
    group = topo.group(dims) if topo.size(dims) > 1 else None
    ref = weakref.ref(engine)
    for m in seen:
        a = _adoption(m)
        if a is None:
            a = m.__dict__[_KEY] = _Adoption(m, topo, dims, group, split_inputs)
        elif a.topo is not topo:
            raise MetricError(f"ignite metric {a.name} was adopted on another topology: attach a new metric")
        a.split_inputs = split_inputs
        a.local = isinstance(m, RunningAverage)
        a.engine = ref
        a.masked = m in updated and not a.local
    for ms in tops.values():
        members = [a for a in map(_adoption, ms) if a is not None and not a.local]
        for a in members:
            a.members = members
