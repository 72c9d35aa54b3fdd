"""Autograd-aware halo exchange: pad a tile of a field sharded over a ``split`` dim with its neighbours' edge cells.

Used for domain-parallel convolution, because DTensor's sharded convolution is wrong on torch 2.13
(docs/torch.md, "Sharded convolution").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshwise.errors import ParallelError
from meshwise.layout import Dims
from meshwise.topology import Topology

__all__ = ["halo_exchange", "pad_loaded_halo"]

# (group ranks, ndim, axis, shape without the axis, halo) -> checked. Tile lengths are compared once per key.
_CHECKED: set[tuple] = set()


def _neighbours(topology: Topology, dim: str) -> tuple[int | None, int | None]:
    """Global ranks of the previous and next rank along ``dim`` (``None`` at the global border)."""
    ranks = topology.group_ranks(dim)
    i = topology.coordinate(dim)
    return (ranks[i - 1] if i > 0 else None), (ranks[i + 1] if i + 1 < len(ranks) else None)


def _exchange(
    send_prev: torch.Tensor,
    send_next: torch.Tensor,
    prev: int | None,
    next_: int | None,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``send_prev`` to ``prev`` and ``send_next`` to ``next_``; return what they sent (zeros at a border)."""
    from_prev = torch.zeros_like(send_next)
    from_next = torch.zeros_like(send_prev)
    ops = []
    if prev is not None:
        ops += [dist.P2POp(dist.isend, send_prev, prev, group), dist.P2POp(dist.irecv, from_prev, prev, group)]
    if next_ is not None:
        ops += [dist.P2POp(dist.isend, send_next, next_, group), dist.P2POp(dist.irecv, from_next, next_, group)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return from_prev, from_next


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, prev, next_, group, axis, halo):  # type: ignore[override]
        ctx.prev, ctx.next, ctx.group, ctx.axis, ctx.halo = prev, next_, group, axis, halo
        n = x.shape[axis]
        first = x.narrow(axis, 0, halo).contiguous()
        last = x.narrow(axis, n - halo, halo).contiguous()
        # My first cells become the previous rank's right halo, my last cells the next rank's left halo.
        left, right = _exchange(first, last, prev, next_, group)
        return torch.cat([left, x, right], dim=axis)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        axis, halo = ctx.axis, ctx.halo
        n = grad.shape[axis] - 2 * halo
        # The gradient of a halo cell belongs to the neighbour that owns the cell: send it back and add it there.
        to_prev = grad.narrow(axis, 0, halo).contiguous()
        to_next = grad.narrow(axis, halo + n, halo).contiguous()
        from_prev, from_next = _exchange(to_prev, to_next, ctx.prev, ctx.next, ctx.group)
        out = grad.narrow(axis, halo, n).clone()
        out.narrow(axis, 0, halo).add_(from_prev)
        out.narrow(axis, n - halo, halo).add_(from_next)
        return out, None, None, None, None, None


def _check(x: torch.Tensor, topology: Topology, dim: str, axis: int, halo: int) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise ParallelError(f"halo_exchange needs a torch.Tensor tile, got {type(x).__name__}")
    if dim not in topology.dims:
        raise ParallelError(
            f"halo_exchange: the mesh has no dim {dim!r} (its dims: {topology.layout.dims_text()}): name a split dim"
        )
    if topology.roles[dim] != "split":
        raise ParallelError(
            f"halo_exchange: mesh dim {dim!r} has role {topology.roles[dim]!r}, not 'split'; the field must be "
            f"sharded over a split dim ({list(topology.split_dims) or 'none in this mesh'}): pass dim=<split dim> or "
            f"declare roles={{{dim!r}: 'split'}}"
        )
    if isinstance(halo, bool) or not isinstance(halo, int) or halo < 0:
        raise ParallelError(f"halo_exchange: halo must be an int >= 0, got {halo!r}")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ParallelError(f"halo_exchange: axis {axis!r} is out of range for a tile of shape {list(x.shape)}")
    return axis % x.ndim, halo


def _check_lengths(x: torch.Tensor, topology: Topology, dim: str, axis: int, halo: int) -> None:
    """Every rank along ``dim`` raises the same error if any tile is shorter than the halo (no rank hangs)."""
    ranks = tuple(topology.group_ranks(dim))
    key = (ranks, x.ndim, axis, tuple(s for i, s in enumerate(x.shape) if i != axis), halo)
    if key in _CHECKED:
        return
    n = x.shape[axis]
    if len(ranks) > 1:
        mine = torch.tensor([n], dtype=torch.int64, device=x.device)
        lengths = [torch.zeros_like(mine) for _ in ranks]
        dist.all_gather(lengths, mine, group=topology.group(dim))
        lengths = [int(t) for t in lengths]
    else:
        lengths = [n]
    if min(lengths) < halo:
        raise ParallelError(
            f"halo_exchange: halo {halo} is larger than a tile along axis {axis} (tile lengths over {dim!r}: "
            f"{lengths}); every tile must hold at least `halo` cells: use a smaller halo (kernel), a larger "
            f"field, or fewer {dim!r} ranks"
        )
    _CHECKED.add(key)


def _per_dim(dim: Dims, axis: int | Sequence[int], halo: int | Sequence[int]) -> list[tuple[str, int, int]]:
    """``(dim, axis, halo)`` triples: one dim, or one entry per dim when several split dims shard several axes."""
    if isinstance(dim, str):
        if not isinstance(axis, int) or not isinstance(halo, int):
            raise ParallelError(
                f"halo_exchange: one dim {dim!r} takes one axis and one halo (ints), got axis={axis!r}, halo={halo!r}"
            )
        return [(dim, axis, halo)]
    dims = list(dim)
    axes = [axis] * len(dims) if isinstance(axis, int) else list(axis)
    halos = [halo] * len(dims) if isinstance(halo, int) else list(halo)
    if not dims or len(axes) != len(dims) or len(halos) != len(dims):
        raise ParallelError(
            f"halo_exchange: dims {dims} need one axis and one halo each (or one halo for all), got axis={axis!r}, "
            f"halo={halo!r}: e.g. dim=('x', 'y'), axis=(-2, -1), halo=1"
        )
    if len(set(dims)) != len(dims):
        raise ParallelError(f"halo_exchange: dims {dims} repeat a dim: give each split dim once")
    return list(zip(dims, axes, halos))


def halo_exchange(
    x: torch.Tensor,
    topology: Topology,
    dim: Dims = "domain",
    axis: int | Sequence[int] = -1,
    halo: int | Sequence[int] = 1,
) -> torch.Tensor:
    """Pad the local tile ``x`` along ``axis`` with ``halo`` cells from each neighbour along the split dim ``dim``.

    The field is sharded over ``dim`` along ``axis`` in coordinate order (rank 0 holds the first tile). The
    result has ``x.shape[axis] + 2 * halo`` cells on ``axis``: the previous rank's last ``halo`` cells, ``x``,
    the next rank's first ``halo`` cells. At the global border the halo is zeros, so a convolution with no
    padding along ``axis`` on the result equals, tile for tile, a one-process convolution of the full field
    with ``padding=halo`` and zeros padding. Autograd-aware: backward sends the halo gradients back to their
    owners and adds them to their edge cells. Every rank along ``dim`` must call it with the same ``halo``,
    ``axis`` and the other axes' sizes; tiles may differ in length (uneven splits) but each needs ``>= halo``
    cells. Communication: point-to-point send/recv with the two neighbours on ``topology.group(dim)``.

    Several split dims at once (a grid of tiles): ``dim=("x", "y"), axis=(-2, -1), halo=1`` (or one halo per
    dim). The exchanges run one dim after the other, each on the tile already padded by the previous ones, so
    the corner cells (diagonal neighbours) arrive too, in two hops.
    """
    triples = _per_dim(dim, axis, halo)
    checked = [(d, *_check(x, topology, d, a, h)) for d, a, h in triples]
    if len({a for _, a, _ in checked}) != len(checked):
        raise ParallelError(f"halo_exchange: axes {[a for _, a, _ in triples]} repeat an axis: one axis per dim")
    for d, a, h in checked:
        x = _exchange_one(x, topology, d, a, h)
    return x


def _exchange_one(x: torch.Tensor, topology: Topology, dim: str, axis: int, halo: int) -> torch.Tensor:
    if halo == 0:
        return x
    _check_lengths(x, topology, dim, axis, halo)
    if topology.size(dim) == 1:
        pad = [0, 0] * (x.ndim - 1 - axis) + [halo, halo]
        return torch.nn.functional.pad(x, pad)
    prev, next_ = _neighbours(topology, dim)
    return _HaloExchange.apply(x, prev, next_, topology.group(dim), axis, halo)


def pad_loaded_halo(
    x: torch.Tensor,
    topology: Topology,
    dim: Dims = "domain",
    axis: int | Sequence[int] = -1,
    halo: int | Sequence[int] = 1,
) -> torch.Tensor:
    """Complete a tile that the loader read with ``halo`` neighbour cells at its interior edges (``Shard(axis, halo)``).

    The loader reads no cells beyond the global border, so the first and last tiles along ``dim`` get ``halo``
    zeros there instead; the result then equals ``halo_exchange`` of the interior tile, with no communication.
    Several dims and axes as for :func:`halo_exchange`.
    """
    for d, a, h in _per_dim(dim, axis, halo):
        a, h = _check(x, topology, d, a, h)
        i, k = topology.coordinate(d), topology.size(d)
        left, right = (h if i == 0 else 0), (h if i == k - 1 else 0)
        if left or right:
            x = torch.nn.functional.pad(x, [0, 0] * (x.ndim - 1 - a) + [left, right])
    return x
