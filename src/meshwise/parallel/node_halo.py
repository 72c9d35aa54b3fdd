"""Autograd-aware halo exchange for node features of a graph split over a ``split`` dim (the graph counterpart of
:func:`~meshwise.parallel.halo_exchange`): each rank's owned rows, then its halo rows from their owners.

The plan is the part's (:func:`meshwise.data.node_parts`): which owned rows each other rank needs, and the halo
grouped by owner, so one exchange is one ``all_to_all_single`` over the split dim's group; backward sends each halo
row's gradient back to its owner, which adds it to the row it sent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshwise.errors import ParallelError
from meshwise.topology import Topology

__all__ = ["node_halo_exchange"]


class _NodeHalo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, sends: list, recvs: list, group: Any) -> torch.Tensor:
        ctx.index, ctx.sends, ctx.recvs, ctx.group, ctx.owned = index, sends, recvs, group, x.shape[0]
        received = x.new_empty((sum(recvs), *x.shape[1:]))
        dist.all_to_all_single(received, x.index_select(0, index).contiguous(), recvs, sends, group=group)
        return torch.cat([x, received])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        owned, halo = grad[: ctx.owned], grad[ctx.owned :].contiguous()
        back = grad.new_empty((sum(ctx.sends), *grad.shape[1:]))
        dist.all_to_all_single(back, halo, ctx.sends, ctx.recvs, group=ctx.group)
        return owned.index_add(0, ctx.index, back), None, None, None, None


def node_halo_exchange(
    x: torch.Tensor, part: Any, topology: Topology, dim: str = "domain", axis: int = 0
) -> torch.Tensor:
    """``x`` with its ``len(part.owned)`` owned rows along ``axis``, followed by the ``len(part.halo)`` halo rows
    from the ranks that own them: local row ``i`` is node ``part.nodes[i]``. ``part`` is this rank's
    :class:`meshwise.data.NodePart` (the data layer's; this layer reads its plan, not its type). Every rank of
    ``dim`` calls it with its own part of the same partition (``part.parts`` = the size of ``dim``, ``part.rank``
    = its coordinate)."""
    axis = axis % x.ndim
    if x.shape[axis] != len(part.owned):
        raise ParallelError(
            f"node_halo_exchange: x has {x.shape[axis]} rows along axis {axis}, the part owns {len(part.owned)} "
            "nodes: pass the owned rows only (the exchange appends the halo)"
        )
    size, coordinate = topology.size(dim), topology.coordinate(dim)
    if (part.parts, part.rank) != (size, coordinate):
        raise ParallelError(
            f"node_halo_exchange: the part is rank {part.rank} of {part.parts}, this rank is {coordinate} of {size} "
            f"along {dim!r}: build the parts with node_parts(..., parts=topology.size({dim!r})) and take "
            f"parts[topology.coordinate({dim!r})]"
        )
    if size == 1:
        return x
    moved = x.movedim(axis, 0)
    index = torch.from_numpy(part.send_index).to(x.device)
    out = _NodeHalo.apply(moved, index, list(part.send_counts), list(part.recv_counts), topology.group(dim))
    return out.movedim(0, axis)
