"""How metric states cross ranks: one fused all-reduce and one all-gather of concatenated states.

torchmetrics' own sync is turned off; the states of every metric are reduced here with as few collectives as
possible, then installed exactly as ``Metric.sync()`` does, so the metric's own ``compute()`` runs unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_mean, dim_zero_sum

from meshwise import compat
from meshwise.debug import guarded
from meshwise.errors import MetricError
from meshwise.rendezvous import WIRE_DTYPES
from meshwise.topology import Topology

__all__ = ["is_fused", "leaves", "sync_states", "to_cpu"]

# --------------------------------------------------------------------------- state classification

_SUM, _MEAN, _SLOT, _CAT, _FALLBACK = "sum", "mean", "slot", "cat", "fallback"
_MAX_DIMS = 8
_META = 3 + _MAX_DIMS - 1  # numel, dtype code, ndim, trailing dims


def _kind(default: Any, reduce_fn: Any) -> str:
    """How a state with this default and reduction crosses ranks."""
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


def leaves(metric: Metric | MetricCollection) -> list[Metric]:
    """The metrics that hold states: the members of a collection, or the metric itself."""
    if isinstance(metric, MetricCollection):
        return list(metric.values(copy_state=False))
    return [metric]


def is_fused(leaf: Metric) -> bool:
    """Whether every state of ``leaf`` can be reduced by :func:`sync_states` (else torchmetrics syncs it)."""
    defaults, reductions = compat.metric_defaults(leaf), compat.metric_reductions(leaf)
    return all(_kind(defaults[a], reductions[a]) != _FALLBACK for a in defaults)


@dataclass
class _Entry:
    leaf: Metric
    attr: str
    kind: str
    value: Any


# --------------------------------------------------------------------------- the fused sync


def sync_states(topo: Topology, dims: tuple[str, ...], group: dist.ProcessGroup, leaf_metrics: Sequence[Metric]) -> int:
    """Reduce the states of every fused leaf over ``group`` and install them as ``Metric.sync`` would.

    Returns the number of collectives made (0 when no leaf is fused, else 1, or 2 with a concatenated
    state). Leaves that are not fused are left to torchmetrics' own sync.
    """
    entries = [
        _Entry(leaf, attr, _kind(default, compat.metric_reductions(leaf)[attr]), getattr(leaf, attr))
        for leaf in leaf_metrics
        if is_fused(leaf)
        for attr, default in compat.metric_defaults(leaf).items()
    ]
    if not entries:
        return 0
    merged, count = _fused_sync(topo, dims, group, entries)
    by_leaf: dict[int, dict[str, Any]] = {}
    for entry, value in zip(entries, merged):
        by_leaf.setdefault(id(entry.leaf), {})[entry.attr] = value
    for leaf in leaf_metrics:
        if id(leaf) in by_leaf:
            _set_synced(leaf, by_leaf[id(leaf)])
    return count


def _set_synced(leaf: Metric, states: dict[str, Any]) -> None:
    """What ``Metric.sync`` does, with states reduced by meshwise: cache the local ones, install the global ones."""
    cache = compat.metric_state_copy(leaf)
    for attr, value in states.items():
        setattr(leaf, attr, value)
    compat.set_metric_cache(leaf, cache)
    compat.set_metric_synced(leaf, True)


def _local_cat(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value if value.numel() or value.ndim > 1 else None
    if not value:
        return None
    return dim_zero_cat(value)


def _code(dtype: torch.dtype) -> int:
    try:
        return WIRE_DTYPES.index(dtype) + 1
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
        fn = compat.metric_reductions(e.leaf)[e.attr]
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
        kinds.append((WIRE_DTYPES[int(meta[r, s, 1]) - 1], tuple(int(d) for d in meta[r, s, 3 : 3 + ndim - 1])))
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


def to_cpu(value: Any) -> Any:
    """Tensors in ``value`` (nested in mappings, lists, tuples) moved to the CPU, to send them as objects."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
