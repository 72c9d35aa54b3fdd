"""The replica agreement check: ranks that must hold the same samples compare a fingerprint of their batch.

Across a ``replica`` dim (tp) ranks must get identical batches; across a ``split`` dim (cp, domain) they get
different parts of the same samples, so only the samples' identity is compared (the ``index`` field of a
``mesh_dataloader`` batch; a batch without one is compared whole). A sampler over the whole world (ignite's
``idist.auto_dataloader``, a ``DistributedSampler`` with ``num_replicas`` = world size) gives every rank its
own samples: replicas then drift apart silently. One small all-gather over the world finds it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshwise.debug.watchdog import guarded, rank_label
from meshwise.errors import DataError
from meshwise.topology import Topology

__all__ = ["batch_fingerprint", "check_replicas", "needs_check"]

_CAUSE = (
    "Likely cause: a sampler or split over the whole world (ignite's idist.auto_dataloader, a DistributedSampler "
    "with num_replicas = world size, or datasets' split_dataset_by_node(ds, rank=dist.get_rank(), "
    "world_size=dist.get_world_size())) that gives every rank its own samples. Use meshwise.data.mesh_dataloader, "
    "or split over the data ranks only: DistributedSampler(dataset, num_replicas=topo.data_size, "
    "rank=topo.data_rank), split_dataset_by_node(ds, rank=topo.data_rank, world_size=topo.data_size)"
)


def needs_check(topo: Topology) -> bool:
    """Whether the mesh has a replica or split dim of size > 1 (else there is nothing to compare)."""
    return any(topo.sizes[d] > 1 for d in (*topo.replica_dims, *topo.split_dims))


def _update(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if hasattr(t, "to_local"):  # a DTensor: its local part is what this rank holds
            t = t.to_local()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            digest.update(t.reshape(-1).cpu().contiguous().view(torch.uint8).numpy().data)
    elif isinstance(value, np.ndarray):
        digest.update(f"{value.dtype}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).view(np.uint8).data)
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(str(key).encode())
            _update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _update(digest, item)
    else:
        digest.update(repr(value).encode())


def _rows(batch: Any) -> int:
    """The length of the first tensor's axis 0 (the sample axis of any collated batch), else -1."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    for v in values:
        if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim:
            return int(v.shape[0])
        if isinstance(v, (Mapping, list, tuple)):
            n = _rows(v)
            if n >= 0:
                return n
    return -1


def batch_fingerprint(batch: Any) -> tuple[int, int]:
    """``(content, identity)`` of a batch (dict, tuple, list or tensor) as two int64 hashes.

    ``content`` covers every tensor's dtype, shape and bytes; ``identity`` the ``index`` field of a dict
    batch (the samples' ids in a ``mesh_dataloader`` batch) and its row count, else the content: a loader
    that is not meshwise's gives every split rank whole samples, which the model splits.
    """
    content = hashlib.blake2b(digest_size=8)
    _update(content, batch)
    index = batch.get("index") if isinstance(batch, Mapping) else None
    if index is None:
        identity = content
    else:
        identity = hashlib.blake2b(digest_size=8)
        _update(identity, (index, _rows(batch)))
    return tuple(int.from_bytes(d.digest(), "little", signed=True) for d in (content, identity))  # type: ignore[return-value]


def check_replicas(topo: Topology, batch: Any, step: int | None = None) -> None:
    """Compare ``batch``'s fingerprint across every replica dim (content) and split dim (sample identity).

    Every rank of the world must call it at the same step (one all-gather of 2 int64 per rank); a
    difference raises :class:`DataError` on every rank, naming the dim, its ranks and the likely cause.
    """
    if topo.world_size == 1 or not needs_check(topo):
        return
    mine = torch.tensor(batch_fingerprint(batch), dtype=torch.int64, device=topo.device)
    table = [torch.empty_like(mine) for _ in range(topo.world_size)]
    with guarded(topo, topo.dims, "replica agreement check", tensor=mine, step=step):
        dist.all_gather(table, mine)
    prints = [t.tolist() for t in table]
    for kind, column, dims in (("batches", 0, topo.replica_dims), ("samples", 1, topo.split_dims)):
        for dim in dims:
            if topo.sizes[dim] > 1:
                _check_dim(topo, dim, kind, [p[column] for p in prints], step)


def _check_dim(topo: Topology, dim: str, kind: str, prints: list[int], step: int | None) -> None:
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(topo.world_size):
        coords = topo.layout.coordinates(r)
        groups.setdefault(tuple(c for d, c in coords.items() if d != dim), []).append(r)
    for ranks in groups.values():
        if len({prints[r] for r in ranks}) == 1:
            continue
        classes: dict[int, list[int]] = {}
        for r in ranks:
            classes.setdefault(prints[r], []).append(r)
        sets = "; ".join(", ".join(rank_label(topo.layout, r) for r in rs) for rs in classes.values())
        what = (
            "different batches"
            if kind == "batches"
            else "different samples (their 'index' fields differ or, in batches without one, their contents; a "
            "split dim shares samples, not parts: a loader that delivers parts itself must name the samples' ids "
            "in an 'index' field)"
        )
        at = f"at step {step}" if step is not None else "in the same step"
        raise DataError(
            f"{topo.label()}: {at} the {dim} ({topo.roles[dim]}) ranks {ranks} hold {what}; ranks that agree: "
            f"{sets}. Ranks across a {topo.roles[dim]} dim must get the same samples, or the model's replicas "
            f"drift apart silently. {_CAUSE}"
        )
