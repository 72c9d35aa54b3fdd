"""How adopted ignite metrics reach the other ranks: ``ignite.distributed`` routed to the metric group, and the compute.

While an adopted metric updates or computes, ``idist.all_reduce``/``get_world_size``/``get_rank`` (and, where a
gather is right, ``all_gather``/``broadcast``/``barrier``) answer for the topology's metric group. A compute runs
each metric's own ``compute()`` once: the attributes its ``sync_all_reduce`` names are reduced for every metric
of the completion in one fused all-reduce first, any other reduction of a ``compute()`` is made as it comes, and
every rank then agrees on the outcome, so an error on one rank is raised on all of them instead of leaving the
others waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.metrics.metric import Metric, sync_all_reduce
from torch import Tensor

from meshwise.debug import guarded
from meshwise.errors import CollectiveTimeoutError, MetricError
from meshwise.metrics.replicas import replica_check, sync_failure

__all__ = ["Frame", "bump", "fused_compute", "routed", "version"]

_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AND", "OR")
_ROUTED = ("all_reduce", "get_world_size", "get_rank", "all_gather", "broadcast", "barrier")
# what a rank is doing at an agreement: the kinds of step a compute goes through
_REDUCE, _GATHER, _GATHER_OBJ, _BROADCAST, _BARRIER, _END, _FAILED = range(1, 8)
_KIND_NAMES = {
    _REDUCE: "all_reduce",
    _GATHER: "all_gather",
    _GATHER_OBJ: "all_gather",
    _BROADCAST: "broadcast",
    _BARRIER: "barrier",
    _END: "the end of compute()",
    _FAILED: "an error",
}
# ignite's sync_all_reduce wrapper: every compute it decorates shares this code object; its closure holds the
# attribute names and the undecorated compute
_SYNC_CODE = sync_all_reduce("x")(lambda self: None).__code__

_VERSION = [0]  # bumped on every update, reset and load of an adopted metric: an older result is stale


def version() -> int:
    """The current version of the adopted metrics' states."""
    return _VERSION[0]


def bump() -> None:
    """Mark every cached result stale (an adopted metric's state changed)."""
    _VERSION[0] += 1


# --------------------------------------------------------------------------- routing idist


@dataclass
class Frame:
    """The adopted metric whose code runs (its group and flags answer idist), and the compute it is part of."""

    adoption: Any
    session: _Session | None = None


_STACK: list[Frame] = []
_SAVED: dict[str, Any] = {}


class routed:
    """Route ``ignite.distributed``'s collectives through ``frame`` while the block runs (frames nest)."""

    def __init__(self, frame: Frame) -> None:
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


def current_session() -> _Session | None:
    """The compute in progress, if an adopted metric's code runs inside one."""
    return _STACK[-1].session if _STACK else None


def _size_rank(a: Any) -> tuple[int, int]:
    if a is None or a.group is None:
        return 1, 0
    return dist.get_world_size(a.group), dist.get_rank(a.group)


def _all_reduce(tensor: Any, op: str = "SUM", group: Any = None) -> Any:
    frame = _STACK[-1]
    op = op.upper()
    if op not in _OPS:
        raise MetricError(f"ignite all_reduce op {op!r} is not one meshwise routes ({', '.join(_OPS)})")
    a = frame.adoption
    if a is None or a.group is None:
        return tensor.clone() if isinstance(tensor, Tensor) else tensor
    if frame.session is not None:
        call = _Call(a, op, tensor, a.contributes)
        return call.out(frame.session.reduce([call])[0])
    with guarded(a.topo, a.dims, f"ignite {a.name} all_reduce"):
        return _SAVED["all_reduce"](tensor, op, group=a.group)


def _get_world_size() -> int:
    return _size_rank(_STACK[-1].adoption)[0]


def _get_rank() -> int:
    return _size_rank(_STACK[-1].adoption)[1]


def _gathering(name: str) -> Callable[..., Any]:
    def route(*args: Any, **kwargs: Any) -> Any:
        frame = _STACK[-1]
        a = frame.adoption
        if a is not None and a.group is not None and not a.gathers_right:
            raise MetricError(gather_refusal(a, f"idist.{name}"))
        if a is None or a.group is None:  # one rank in the group: what ignite does in one process
            if name == "all_gather":
                value = args[0] if args else kwargs.get("tensor")
                return value if isinstance(value, Tensor) else [value]
            if name == "broadcast":
                return args[0] if args else kwargs.get("tensor")
            return None
        if frame.session is None:  # an update: the metric group is the world here, ignite's own call is right
            return _SAVED[name](*args, **kwargs)
        return getattr(frame.session, name)(*args, **kwargs)

    return route


def gather_refusal(a: Any, what: str) -> str:
    """Why a gather of this adopted metric is refused on its mesh."""
    topo = a.topo
    return (
        f"ignite metric {a.name} calls {what}, which gathers every rank's values; on this mesh "
        f"({topo.layout.dims_text()}) ranks across the replica or split dims hold the same samples or parts of "
        "them, so a gather would count them several times. A gathering metric (EpochMetric, ROC_AUC, "
        "AveragePrecision...) is right with one rank in the metric group or on a mesh of batch dims only: use "
        "torchmetrics' equivalent (e.g. BinaryAUROC) in create_evaluator(metrics=...), which meshwise syncs over "
        "the batch + split dims"
    )


_ROUTES: dict[str, Callable[..., Any]] = {
    "all_reduce": _all_reduce,
    "get_world_size": _get_world_size,
    "get_rank": _get_rank,
    "all_gather": _gathering("all_gather"),
    "broadcast": _gathering("broadcast"),
    "barrier": _gathering("barrier"),
}


# --------------------------------------------------------------------------- reductions


@dataclass
class _Call:
    owner: Any
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


def _signature(calls: Sequence[_Call]) -> int:
    sig = len(calls)
    for c in calls:
        sig = (sig * 1_000_003 + c.numel * 8 + _OPS.index(c.op) + (4 if isinstance(c.value, Tensor) else 0)) % (1 << 50)
    return sig


def sync_plan(metric: Metric) -> tuple[Callable[..., Any], list[tuple[str, str]]] | None:
    """``(undecorated compute, [(attribute, op)])`` when the metric's compute is ignite's ``sync_all_reduce``
    wrapper and every attribute it names holds a number or a tensor; else None (compute runs as it is)."""
    fn = getattr(type(metric), "compute", None)
    code = getattr(fn, "__code__", None)
    if code is not _SYNC_CODE or fn.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))
    attrs, inner = cells.get("attrs"), cells.get("func")
    if not attrs or not callable(inner):
        return None
    plan = []
    for spec in attrs:
        attr, _, op = spec.partition(":")
        op = op or "SUM"
        if op not in ("MIN", "MAX", "SUM", "PRODUCT") or not isinstance(metric.__dict__.get(attr), (Number, Tensor)):
            return None  # ignite's own wrapper raises its own error for these
        plan.append((attr, op))
    return inner, plan


# --------------------------------------------------------------------------- one compute


class _Stop(Exception):
    """Marks an error every rank has agreed to raise: the compute ends, with no further collective."""


@dataclass
class _Session:
    """One compute of the metrics that complete together: their results, and how ranks stay in step."""

    topo: Any
    dims: tuple[str, ...]
    group: dist.ProcessGroup | None
    names: str
    size: int = 1
    rank: int = 0
    nodes: list[Any] = field(default_factory=list)
    plans: dict[int, Any] = field(default_factory=dict)
    installs: dict[int, list[tuple[str, Any]]] = field(default_factory=dict)
    stopped: bool = False

    # ---- agreement: every step where ranks meet starts with one small all-reduce of what each rank is doing
    def agree(self, kind: int, a: int = 0, b: int = 0, c: int = 0, node: int = -1, error: Any = None) -> Tensor:
        """Meet the other ranks of the group: returns the table of what each does (``[rank, 6]``), or raises on
        every rank when one of them failed (``error`` is this rank's) or they are at different steps."""
        meta = torch.zeros(self.size, 6, dtype=torch.int64, device=self.topo.device)
        meta[self.rank] = torch.tensor([int(error is not None), node, kind, a, b, c])
        try:
            with guarded(self.topo, self.dims, "ignite metric agreement all_reduce", tensor=meta):
                dist.all_reduce(meta, group=self.group)
        except (CollectiveTimeoutError, dist.DistError) as exc:
            self.stopped = True
            raise sync_failure(self.topo, self.dims, f"computing ignite metrics [{self.names}]", exc) from exc
        meta = meta.cpu()
        failed = meta[:, 0] > 0
        if bool(failed.any()):
            if bool(failed.all()) and bool((meta[:, 1] == meta[0, 1]).all()):
                return meta  # every rank failed in the same metric: its error is the result, as in one process
            self._raise_everywhere(meta, error)
        self._check_steps(meta)
        return meta

    def _raise_everywhere(self, meta: Tensor, error: Any) -> None:
        self.stopped = True
        mine = None if error is None else f"{type(error).__name__}: {error}"
        messages: list[Any] = [None] * self.size
        with guarded(self.topo, self.dims, "ignite metric error all_gather_object"):
            dist.all_gather_object(messages, mine, group=self.group)
        if error is not None:
            raise error
        ranks = self.topo.group_ranks(self.dims)
        failed = "; ".join(f"rank {ranks[r]}: {m}" for r, m in enumerate(messages) if m is not None)
        raise MetricError(
            f"{self.topo.label()}: ignite metrics [{self.names}]: compute() raised on other ranks of the metric "
            f"group ({failed}); this rank stops with them instead of waiting in a collective they will not join"
        )

    def _check_steps(self, meta: Tensor) -> None:
        kinds = meta[:, 2]
        same = bool((kinds == kinds[0]).all())
        if same and int(kinds[0]) == _REDUCE:
            same = bool((meta[:, 3:] == meta[0, 3:]).all())
        elif same and int(kinds[0]) == _GATHER:
            same = bool((meta[:, 4:] == meta[0, 4:]).all())
        if same:
            return
        self.stopped = True
        ranks = self.topo.group_ranks(self.dims)
        if bool((kinds == _REDUCE).all()):
            rows = ", ".join(
                f"rank {ranks[r]}: {int(meta[r, 3])} reductions of {int(meta[r, 4])} values" for r in range(self.size)
            )
            raise MetricError(
                f"ignite metrics [{self.names}]: ranks of the group over {', '.join(self.dims)} would reduce "
                f"different states ({rows}); a rank whose metric saw no batch at all cannot take part: give every "
                "rank the same number of batches (mesh_dataloader(..., mode='eval') does) or make the metric's states "
                "the same shape on every rank"
            )
        rows = ", ".join(f"rank {ranks[r]}: {_KIND_NAMES.get(int(meta[r, 2]), '?')}" for r in range(self.size))
        raise MetricError(
            f"ignite metrics [{self.names}]: ranks of the group over {', '.join(self.dims)} reached different "
            f"collectives in compute() ({rows}): a compute() whose collectives depend on this rank's own data "
            "cannot run on the mesh; make every collective unconditional"
        )

    # ---- the collectives a compute() makes
    def reduce(self, calls: Sequence[_Call]) -> list[Tensor]:
        """Every call's global value: an agreement on the layout, then one all-reduce of all of them."""
        size, me = self.size, self.rank
        self.agree(_REDUCE, len(calls), sum(c.numel for c in calls), _signature(calls))
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
        if buf.numel():
            buf = buf.to(self.topo.device)
            self._collective(lambda: dist.all_reduce(buf, group=self.group), "ignite metric all_reduce", buf)
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

    def _collective(self, run: Callable[[], Any], what: str, tensor: Tensor | None = None) -> None:
        try:
            with guarded(self.topo, self.dims, what, tensor=tensor):
                run()
        except (CollectiveTimeoutError, dist.DistError) as exc:
            self.stopped = True
            raise sync_failure(self.topo, self.dims, f"computing ignite metrics [{self.names}]", exc) from exc

    def all_gather(self, tensor: Any, group: Any = None) -> Any:
        """ignite's ``all_gather`` over the group, rows of any number per rank; a rank whose rows do not count
        (padding only) sends none."""
        a = _STACK[-1].adoption
        if not isinstance(tensor, Tensor):
            self.agree(_GATHER_OBJ)
            out: list[Any] = [None] * self.size
            self._collective(lambda: dist.all_gather_object(out, tensor, group=self.group), "ignite all_gather_object")
            return torch.tensor(out) if all(isinstance(v, Number) for v in out) else out
        t = tensor.unsqueeze(0) if tensor.ndim == 0 else tensor
        if not a.contributes:
            t = t[:0]
        trailing = t[0].numel() if t.shape[0] else int(torch.tensor(t.shape[1:]).prod())
        meta = self.agree(_GATHER, t.shape[0], trailing, _DTYPE_CODES.get(t.dtype, 0) * 16 + t.ndim)
        rows = [int(r) for r in meta[:, 3]]
        longest = max(rows)
        send = torch.zeros(longest, *t.shape[1:], dtype=t.dtype, device=self.topo.device)
        send[: t.shape[0]] = t.to(self.topo.device)
        received = [torch.empty_like(send) for _ in range(self.size)]
        self._collective(lambda: dist.all_gather(received, send, group=self.group), "ignite all_gather", send)
        return torch.cat([r[:n] for r, n in zip(received, rows)]).to(tensor.device)

    def broadcast(self, tensor: Any, src: int = 0, safe_mode: bool = False) -> Any:
        """ignite's ``broadcast`` from the group's rank ``src``."""
        self.agree(_BROADCAST, src)
        box = [tensor]
        root = dist.get_global_rank(self.group, src)
        self._collective(lambda: dist.broadcast_object_list(box, src=root, group=self.group), "ignite broadcast")
        value = box[0]
        return value.to(tensor.device) if isinstance(value, Tensor) and isinstance(tensor, Tensor) else value

    def barrier(self) -> None:
        self.agree(_BARRIER)

    # ---- computing one metric, once
    def compute(self, a: Any) -> Any:
        """Run ``a``'s own compute() once, on the global states (a MetricsLambda's call of its sources included:
        each call runs the source's compute(), as in ignite)."""
        key = id(a)
        a.executed = _VERSION[0]
        plan = self.plans.get(key)
        try:
            with routed(Frame(a, self)):
                if plan is None:
                    result = a.orig_compute()
                else:
                    result = self._compute_planned(a, plan[0])
        except BaseException as exc:
            if self.stopped or not isinstance(exc, Exception):
                raise
            if self.group is not None:
                node = self.nodes.index(a) if a in self.nodes else -1
                self.agree(_FAILED, node=node, error=exc)  # raises on every rank unless every rank failed here
            raise
        return result

    def _compute_planned(self, a: Any, inner: Callable[..., Any]) -> Any:
        m = a.metric
        installs = self.installs[id(a)]
        local = [(attr, getattr(m, attr)) for attr, _ in installs]
        for attr, value in installs:
            setattr(m, attr, value)
        try:
            return inner(m)
        finally:
            for attr, value in local:
                setattr(m, attr, value)


_DTYPE_CODES = {
    dt: i + 1
    for i, dt in enumerate(
        (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16)
        + (torch.int8, torch.uint8, torch.bool)
    )
}


def fused_compute(members: Sequence[Any], nodes: Sequence[Any]) -> dict[int, tuple[bool, Any]]:
    """Run the compute() of each of ``members`` (adopted metrics completing together) once; ``nodes``: every
    adopted metric their computes may reach (a MetricsLambda's sources). Returns ``{id(member): (ok, result or
    error)}``.

    With more than one rank in the group: the ``sync_all_reduce`` attributes of every node are reduced in one
    agreement and one fused all-reduce, each compute() then runs once on the global values (other reductions
    made as they come, each after an agreement), and a last agreement makes an error on any rank an error on
    every rank."""
    first = members[0]
    topo, dims, group = first.topo, first.dims, first.group
    names = ", ".join(m.name for m in members)
    session = _Session(topo, dims, group, names, nodes=list(nodes))
    if group is None:
        # ignite skips sync_all_reduce on one rank, so a state updated only for its shape would count: with no
        # other rank to agree with, it goes back to the empty state it stands for
        for a in nodes:
            if a.structure_only:
                a.orig_reset()
                a.structure_only = False
    else:
        session.size, session.rank = dist.get_world_size(group), dist.get_rank(group)
        calls: list[_Call] = []
        for a in nodes:
            plan = None if a.local else sync_plan(a.metric)
            if plan is not None:
                session.plans[id(a)] = plan
                calls.extend(_Call(a, op, getattr(a.metric, attr), a.contributes) for attr, op in plan[1])
        if calls:
            values = session.reduce(calls)
            i = 0
            for a in nodes:
                if id(a) in session.plans:
                    attrs = session.plans[id(a)][1]
                    session.installs[id(a)] = [
                        (attr, calls[i + j].out(values[i + j])) for j, (attr, _) in enumerate(attrs)
                    ]
                    i += len(attrs)
    results = {}
    for m in members:
        try:
            results[id(m)] = (True, session.compute(m))
        except Exception as exc:
            if session.stopped:
                raise
            results[id(m)] = (False, exc)
    if group is not None:
        session.agree(_END)
    if topo.debug:
        checks = [(m.name, 1e-6, results[id(m)][1]) for m in members if results[id(m)][0]]
        replica_check(topo, checks)
    return results
