"""A rank's node-set part of a graph that :func:`~meshwise.data.reorder_nodes` wrote, built from its own edges only.

:func:`~meshwise.data.node_parts` reads the whole edge list on every rank and computes every part (the exchange
plan needs to know what each other part's halo holds). After ``reorder_nodes`` the parts are ranges of node ids and
``edges.npy`` is sorted by destination, so a rank can read only the in-edges of its own nodes (and, for a deeper
halo, of its inner halo nodes): one range of the file, a few binary searches. What to send each other rank it then
learns by asking: every rank sends each owner the ids of the halo nodes it needs (one all-to-all over the split
dim), so the plan is exact for any graph, symmetric or not. The result equals ``node_parts(edges, n, parts,
halo=halo)[rank]`` of the same files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from meshwise.data.graph import GRAPH_FILE, NodePart, check_halo, expand_runs, refuse_whole_graph
from meshwise.errors import DataError
from meshwise.topology import Topology

__all__ = ["read_node_part"]


def _bound(part: int, parts: int, num_nodes: int) -> int:
    """The first node id of ``part`` when parts are balanced ranges of ids (``partition_nodes`` without coords)."""
    return -(-part * num_nodes // parts)


def _in_edges(dst: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """File positions of the edges into ``nodes`` (increasing ids), in file order: ``dst`` is sorted."""
    starts = np.searchsorted(dst, nodes, "left")
    return expand_runs(starts, np.searchsorted(dst, nodes, "right") - starts)


def read_node_part(
    folder: str | os.PathLike[str], topology: Topology, dim: str = "domain", *, halo: int = 1, layers: int | None = None
) -> NodePart:
    """This rank's :class:`~meshwise.data.NodePart` of the graph in ``folder`` (written by ``reorder_nodes``) over
    split dim ``dim``, reading only the edges into its owned nodes and, for ``halo > 1``, into its inner halo nodes.

    Call it on every rank of the dim's group (one all-to-all of halo ids). Any split size works; the reorder's own
    part count keeps the parts' halos small. ``layers`` as for :func:`~meshwise.data.node_parts`."""
    root = Path(folder)
    try:
        meta = json.loads((root / GRAPH_FILE).read_text())
        num_nodes = int(meta["num_nodes"])
    except (OSError, ValueError, KeyError):
        raise DataError(
            f"{root} has no {GRAPH_FILE}: read_node_part reads a graph that reorder_nodes wrote (its edges sorted by "
            "destination); for any other graph use node_parts"
        ) from None
    check_halo(halo, layers)
    parts, rank = topology.size(dim), topology.coordinate(dim)
    if parts > num_nodes:
        raise DataError(f"cannot divide {num_nodes} node(s) over {parts} split rank(s): use at most {num_nodes}")
    edges = np.load(root / "edges.npy", mmap_mode="r")
    src, dst = edges[0], edges[1]
    lo, hi = _bound(rank, parts, num_nodes), _bound(rank + 1, parts, num_nodes)
    owned = np.arange(lo, hi, dtype=np.int64)
    a, b = int(np.searchsorted(dst, lo, "left")), int(np.searchsorted(dst, hi, "left"))
    inward_src, inward_dst = np.asarray(src[a:b], dtype=np.int64), np.asarray(dst[a:b], dtype=np.int64)
    if len(inward_dst) and (inward_dst[0] < lo or inward_dst[-1] >= hi or np.any(np.diff(inward_dst) < 0)):
        raise DataError(f"{root}/edges.npy is not sorted by destination: write the graph again with reorder_nodes")
    reach, inner, frontier, frontier_src = owned, owned, owned, inward_src
    for hop in range(halo):
        inner = reach
        sources = frontier_src if hop == 0 else np.asarray(src[_in_edges(dst, frontier)], dtype=np.int64)
        frontier = np.setdiff1d(np.unique(sources), reach)
        reach = np.union1d(reach, frontier)
    extra = np.setdiff1d(reach, owned)
    owner = extra * parts // num_nodes
    refuse_whole_graph(halo, rank, len(extra) + len(owned), num_nodes, parts)
    by_owner = np.lexsort((extra, owner))
    extra, owner = extra[by_owner], owner[by_owner]
    nodes = np.concatenate([owned, extra])
    by_id = np.argsort(nodes, kind="stable")
    ids_sorted = nodes[by_id]

    def local(ids: np.ndarray) -> np.ndarray:
        """Local indices of global ``ids`` in ``nodes``; -1 where a node is not in the part."""
        at = np.minimum(np.searchsorted(ids_sorted, ids), len(nodes) - 1)
        return np.where(ids_sorted[at] == ids, by_id[at], -1)

    s_local, d_local = local(inward_src), inward_dst - lo
    if (s_local < 0).any():  # halo=0: sources outside the part are not held
        keep = s_local >= 0
        s_local, d_local = s_local[keep], d_local[keep]
    reach_src, reach_dst = s_local, d_local
    if halo > 1:  # then the in-edges of the halo nodes closer than `halo` hops, in file order
        deeper = np.setdiff1d(inner, owned)
        more = _in_edges(dst, deeper)
        reach_src = np.r_[s_local, local(np.asarray(src[more], dtype=np.int64))]
        reach_dst = np.r_[d_local, local(np.asarray(dst[more], dtype=np.int64))]
    recv_counts = tuple(int(np.count_nonzero(owner == q)) for q in range(parts))
    send_counts, asked = _ask_owners(extra, recv_counts, topology, dim)
    return NodePart(
        rank=rank,
        parts=parts,
        owned=owned,
        halo=extra,
        halo_owner=owner,
        src=s_local,
        dst=d_local,
        send_index=(asked - lo).astype(np.int64),
        send_counts=send_counts,
        recv_counts=recv_counts,
        depth=halo,
        reach_src=reach_src,
        reach_dst=reach_dst,
    )


def _ask_owners(
    halo: np.ndarray, counts: tuple[int, ...], topology: Topology, dim: str
) -> tuple[tuple[int, ...], np.ndarray]:
    """Send each owner the ids of its nodes this rank's halo holds (in halo order); receive what each rank needs of
    this rank's nodes: the counts and ids of the send plan, part after part."""
    if len(counts) == 1:
        return (0,), np.zeros(0, dtype=np.int64)
    group = topology.group(dim)
    mine = torch.tensor(counts, dtype=torch.int64)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=group)
    wanted = torch.empty(int(theirs.sum()), dtype=torch.int64)
    dist.all_to_all_single(wanted, torch.from_numpy(halo.astype(np.int64)), theirs.tolist(), list(counts), group=group)
    return tuple(int(c) for c in theirs.tolist()), wanted.numpy()
