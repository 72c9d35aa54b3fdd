"""Parts of irregular samples: a graph's nodes divided over the ranks of a split dim, each part with its halo.

A *node-set part* is the set of nodes a split rank owns, plus its *halo*: the nodes within ``halo`` hops upstream
(along the edges ``src -> dst``) of its owned nodes that other ranks own. A message-passing layer computes its
owned nodes' outputs from their in-edges, whose sources lie in the part or its 1-hop halo; deeper halos let a rank
read more of the input instead of exchanging it: with a ``k``-hop halo, ``k`` layers over the part's reach edges
(``NodePart.reach_src``/``reach_dst``) compute the owned nodes exactly with no exchange at all, the halo nodes
redundantly.

The partition is deterministic, balanced (part sizes differ by at most one node) and keeps nearby nodes together:
the nodes sorted along a Morton (Z-order) curve of their coordinates, cut into equal ranges; or a partition
vector the user gives (PhysicsNeMo's or METIS's, for example); or, with neither, ranges of node ids. Each part
also carries its exchange plan (which of its owned nodes each other part needs; its halo grouped by owner), so
:func:`meshwise.parallel.node_halo_exchange` moves features with one all-to-all. :func:`node_parts` computes every
part at once (cheap numpy, the same on every rank) and keeps the result for the same graph and split size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshwise.data.sources import chunk_bytes
from meshwise.errors import DataError, DataWarning

__all__ = [
    "NodePart",
    "check_halo",
    "expand_runs",
    "node_parts",
    "partition_nodes",
    "read_nodes",
    "read_rows",
    "refuse_whole_graph",
    "reorder_nodes",
]

GRAPH_FILE = "graph.json"  # what reorder_nodes wrote: the node count, edges sorted by destination (graph_local)
_CACHE: dict[tuple, list[NodePart]] = {}
_CACHE_SIZE = 8


@dataclasses.dataclass(frozen=True)
class NodePart:
    """What split rank ``rank`` of ``parts`` holds of a graph.

    ``owned``: its nodes (global ids, increasing); ``halo``: the other nodes within the halo depth upstream of them,
    grouped by owner then by id, and ``halo_owner`` their parts; ``nodes`` = owned then halo, the rows a rank reads
    (local index ``i`` is global node ``nodes[i]``). ``src``/``dst``: the in-edges of its owned nodes in local
    indices (``dst < len(owned)``). ``send_index``/``send_counts``: the owned nodes (local) each other part needs,
    part after part; ``recv_counts``: how many halo nodes come from each part. ``depth``: the halo's hops.
    ``reach_src``/``reach_dst``: the in-edges of every part node closer than ``depth`` hops to the owned ones (local
    indices; the owned nodes' in-edges first, so for ``depth <= 1`` they are ``src``/``dst``): ``depth``
    message-passing layers over them give the owned nodes the whole graph's values without an exchange (the
    outer halo's values go wrong first, a hop a layer, and never reach the owned nodes).
    """

    rank: int
    parts: int
    owned: np.ndarray
    halo: np.ndarray
    halo_owner: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    send_index: np.ndarray
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    depth: int = 1
    reach_src: np.ndarray | None = None
    reach_dst: np.ndarray | None = None

    @property
    def nodes(self) -> np.ndarray:
        return np.concatenate([self.owned, self.halo])

    @property
    def halo_share(self) -> float:
        """Halo nodes per owned node: what the halo adds to this rank's reads."""
        return len(self.halo) / max(1, len(self.owned))


def _check_edges(edges: Any, num_nodes: int) -> np.ndarray:
    e = np.asarray(edges)
    if e.ndim != 2 or 2 not in e.shape or not np.issubdtype(e.dtype, np.integer):
        raise DataError(f"edges must be integer node ids of shape [2, E] (src, dst), got {e.dtype} {e.shape}")
    e = (e if e.shape[0] == 2 else e.T).astype(np.int64)
    bad = (e < 0) | (e >= num_nodes)
    if bad.any():
        cols = np.flatnonzero(bad.any(axis=0))
        raise DataError(
            f"{len(cols)} edge(s) name nodes outside 0..{num_nodes - 1}, e.g. edge {int(cols[0])}: "
            f"{e[:, cols[0]].tolist()}: give num_nodes the graph's node count, or drop the edges to missing nodes"
        )
    return e


def _morton(coords: np.ndarray) -> np.ndarray:
    """The Z-order key of each point: its quantised coordinates' bits interleaved (21 bits a dim, up to 3 dims)."""
    c = np.asarray(coords, dtype=np.float64)
    if c.ndim != 2 or not 1 <= c.shape[1] <= 3 or not np.isfinite(c).all():
        raise DataError(f"coords must be finite [num_nodes, 1..3] positions, got shape {c.shape}")
    lo, span = c.min(axis=0), np.ptp(c, axis=0)
    q = ((c - lo) / np.where(span > 0, span, 1.0) * (2**21 - 1)).astype(np.uint64)
    key = np.zeros(len(c), dtype=np.uint64)
    for bit in range(21):
        for d in range(c.shape[1]):
            key |= ((q[:, d] >> np.uint64(bit)) & np.uint64(1)) << np.uint64(bit * c.shape[1] + d)
    return key


def partition_nodes(
    num_nodes: int, parts: int, *, coords: Any = None, vector: Sequence[int] | np.ndarray | None = None
) -> np.ndarray:
    """The part (``0..parts-1``) of each node: ``vector`` as given (checked), else balanced ranges of the nodes in
    Morton order of ``coords`` (nearby nodes together), else balanced ranges of node ids."""
    if parts < 1 or parts > num_nodes:
        raise DataError(
            f"cannot divide {num_nodes} node(s) over {parts} split rank(s): every rank needs a node; use at most "
            f"{num_nodes} split ranks (or a larger graph)"
        )
    if vector is not None:
        v = np.asarray(vector)
        if v.shape != (num_nodes,) or not np.issubdtype(v.dtype, np.integer):
            raise DataError(f"the partition vector must hold one integer part per node ({num_nodes}), got {v.shape}")
        counts = np.bincount(v, minlength=parts) if v.min() >= 0 else None
        if counts is None or v.max() >= parts or (counts == 0).any():
            raise DataError(
                f"the partition vector must give every node a part in 0..{parts - 1} and every part a node "
                f"(parts of the split dim); got values {int(v.min())}..{int(v.max())}"
            )
        return v.astype(np.int64)
    order = np.argsort(_morton(coords), kind="stable") if coords is not None else np.arange(num_nodes)
    if coords is not None and len(order) != num_nodes:
        raise DataError(f"coords has {len(order)} rows for {num_nodes} nodes: give one position per node")
    out = np.empty(num_nodes, dtype=np.int64)
    out[order] = np.arange(num_nodes) * parts // num_nodes  # balanced: sizes differ by at most one
    return out


def check_halo(halo: Any, layers: Any = None) -> None:
    """``halo`` must be hops (an int >= 0); against ``layers``, the message-passing layers a model runs on the loaded
    rows before it first exchanges (or at all), deeper hops are read (and exchanged) for nothing: warned.
    ``layers=None`` says nothing."""
    if isinstance(halo, bool) or not isinstance(halo, int) or halo < 0:
        raise DataError(f"halo must be an int >= 0 (hops), got {halo!r}")
    if layers is None:
        return
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise DataError(f"layers must be an int >= 0 (the model's layers before its first exchange), got {layers!r}")
    if halo > layers:
        warnings.warn(
            f"a halo of {halo} hops for a model that runs {layers} layer(s) on the loaded rows before it exchanges: "
            f"hops {layers + 1}..{halo} are read, kept and exchanged, and no layer uses them; give halo={layers}",
            DataWarning,
            stacklevel=3,
        )


def refuse_whole_graph(halo: int, rank: int, held: int, num_nodes: int, parts: int) -> None:
    """A part whose owned and halo nodes (``held``) are the whole graph saves nothing by splitting: refused."""
    if held == num_nodes and parts > 1 and halo > 0:
        raise DataError(
            f"a halo of {halo} hop(s) gives split rank {rank} every node of the graph: the part reads the whole "
            "sample, so splitting it saves nothing; use a smaller halo (one hop per exchange) or fewer split ranks"
        )


def _upstream(e: np.ndarray, nodes: np.ndarray, num_nodes: int) -> np.ndarray:
    mask = np.zeros(num_nodes, dtype=bool)
    mask[nodes] = True
    return np.unique(e[0, mask[e[1]]])


def node_parts(
    edges: Any,
    num_nodes: int,
    parts: int,
    *,
    halo: int = 1,
    coords: Any = None,
    vector: Sequence[int] | np.ndarray | None = None,
    layers: int | None = None,
) -> list[NodePart]:
    """Every split rank's :class:`NodePart` of the graph ``edges`` (``[2, E]``, ``src -> dst``), with a ``halo``-hop
    halo; the partition as :func:`partition_nodes`. Kept for the same graph, split size and halo (samples that
    share a mesh share it). ``layers``: how many message-passing layers the model runs on the loaded rows before it
    first exchanges (its reach on them); a deeper halo is warned (:class:`~meshwise.errors.DataWarning`)."""
    check_halo(halo, layers)
    e = _check_edges(edges, num_nodes)
    key = (_digest(e, coords, vector), num_nodes, parts, halo)
    if key in _CACHE:
        return _CACHE[key]
    owner = partition_nodes(num_nodes, parts, coords=coords, vector=vector)
    out = []
    halos: list[np.ndarray] = []
    inners: list[np.ndarray] = []  # the nodes closer than `halo` hops: the destinations of the reach edges
    for p in range(parts):
        owned = np.flatnonzero(owner == p)
        reach = inner = owned
        for _ in range(halo):
            inner = reach
            reach = np.union1d(reach, _upstream(e, reach, num_nodes))
        extra = np.setdiff1d(reach, owned)
        refuse_whole_graph(halo, p, len(extra) + len(owned), num_nodes, parts)
        extra = extra[np.lexsort((extra, owner[extra]))]  # grouped by owner: one block per sender
        halos.append(extra)
        inners.append(inner)
    for p in range(parts):
        owned, extra = np.flatnonzero(owner == p), halos[p]
        nodes = np.concatenate([owned, extra])
        local = np.full(num_nodes, -1, dtype=np.int64)
        local[nodes] = np.arange(len(nodes))
        inward = np.flatnonzero(owner[e[1]] == p)
        src, dst = local[e[0, inward]], local[e[1, inward]]
        if (src < 0).any():  # halo=0: sources outside the part are not held
            keep = src >= 0
            src, dst = src[keep], dst[keep]
        reach_src, reach_dst = src, dst
        if halo > 1:  # then the in-edges of the halo nodes closer than `halo` hops: their sources are in the part
            deeper = np.zeros(num_nodes, dtype=bool)
            deeper[inners[p]] = True
            deeper[owned] = False
            more = np.flatnonzero(deeper[e[1]])
            reach_src, reach_dst = np.r_[src, local[e[0, more]]], np.r_[dst, local[e[1, more]]]
        sends = [np.searchsorted(owned, halos[q][owner[halos[q]] == p]) for q in range(parts)]
        out.append(
            NodePart(
                rank=p,
                parts=parts,
                owned=owned,
                halo=extra,
                halo_owner=owner[extra],
                src=src,
                dst=dst,
                send_index=np.concatenate(sends).astype(np.int64),
                send_counts=tuple(len(s) for s in sends),
                recv_counts=tuple(int(np.count_nonzero(owner[extra] == q)) for q in range(parts)),
                depth=halo,
                reach_src=reach_src,
                reach_dst=reach_dst,
            )
        )
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = out
    return out


def _digest(e: np.ndarray, coords: Any, vector: Any) -> str:
    h = hashlib.sha1(np.ascontiguousarray(e).tobytes())
    for extra in (coords, vector):
        h.update(b"|" if extra is None else np.ascontiguousarray(np.asarray(extra)).tobytes())
    return h.hexdigest()


_LONG_RUN = 256  # a run of this many consecutive rows is copied as one block; shorter runs are gathered row by row


def read_nodes(source: Any, part: NodePart) -> tuple[np.ndarray, int]:
    """Rows ``part.nodes`` (owned, then halo) of a node field: a numpy array or memmap (``.npy``), a Zarr or HDF5
    array, shape ``[num_nodes, ...]``; only those rows are read, each chunk of a chunked store (Zarr, chunked HDF5)
    at most once, long runs of consecutive rows as slices (after :func:`reorder_nodes` a part is a few runs).
    Returns the rows and the bytes read: of the rows, or for a chunked store of every chunk touched, read whole."""
    return read_rows(source, part.nodes)


def expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``starts[i] .. starts[i] + lengths[i] - 1`` for every ``i``, one after the other."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))


def read_rows(source: Any, nodes: np.ndarray) -> tuple[np.ndarray, int]:
    """Rows ``nodes`` (in that order) of a node field, as :func:`read_nodes` reads them, and the bytes read.

    The rows asked for are runs of consecutive rows, in the order asked. The chunks the long runs touch (their rows,
    for an unchunked array) are merged into spans of consecutive chunks, each read as one slice: a long run is
    copied from it as one block (no sort, no row-by-row copy), and the short runs' rows in its chunks are picked
    from it too. The short runs' other rows are read in one indexed read, in increasing ids. No chunk is in two
    reads, and a chunked store decodes each chunk once a read, so every touched chunk is read exactly once."""
    nodes = np.asarray(nodes)
    shape = tuple(source.shape)
    out = np.empty((len(nodes), *shape[1:]), dtype=np.dtype(source.dtype))
    chunks = getattr(source, "chunks", None)
    if not len(nodes):
        return out, 0
    c0 = int(chunks[0]) if chunks else 1
    at = np.r_[0, np.flatnonzero(np.diff(nodes) != 1) + 1]  # where each run starts in ``out``
    size = np.diff(np.r_[at, len(nodes)])
    long = np.flatnonzero(size >= _LONG_RUN)  # copied as blocks
    long = long[np.argsort(nodes[at[long]])]
    lo = nodes[at[long]]
    hi = lo + size[long]
    pos = np.flatnonzero(np.repeat(size < _LONG_RUN, size))  # the short runs' rows, by id
    pos = pos[np.argsort(nodes[pos])]
    ids = nodes[pos]
    st = np.r_[0, np.flatnonzero(np.diff(ids) != 1) + 1]  # their runs by id: a long one was asked out of order
    sz = np.diff(np.r_[st, len(ids)])
    big = st[sz >= _LONG_RUN]
    seed_lo, seed_hi = np.r_[lo, ids[big]], np.r_[hi, ids[big] + sz[sz >= _LONG_RUN]]
    o = np.argsort(seed_lo)  # the chunks of the long runs, merged into spans of consecutive chunks: a slice each
    first, last = seed_lo[o] // c0, np.maximum.accumulate((seed_hi[o] - 1) // c0)
    heads = np.r_[np.flatnonzero(np.r_[True, first[1:] > last[:-1] + 1][: len(o)]), len(o)]
    span_first, span_last = first[heads[:-1]], last[heads[1:] - 1]
    span_lo, span_hi = seed_lo[o][heads[:-1]], np.maximum.accumulate(seed_hi[o])[heads[1:] - 1]
    span = np.searchsorted(span_first, ids // c0, side="right") - 1
    inside = ids // c0 <= np.r_[span_last, -1][span]  # in a span's chunks: picked from its slice
    picks = np.flatnonzero(inside)
    cuts = np.searchsorted(span[picks], np.arange(len(span_first) + 1))
    lcuts = np.r_[np.searchsorted(lo // c0, span_first), len(lo)]
    for s in range(len(span_first)):
        runs, mine = slice(lcuts[s], lcuts[s + 1]), picks[cuts[s] : cuts[s + 1]]
        a, b = int(span_lo[s]), int(span_hi[s])
        if len(mine):
            a, b = min(a, int(ids[mine[0]])), max(b, int(ids[mine[-1]]) + 1)
        buf = source[a:b]
        for r, x0, x1 in zip(at[long[runs]], lo[runs], hi[runs]):
            out[r : r + x1 - x0] = buf[x0 - a : x1 - a]
        if len(mine) and ids[mine[-1]] - ids[mine[0]] == len(mine) - 1:  # a block asked out of order
            out[pos[mine]] = buf[int(ids[mine[0]]) - a : int(ids[mine[-1]]) + 1 - a]
        else:
            out[pos[mine]] = buf[ids[mine] - a]
    rest = np.flatnonzero(~inside)
    if len(rest):  # in increasing ids (HDF5 needs them so), each once
        want, inv = ids[rest], None
        if bool(np.any(want[1:] == want[:-1])):
            want, inv = np.unique(want, return_inverse=True)
        rows = source.oindex[want] if hasattr(source, "oindex") else source[want]
        out[pos[rest]] = rows if inv is None else rows[inv]
    if not chunks:
        return out, int(out.nbytes)
    k = ids[rest] // c0
    touched = np.r_[expand_runs(span_first, span_last - span_first + 1), k[np.r_[True, k[1:] != k[:-1]][: len(k)]]] * c0
    return out, chunk_bytes(shape, chunks, touched, [slice(0, n) for n in shape[1:]], out.dtype.itemsize)


def _runs(ids: np.ndarray) -> int:
    """How many runs of consecutive ids a read of ``ids`` takes (one seek each, in a file in id order)."""
    s = np.sort(ids)
    return int(len(s) > 0) + int(np.count_nonzero(np.diff(s) != 1))


def reorder_nodes(
    folder: str | os.PathLike[str],
    edges: Any,
    fields: dict[str, Any],
    parts: int,
    *,
    coords: Any = None,
    vector: Sequence[int] | np.ndarray | None = None,
    halo: int = 1,
    sample_major: Sequence[str] = (),
) -> dict[str, Any]:
    """Rewrite a graph dataset in partition order, once, so that each part's nodes are one contiguous range.

    Writes ``folder/<name>.npy`` for every node field (``[num_nodes, ...]``, rows permuted; the fields named in
    ``sample_major`` are ``[samples, num_nodes, ...]``, as :class:`~meshwise.data.NodeSamples` reads them, permuted
    along axis 1 and written a sample at a time), ``edges.npy`` (renumbered, sorted by destination: each part's
    in-edges one range), ``coords.npy`` (when given), ``order.npy`` (new id -> old id) and ``graph.json`` (the node
    count: :func:`~meshwise.data.read_node_part` reads a rank's part from these files). Nodes go part by part (the
    partition of :func:`partition_nodes`); afterwards the same partition is ``node_parts(edges, n, parts)`` (ranges
    of ids) for the balanced ones (``coords`` or none), else ``vector=old_vector[order]``. Within a part the nodes
    no other part reads come first, then the ones others read, grouped by reader (along the Morton curve within a
    group), so a part's halo is a few runs of rows: a few chunks of a chunked store. Returns the runs of consecutive
    rows each part's reads (owned + halo) take before and after, which is what the rewrite saves. A ``folder`` that
    holds anything is refused: nothing is overwritten.
    """
    out = Path(folder)
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out} already holds files: reorder_nodes writes a new dataset; give an empty or new folder")
    unknown = sorted(set(sample_major) - set(fields))
    if unknown:
        raise DataError(f"sample_major names {unknown}, which are not fields ({sorted(fields)})")

    def rows(name: str) -> int:
        shape = tuple(getattr(fields[name], "shape", (len(fields[name]),)))
        return int(shape[1]) if name in sample_major and len(shape) > 1 else int(shape[0])

    num_nodes = rows(next(iter(fields))) if fields else int(np.max(np.asarray(edges))) + 1
    e = _check_edges(edges, num_nodes)
    for name in fields:
        if rows(name) != num_nodes:
            axis = "axis 1 (sample_major)" if name in sample_major else "axis 0"
            raise DataError(
                f"node field {name!r} has {rows(name)} nodes along {axis}, the graph {num_nodes}: one row per node "
                "(name the fields stored [samples, nodes, ...] in sample_major)"
            )
    owner = partition_nodes(num_nodes, parts, coords=coords, vector=vector)
    curve = _morton(coords) if coords is not None else np.arange(num_nodes, dtype=np.uint64)
    old = node_parts(e, num_nodes, parts, halo=halo, coords=coords, vector=vector)
    # within a part: the nodes no other part reads first, then those others read, grouped by which parts read them,
    # so each part's halo is a few runs of its neighbours' rows (a few chunks, not one chunk a halo node)
    readers = np.zeros(num_nodes, dtype=np.int64)
    for p in old:
        np.bitwise_or.at(readers, p.halo, np.int64(1) << (p.rank % 62))
    order = np.lexsort((curve, readers, owner))
    new_id = np.empty(num_nodes, dtype=np.int64)
    new_id[order] = np.arange(num_nodes)
    before = [_runs(p.nodes) for p in old]
    renumbered = new_id[e]
    after = [_runs(p.nodes) for p in node_parts(renumbered, num_nodes, parts, halo=halo, vector=owner[order])]
    out.mkdir(parents=True, exist_ok=True)
    for name, field in fields.items():
        if name not in sample_major:
            np.save(out / f"{name}.npy", np.asarray(field)[order])
            continue
        shape = tuple(field.shape)
        written = np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=np.dtype(field.dtype), shape=shape)
        for t in range(shape[0]):  # a sample at a time: the series need not fit in memory
            written[t] = np.asarray(field[t])[order]
        written.flush()
        del written
    np.save(out / "edges.npy", renumbered[:, np.argsort(renumbered[1], kind="stable")])
    np.save(out / "order.npy", order)
    meta = {"format": "meshwise-graph", "num_nodes": num_nodes, "edges": "sorted by destination", "parts": parts}
    (out / GRAPH_FILE).write_text(json.dumps(meta) + "\n")
    if coords is not None:
        np.save(out / "coords.npy", np.asarray(coords)[order])
    return {"order": order, "runs_before": before, "runs_after": after}
