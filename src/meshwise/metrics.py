"""Torchmetrics that count every sample once: synced over the topology's batch + split dims with one fused collective.

:class:`MeshMetric` attaches a torchmetrics ``Metric`` or ``MetricCollection`` to a :class:`~meshwise.Topology`;
:class:`MeanLoss` is a sample- or token-weighted mean; :func:`compute_all` fuses several metrics into one sync.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_mean, dim_zero_sum

from meshwise.debug import guarded
from meshwise.errors import CollectiveTimeoutError, MetricError, MetricSyncTimeout, TopologyError
from meshwise.topology import Dims, Topology

__all__ = ["MeanLoss", "MeshMetric", "MetricSyncTimeout", "attach", "compute_all", "filter_rows"]

Select = Callable[[Any, Mapping[str, Any]], Any]


# --------------------------------------------------------------------------- a weighted mean


class MeanLoss(Metric):
    """Mean of a loss over every valid sample or token of the data group: ``sum(loss * weight) / sum(weight)``.

    ``update(values, weight=None)`` takes per-sample (``[B]``) or per-token (``[B, T]``) losses, each
    element weighing 1 (or ``weight``, broadcast to ``values``), or a scalar batch mean with
    ``weight=count``. With ``loss_fn`` it is ``update(preds, target, weight=None)`` and the values are
    ``loss_fn(preds, target)``, which must not reduce (e.g. ``reduction="none"``). States are float64
    sums, so the result does not depend on how samples were split over ranks. ``nan`` when nothing counted.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    total: Tensor
    weight: Tensor

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loss_fn = loss_fn
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, *args: Tensor, weight: Tensor | float | None = None) -> None:
        if self.loss_fn is not None:
            if len(args) != 2:
                raise MetricError(f"MeanLoss(loss_fn=...) updates with (preds, target), got {len(args)} arguments")
            values = self.loss_fn(*args)
        else:
            if len(args) != 1:
                raise MetricError(
                    f"MeanLoss() updates with (values, weight=None), got {len(args)} positional arguments: "
                    "pass loss_fn= to update with (preds, target)"
                )
            values = args[0]
        values = torch.as_tensor(values).detach().to(torch.float64)
        w = torch.ones_like(values) if weight is None else torch.as_tensor(weight, dtype=torch.float64)
        try:
            w = torch.broadcast_to(w.to(values.device), values.shape)
        except RuntimeError:
            raise MetricError(
                f"MeanLoss weight of shape {tuple(w.shape)} does not broadcast to the losses {tuple(values.shape)}: "
                "give one weight per loss element, or a scalar count for a scalar mean loss"
            ) from None
        self.total += (values * w).sum()
        self.weight += w.sum()

    def compute(self) -> Tensor:
        return self.total / self.weight if self.weight > 0 else torch.tensor(math.nan, dtype=torch.float64)


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


# --------------------------------------------------------------------------- state classification

_SUM, _MEAN, _SLOT, _CAT, _FALLBACK = "sum", "mean", "slot", "cat", "fallback"
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8
_META = 3 + _MAX_DIMS - 1  # numel, dtype code, ndim, trailing dims


def _kind(default: Any, reduce_fn: Any) -> str:
    if isinstance(default, Tensor):
        if reduce_fn is dim_zero_sum:
            return _SUM
        if reduce_fn is dim_zero_mean:
            return _MEAN
        if reduce_fn is dim_zero_cat:
            return _CAT
        return _SLOT  # max, min, None (stack) and custom callables: every rank's value is exchanged
    if reduce_fn is dim_zero_cat:
        return _CAT
    return _FALLBACK  # list states with another reduction: left to torchmetrics' own sync


def _leaves(metric: Metric | MetricCollection) -> list[Metric]:
    if isinstance(metric, MetricCollection):
        return list(metric.values(copy_state=False))
    return [metric]


def _is_fused(leaf: Metric) -> bool:
    return all(_kind(leaf._defaults[a], leaf._reductions[a]) != _FALLBACK for a in leaf._defaults)


@dataclass
class _Entry:
    leaf: Metric
    attr: str
    kind: str
    value: Any


# --------------------------------------------------------------------------- the wrapper


class MeshMetric:
    """A torchmetrics ``Metric`` or ``MetricCollection`` that syncs over ``topology.metric_dims`` only.

    ``update(*args, valid=mask, **kwargs)`` drops the rows where ``mask`` is False (zero-weight padding
    from exact evaluation) from every batched argument before the metric's own ``update``; a batch with
    no valid row is skipped. ``compute()`` reduces every state over the batch + split dims — never over
    replica dims — in one fused all-reduce (a second all-gather only for concatenated states such as
    AUROC's), on the last pipeline stage; other stages receive the result by a broadcast along the stage
    dim (``stage_result="broadcast"``) or get ``None`` (``"none"``).

    ``split``: across ``split`` dims ranks hold parts of the same samples. ``"parts"`` (default) lets
    every split rank update with its part, and the parts' sums add up (per-cell MSE over a field, a
    per-token loss over a sequence split in chunks). ``"leader"`` updates only on split coordinate 0, for
    per-sample metrics whose inputs every split rank holds in full (logits after the model's reduction).

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
        split: Literal["parts", "leader"] = "parts",
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
        topo = _resolve(topology)
        if split not in ("parts", "leader"):
            raise MetricError(f"split must be 'parts' or 'leader', got {split!r}")
        if stage_result not in ("broadcast", "none"):
            raise MetricError(f"stage_result must be 'broadcast' or 'none', got {stage_result!r}")
        self.metric = metric
        self.topology = topo
        self.dims = _metric_dims(topo, dims)
        self.split = split
        self.replica_check = replica_check
        self.replica_rtol = float(replica_rtol)
        self.stage_result = stage_result
        self.select = select
        self.name = name or type(metric).__name__
        self.last_collectives = 0
        self.group = topo.group(self.dims) if topo.size(self.dims) > 1 else None
        metric.to(topo.device)
        for leaf in _leaves(metric):
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
        fallback = self.group is not None and not _is_fused(leaf)
        # torchmetrics must not sync by itself (it would use the world group), except for the states it
        # alone knows how to merge, which it then syncs over the right group.
        leaf.sync_on_compute = fallback
        leaf._to_sync = fallback
        leaf.process_group = self.group if fallback else None

    # ---- the torchmetrics interface
    def update(self, *args: Any, valid: Tensor | None = None, **kwargs: Any) -> None:
        """Update with the valid rows only; a no-op off the last stage and, with ``split="leader"``, off leaders."""
        args, kwargs, kept = filter_rows(valid, *args, **kwargs)
        topo = self.topology
        if not topo.is_last_stage or kept == 0:
            return
        if self.split == "leader" and topo.split_dims and topo.coordinate(topo.split_dims) != 0:
            return
        self.metric.update(*args, **kwargs)

    def compute(self) -> Any:
        """The metric over every valid row of the group (same value on every rank of the group)."""
        return compute_all([self])[0]

    def reset(self) -> None:
        self.metric.reset()

    def __repr__(self) -> str:
        return f"MeshMetric({self.name}, dims={self.dims}, split={self.split!r})"


def attach(metric: Metric | MetricCollection, topology: Topology | None = None, **options: Any) -> MeshMetric:
    """Attach ``metric`` to ``topology`` (default: the current one); ``options`` as for :class:`MeshMetric`."""
    return MeshMetric(metric, topology, **options)


def _resolve(topology: Topology | None) -> Topology:
    if topology is not None:
        if not isinstance(topology, Topology):
            raise MetricError(f"topology must be a meshwise.Topology, got {type(topology).__name__}")
        return topology
    import meshwise

    topo = meshwise.current()
    if topo is None:
        raise MetricError("no topology: call meshwise.init(...) first or pass topology=")
    return topo


def _metric_dims(topo: Topology, dims: Dims | None) -> tuple[str, ...]:
    if dims is None:
        return topo.metric_dims
    try:
        names = topo.layout.normalize(dims)
    except TopologyError as exc:
        raise MetricError(f"metric dims {dims!r} are not part of the topology {topo.dims}: {exc}") from None
    wrong = [d for d in names if topo.roles[d] not in ("batch", "split")]
    if wrong:
        raise MetricError(
            f"metric dims {names} include {', '.join(f'{d} ({topo.roles[d]})' for d in wrong)}: a metric sums only "
            f"over batch and split dims (replica ranks hold the same samples, counts would be multiplied by their "
            f"size); use dims from {topo.metric_dims}"
        )
    return names


# --------------------------------------------------------------------------- the fused sync


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
            raise MetricError(f"compute_all() takes MeshMetric objects, got {type(m).__name__}: wrap it with attach()")
        if m.topology is not topo or m.dims != dims:
            raise MetricError(
                f"compute_all() needs metrics of one topology and dims; {m.name} syncs over {m.dims}, "
                f"{metrics[0].name} over {dims}: compute them separately"
            )
    names = ", ".join(m.name for m in metrics)
    count = 0
    results: list[Any] = [None] * len(metrics)
    if topo.is_last_stage:
        leaves = [leaf for m in metrics for leaf in _leaves(m.metric)]
        for leaf in leaves:
            leaf._computed = None  # a cached value would skip the states set below
        group = metrics[0].group
        if group is not None:
            entries = [
                _Entry(leaf, attr, _kind(leaf._defaults[attr], leaf._reductions[attr]), getattr(leaf, attr))
                for leaf in leaves
                if _is_fused(leaf)
                for attr in leaf._defaults
            ]
            merged: list[Any] = []
            if entries:
                try:
                    merged, count = _fused_sync(topo, dims, group, entries)
                except (CollectiveTimeoutError, dist.DistError) as exc:
                    raise _failure(topo, dims, f"computing metrics [{names}]", exc) from exc
            by_leaf: dict[int, dict[str, Any]] = {}
            for entry, value in zip(entries, merged):
                by_leaf.setdefault(id(entry.leaf), {})[entry.attr] = value
            for leaf in leaves:
                if id(leaf) in by_leaf:
                    _set_synced(leaf, by_leaf[id(leaf)])
            count += sum(1 for leaf in leaves if not _is_fused(leaf))  # torchmetrics' own sync: counted once
        try:
            with warnings.catch_warnings():
                # ranks without a valid row never called update(); their synced states are the global ones
                warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
                for i, m in enumerate(metrics):
                    if group is not None and not all(_is_fused(leaf) for leaf in _leaves(m.metric)):
                        with guarded(topo, dims, f"torchmetrics sync of {m.name}"):
                            results[i] = m.metric.compute()
                    else:
                        results[i] = m.metric.compute()
        except (CollectiveTimeoutError, dist.DistError) as exc:  # a metric's own errors pass unchanged
            raise _failure(topo, dims, f"computing metrics [{names}]", exc) from exc
        finally:
            for leaf in leaves:
                if leaf._is_synced:
                    leaf.unsync()  # back to the local states, so updates keep accumulating
        count += _replica_check(metrics, results)
    stage = topo.stage_dims
    if stage and topo.size(stage) > 1:
        if metrics[0].stage_result == "broadcast":
            payload = [_to_cpu(results) if topo.is_last_stage else None]
            try:
                with guarded(topo, stage, "metric result broadcast"):
                    dist.broadcast_object_list(payload, group=topo.group(stage), group_src=topo.size(stage) - 1)
            except (CollectiveTimeoutError, dist.DistError) as exc:
                raise _failure(topo, stage, f"sending metrics [{names}] from the last stage", exc) from exc
            results = payload[0]
            count += 1
    for m in metrics:
        m.last_collectives = count
    return results


def _failure(topo: Topology, dims: tuple[str, ...], what: str, exc: BaseException) -> MetricSyncTimeout:
    """A failed metric collective as an error naming the dims, their roles and the group's ranks."""
    if isinstance(exc, CollectiveTimeoutError):  # debug.guarded already named the missing ranks
        return MetricSyncTimeout(f"{what}: {exc}")
    where = ", ".join(f"{d} ({topo.roles[d]})" for d in dims)
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return MetricSyncTimeout(
        f"{topo.label()}: {what} over {where}, group of ranks {topo.group_ranks(dims)}, failed within "
        f"{topo.timeout.total_seconds():.0f}s ({type(exc).__name__}: {first}). Every rank of the group must call "
        "compute() on the same metrics in the same order: look for a rank that skipped it or stopped early"
    )


def _set_synced(leaf: Metric, states: dict[str, Any]) -> None:
    """What ``Metric.sync`` does, with states reduced by meshwise: cache the local ones, install the global ones."""
    cache = leaf._copy_state_dict()
    for attr, value in states.items():
        setattr(leaf, attr, value)
    leaf._cache = cache
    leaf._is_synced = True


def _local_cat(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value if value.numel() or value.ndim > 1 else None
    if not value:
        return None
    return dim_zero_cat(value)


def _code(dtype: torch.dtype) -> int:
    try:
        return _DTYPES.index(dtype) + 1
    except ValueError:
        raise MetricError(
            f"metric state dtype {dtype} cannot be synced by meshwise; use a real or integer state"
        ) from None


def _fused_sync(
    topo: Topology, dims: tuple[str, ...], group: dist.ProcessGroup, entries: list[_Entry]
) -> tuple[list[Any], int]:
    """Reduce every entry's state over ``group``: one all-reduce, plus one all-gather if a state concatenates.

    Sum and mean states are packed into one flat buffer that is summed. States whose reduction needs every
    rank's value (max, min, stack, custom) and the sizes of the concatenated states sit in a per-rank slot
    of the same buffer (zeros elsewhere, so the sum is a gather). The concatenated states themselves are
    padded to the longest rank's length and all-gathered in one flat buffer.
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    device = topo.device
    reduced = [e for e in entries if e.kind in (_SUM, _MEAN)]
    slots = [e for e in entries if e.kind == _SLOT]
    cats = [e for e in entries if e.kind == _CAT]
    local_cats = [_local_cat(e.value) for e in cats]
    floating = any(e.value.is_floating_point() or e.kind == _MEAN for e in reduced + slots)
    dtype = torch.float64 if floating else torch.int64
    reduced_n = sum(e.value.numel() for e in reduced)
    slot_n = sum(e.value.numel() for e in slots) + _META * len(cats)
    buf = torch.zeros(reduced_n + size * slot_n, dtype=dtype, device=device)
    offset = 0
    for e in reduced:
        n = e.value.numel()
        buf[offset : offset + n] = e.value.detach().reshape(-1).to(device=device, dtype=dtype)
        offset += n
    offset = reduced_n + me * slot_n
    for e in slots:
        n = e.value.numel()
        buf[offset : offset + n] = e.value.detach().reshape(-1).to(device=device, dtype=dtype)
        offset += n
    for local in local_cats:
        meta = [0] * _META
        if local is not None:
            if local.ndim > _MAX_DIMS:
                raise MetricError(f"a concatenated metric state has {local.ndim} dims; meshwise syncs at most 8")
            meta[:3] = [local.numel(), _code(local.dtype), local.ndim]
            meta[3 : 3 + local.ndim - 1] = list(local.shape[1:])
        buf[offset : offset + _META] = torch.tensor(meta, dtype=dtype)
        offset += _META
    with guarded(topo, dims, "metric all_reduce", tensor=buf):
        dist.all_reduce(buf, group=group)
    count = 1

    out: list[Any] = [None] * len(entries)
    index = {id(e): i for i, e in enumerate(entries)}
    offset = 0
    for e in reduced:
        n = e.value.numel()
        value = buf[offset : offset + n].view(e.value.shape)
        offset += n
        if e.kind == _MEAN:
            value = value / size
            value = value.to(e.value.dtype) if e.value.is_floating_point() else value
        else:
            value = value.to(e.value.dtype)
        out[index[id(e)]] = value.to(e.value.device)
    per_rank = buf[reduced_n:].view(size, slot_n) if slot_n else buf.new_zeros(size, 0)
    offset = 0
    for e in slots:
        n = e.value.numel()
        stacked = per_rank[:, offset : offset + n].reshape(size, *e.value.shape).to(e.value.dtype)
        offset += n
        fn = e.leaf._reductions[e.attr]
        out[index[id(e)]] = (stacked if fn is None else fn(stacked)).to(e.value.device)
    if cats:
        meta = per_rank[:, offset:].reshape(size, len(cats), _META).to(torch.int64)
        values, gathered = _gather_cats(topo, dims, group, cats, local_cats, meta, device)
        count += gathered
        for e, v in zip(cats, values):
            out[index[id(e)]] = v
    return out, count


def _gather_cats(
    topo: Topology,
    dims: tuple[str, ...],
    group: dist.ProcessGroup,
    cats: list[_Entry],
    local_cats: list[Tensor | None],
    meta: Tensor,
    device: torch.device,
) -> tuple[list[Any], int]:
    size = meta.shape[0]
    numels = meta[:, :, 0]  # [rank, state]
    totals = numels.sum(dim=1)
    longest = int(totals.max())
    if longest == 0:
        return [[] for _ in cats], 0  # nothing anywhere: the states stay empty, as torchmetrics leaves them
    kinds: list[tuple[torch.dtype, tuple[int, ...]]] = []
    for s in range(len(cats)):
        known = [r for r in range(size) if int(meta[r, s, 1]) > 0]
        if not known:
            kinds.append((torch.float32, ()))
            continue
        r = known[0]
        ndim = int(meta[r, s, 2])
        kinds.append((_DTYPES[int(meta[r, s, 1]) - 1], tuple(int(d) for d in meta[r, s, 3 : 3 + ndim - 1])))
    floating = any(dt.is_floating_point for dt, _ in kinds)
    dtype = torch.float64 if floating else torch.int64
    mine = torch.zeros(longest, dtype=dtype, device=device)
    offset = 0
    for local in local_cats:
        if local is not None:
            mine[offset : offset + local.numel()] = local.detach().reshape(-1).to(device=device, dtype=dtype)
            offset += local.numel()
    received = [torch.empty_like(mine) for _ in range(size)]
    with guarded(topo, dims, "metric all_gather", tensor=mine):
        dist.all_gather(received, mine, group=group)
    pieces: list[list[Tensor]] = [[] for _ in cats]
    for r in range(size):
        offset = 0
        for s in range(len(cats)):
            n = int(numels[r, s])
            pieces[s].append(received[r][offset : offset + n])
            offset += n
    values = []
    for s in range(len(cats)):
        dt, trailing = kinds[s]
        flat = torch.cat(pieces[s])
        if not flat.numel():
            values.append([])
            continue
        target_device = local_cats[s].device if local_cats[s] is not None else device
        values.append(flat.view(-1, *trailing).to(dtype=dt, device=target_device))
    return values, 1


# --------------------------------------------------------------------------- replica check and helpers


def _flat_values(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value.detach().reshape(-1).to(torch.float64).cpu()]
    if isinstance(value, Mapping):
        return [t for k in sorted(value, key=str) for t in _flat_values(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_values(v)]
    if isinstance(value, (int, float, bool)):
        return [torch.tensor([float(value)], dtype=torch.float64)]
    return []


def _replica_check(metrics: list[MeshMetric], results: list[Any]) -> int:
    topo = metrics[0].topology
    dims = topo.replica_dims
    on = topo.debug
    checking = [(m, r) for m, r in zip(metrics, results) if (on if m.replica_check is None else m.replica_check)]
    if not checking or not dims or topo.size(dims) == 1:
        return 0
    parts = [(m, _flat_values(r)) for m, r in checking]
    lengths = [sum(t.numel() for t in p) for _, p in parts]
    vector = torch.cat([t for _, p in parts for t in p] or [torch.zeros(0, dtype=torch.float64)])
    vector = vector.to(topo.device)
    group = topo.group(dims)
    size = topo.size(dims)
    received = [torch.empty_like(vector) for _ in range(size)]
    try:
        with guarded(topo, dims, "metric replica check", tensor=vector):
            dist.all_gather(received, vector, group=group)
    except (CollectiveTimeoutError, dist.DistError) as exc:
        raise _failure(topo, dims, "checking metrics across replica dims", exc) from exc
    table = torch.stack(received).cpu()  # [replica rank, value]
    ranks = topo.group_ranks(dims)
    start = 0
    for (m, _), n in zip(parts, lengths):
        block = table[:, start : start + n]
        start += n
        ref = block[0]
        scale = m.replica_rtol * ref.abs()
        diff = (block - ref).abs()
        same = (diff <= scale) | (torch.isnan(block) & torch.isnan(ref))
        if bool(same.all()):
            continue
        col = int((~same).any(dim=0).nonzero()[0])
        bad = [ranks[r] for r in range(size) if not bool(same[r, col])]
        values = ", ".join(f"rank {ranks[r]}: {float(block[r, col])!r}" for r in range(size))
        where = ", ".join(f"{d} ({topo.roles[d]})" for d in dims)
        raise MetricError(
            f"{topo.label()}: metric {m.name} differs across the replica dims {where} (group of ranks {ranks}); "
            f"ranks {bad} disagree with rank {ranks[0]} at value {col} ({values}). Replica ranks must hold the "
            "same samples and the same model outputs: look for diverged tensor-parallel replicas or per-rank data"
        )
    return 1


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
