"""What every metric road shares without torchmetrics: the check that replica ranks computed the same values, and
a failed metric collective named by its dims, roles and ranks (ignite's metrics use these too, so a script without
torchmetrics does not import it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from meshwise.debug import guarded
from meshwise.errors import CollectiveTimeoutError, MetricError, MetricSyncTimeout
from meshwise.topology import Topology

__all__ = ["replica_check", "sync_failure"]


def sync_failure(topo: Topology, dims: tuple[str, ...], what: str, exc: BaseException) -> MetricSyncTimeout:
    """A failed metric collective as an error naming the dims, their roles and the group's ranks."""
    if isinstance(exc, CollectiveTimeoutError):  # guarded already named the missing ranks
        return MetricSyncTimeout(f"{what}: {exc}")
    where = ", ".join(f"{d} ({topo.roles[d]})" for d in dims)
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return MetricSyncTimeout(
        f"{topo.label()}: {what} over {where}, group of ranks {topo.group_ranks(dims)}, failed within "
        f"{topo.timeout.total_seconds():.0f}s ({type(exc).__name__}: {first}). Every rank of the group must call "
        "compute() on the same metrics in the same order: look for a rank that skipped it or stopped early"
    )


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


def replica_check(topo: Topology, checks: Sequence[tuple[str, float, Any]]) -> int:
    """Verify that ranks along the replica dims computed equal values; the number of collectives made (0 or 1).

    ``checks`` holds ``(name, rtol, value)`` for each metric to check. One all-gather over the replica group
    compares every value at once; a difference beyond ``rtol`` (NaN equals NaN) raises :class:`MetricError`
    naming the metric, the dims and each rank's value.
    """
    dims = topo.replica_dims
    if not checks or not dims or topo.size(dims) == 1:
        return 0
    parts = [(name, rtol, _flat_values(value)) for name, rtol, value in checks]
    lengths = [sum(t.numel() for t in p) for _, _, p in parts]
    vector = torch.cat([t for _, _, p in parts for t in p] or [torch.zeros(0, dtype=torch.float64)])
    vector = vector.to(topo.device)
    group = topo.group(dims)
    size = topo.size(dims)
    received = [torch.empty_like(vector) for _ in range(size)]
    try:
        with guarded(topo, dims, "metric replica check", tensor=vector):
            dist.all_gather(received, vector, group=group)
    except (CollectiveTimeoutError, dist.DistError) as exc:
        raise sync_failure(topo, dims, "checking metrics across replica dims", exc) from exc
    table = torch.stack(received).cpu()  # [replica rank, value]
    ranks = topo.group_ranks(dims)
    start = 0
    for (name, rtol, _), n in zip(parts, lengths):
        block = table[:, start : start + n]
        start += n
        ref = block[0]
        scale = rtol * ref.abs()
        diff = (block - ref).abs()
        same = (diff <= scale) | (torch.isnan(block) & torch.isnan(ref))
        if bool(same.all()):
            continue
        col = int((~same).any(dim=0).nonzero()[0])
        bad = [ranks[r] for r in range(size) if not bool(same[r, col])]
        values = ", ".join(f"rank {ranks[r]}: {float(block[r, col])!r}" for r in range(size))
        where = ", ".join(f"{d} ({topo.roles[d]})" for d in dims)
        raise MetricError(
            f"{topo.label()}: metric {name} differs across the replica dims {where} (group of ranks {ranks}); "
            f"ranks {bad} disagree with rank {ranks[0]} at value {col} ({values}). Replica ranks must hold the "
            "same samples and the same model outputs: look for diverged tensor-parallel replicas or per-rank data"
        )
    return 1
