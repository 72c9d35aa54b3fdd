"""Datasets of graph samples served as node-set parts: :class:`GraphSamples` (every sample its own graph) and
:class:`NodeSamples` (samples on one shared graph, stored sample-major: time series on a fixed mesh).

A sample is a mapping: ``edges`` (``[2, E]``, ``src -> dst``), optionally ``num_nodes``, ``coords`` and ``vector``
(the partition's inputs, as for :func:`meshwise.data.node_parts`), and node fields ``[num_nodes, ...]`` (numpy
arrays, ``.npy`` memmaps, Zarr or HDF5 arrays). Each rank partitions the sample's graph itself when it reads it
(the same deterministic partition on every rank, no communication) and reads only its rows of each field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from meshwise.data.graph import NodePart, check_halo, node_parts, read_rows
from meshwise.data.sources import RESERVED
from meshwise.errors import DataError
from meshwise.topology import Topology

__all__ = ["GraphSamples", "NodeSamples"]

_GRAPH_KEYS = ("edges", "num_nodes", "coords", "vector")  # what partitions a sample; every other key is a field
_PART_KEY = "part"


class GraphSamples(torch.utils.data.Dataset):
    """A map-style dataset of graphs of their own (node count, edges, coordinates), served as this rank's parts.

    ``graphs``: a sequence (a list, or a lazy one whose ``__getitem__`` opens sample ``i``) of mappings: ``edges``
    ``[2, E]``; ``num_nodes`` (default: the rows of ``coords``, else of the first field); ``coords``/``vector``
    for the partition (:func:`~meshwise.data.partition_nodes`); every other key a node field ``[num_nodes, ...]``.
    Item ``i`` is sample ``i``'s part of split rank ``topology.coordinate(dim)`` of ``topology.size(dim)``
    (``dim=None``: the whole graph, one part): each field's rows ``part.nodes`` (owned, then the ``halo``-hop
    halo) as a tensor, the fields named in ``owned_fields`` (targets: a loss counts each node once) its owned
    rows only, and ``"part"``: the :class:`~meshwise.data.NodePart` (the in-edges of the owned nodes in local
    indices, the exchange plan of :func:`~meshwise.parallel.node_halo_exchange`).

    ``layers``: the model's layers on the loaded rows before it exchanges; a deeper ``halo`` is warned.

    Through :func:`~meshwise.data.mesh_dataloader` with ``global_batch_size=topology.data_size``: one graph a data
    rank a step (fields ``[1, rows, ...]``, ``batch["part"]`` a list of one part). Parts are computed by
    :func:`~meshwise.data.node_parts` when a sample is read, which keeps the last few graphs' parts. A list or
    tuple of graphs is checked when the dataset is built (sizes only), a lazy sequence when a sample is read.
    """

    def __init__(
        self,
        graphs: Sequence[Mapping[str, Any]],
        topology: Topology,
        dim: str | None = "domain",
        *,
        halo: int = 1,
        owned_fields: Sequence[str] = ("target",),
        layers: int | None = None,
    ) -> None:
        check_halo(halo, layers)  # once here, not at every sample
        if dim is None:
            self.parts, self.rank = 1, 0
        elif dim not in topology.split_dims:
            dims = ", ".join(f"{d}={s}" for d, s in topology.sizes.items())
            raise DataError(
                f"GraphSamples splits graphs over a split dim; {dim!r} is not one of this mesh ({dims}): name the "
                "split dim (domain, spatial), or pass dim=None for whole graphs (one process, data parallel only)"
            )
        else:
            self.parts, self.rank = topology.size(dim), topology.coordinate(dim)
        if isinstance(owned_fields, str):
            raise DataError(
                f"owned_fields takes field names, got the string {owned_fields!r}: write ({owned_fields!r},)"
            )
        self.graphs, self.dim, self.halo, self.owned_fields = graphs, dim, halo, tuple(owned_fields)
        if isinstance(graphs, (list, tuple)):
            for i, graph in enumerate(graphs):
                self._num_nodes(i, graph)

    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        graph = self.graphs[index]
        n = self._num_nodes(index, graph)
        try:
            parts = node_parts(
                graph["edges"], n, self.parts, halo=self.halo, coords=graph.get("coords"), vector=graph.get("vector")
            )
        except DataError as exc:
            raise DataError(f"sample {index}: {exc}") from None
        part = parts[self.rank]
        out: dict[str, Any] = {}
        for name, field in graph.items():
            if name not in _GRAPH_KEYS:
                rows, _ = read_rows(field, part.owned if name in self.owned_fields else part.nodes)
                out[name] = torch.from_numpy(rows)
        out[_PART_KEY] = part
        return out

    def _num_nodes(self, index: int, graph: Any) -> int:
        """Sample ``index``'s node count, its graph and fields checked (sizes only: nothing is read)."""
        if not isinstance(graph, Mapping) or "edges" not in graph:
            what = sorted(graph) if isinstance(graph, Mapping) else type(graph).__name__
            raise DataError(
                f"sample {index} of GraphSamples must be a mapping with 'edges' ([2, E]), optional 'num_nodes', "
                f"'coords', 'vector' and node fields; got {what}"
            )
        fields = [k for k in graph if k not in _GRAPH_KEYS]
        clash = [k for k in fields if k in (*RESERVED, _PART_KEY)]
        if clash:
            raise DataError(
                f"sample {index} has fields {clash}: {[*RESERVED, _PART_KEY]} are the batch's own keys; rename them"
            )
        n = graph.get("num_nodes")
        if n is None:
            first = graph.get("coords") if graph.get("coords") is not None else (graph[fields[0]] if fields else None)
            if first is None:
                raise DataError(f"sample {index} has no num_nodes, coords or node field: give num_nodes")
            n = len(first)
        n = int(n)
        if n < 1:
            raise DataError(f"sample {index}'s graph has no nodes: drop it from the dataset")
        for name in fields:
            shape = getattr(graph[name], "shape", None)  # its rows, from the shape alone: nothing is read
            if not shape:
                raise DataError(
                    f"sample {index}: node field {name!r} is a {type(graph[name]).__name__} of shape {shape}: give "
                    "an array [num_nodes, ...] (numpy, a .npy memmap, Zarr, HDF5)"
                )
            rows = int(shape[0])
            if rows != n:
                raise DataError(
                    f"sample {index}: node field {name!r} has {rows} rows for {n} nodes: one row per node "
                    "(a value of the whole graph can be a node field repeated on every node)"
                )
        if n < self.parts:
            raise DataError(
                f"sample {index}'s graph has {n} node(s), fewer than the {self.parts} ranks of split dim "
                f"{self.dim!r}: every rank needs a node of every sample; drop (or merge) graphs of fewer than "
                f"{self.parts} nodes, or split over at most {n} ranks"
            )
        return n


class _SampleRows:
    """Sample ``i`` of a sample-major field ``[S, N, ...]`` seen as a node field ``[N, ...]`` that :func:`read_rows`
    reads, without reading the sample whole (Zarr's ``field[i]`` or HDF5's would)."""

    def __init__(self, field: Any, i: int) -> None:
        self.field, self.i = field, i
        self.shape, self.dtype = tuple(field.shape[1:]), field.dtype
        chunks = getattr(field, "chunks", None)
        self.chunks = tuple(chunks[1:]) if chunks else None
        if hasattr(field, "oindex"):  # Zarr: one orthogonal read of scattered rows
            self.oindex = self

    def __getitem__(self, key: Any) -> Any:
        return self.field[(self.i, key)]


class NodeSamples(torch.utils.data.Dataset):
    """Samples on one shared graph, served as this rank's node-set part: the weather or CFD time series on a fixed
    mesh, stored sample-major.

    ``fields`` maps names to arrays ``[S, num_nodes, ...]`` (numpy, a ``.npy`` memmap, Zarr or HDF5); ``part`` is
    this rank's :class:`~meshwise.data.NodePart` of the graph (``node_parts(...)[topology.coordinate(dim)]``).
    Item ``i`` holds, for each field, rows ``part.nodes`` (owned then halo; ``owned_fields`` only the owned rows) of
    sample ``i + shift[name]`` as a tensor: ``shift={"target": 1}`` pairs each time step with the next from one
    array. Only those rows are read (``meshwise.data.graph.read_rows``: each touched chunk once); ``bytes_read``
    adds up what this process read, whole chunks counted (a chunk spanning several samples is read whole for one).
    Through :func:`~meshwise.data.mesh_dataloader` it gets the global cursor, checkpoints and resumes on any mesh.
    """

    def __init__(
        self,
        fields: Mapping[str, Any],
        part: NodePart,
        *,
        owned_fields: Sequence[str] = ("target",),
        shift: Mapping[str, int] | None = None,
    ) -> None:
        if not isinstance(part, NodePart):
            raise DataError(f"NodeSamples needs this rank's NodePart (from node_parts), got {type(part).__name__}")
        if not fields:
            raise DataError("NodeSamples needs at least one field: {name: array [samples, nodes, ...]}")
        shift = dict(shift or {})
        unknown = sorted(set(shift) - set(fields))
        if unknown:
            raise DataError(f"shift names {unknown}, which are not fields ({sorted(fields)})")
        last = int(np.max(part.nodes)) if len(part.nodes) else -1
        lengths = []
        for name, field in fields.items():
            shape = tuple(getattr(field, "shape", ()))
            if name in RESERVED:
                raise DataError(f"field {name!r}: {list(RESERVED)} are the batch's own keys; rename it")
            if len(shape) < 2 or shape[1] <= last:
                raise DataError(
                    f"field {name!r} has shape {list(shape)}: NodeSamples reads arrays [samples, nodes, ...] whose "
                    f"node axis (axis 1) holds every node of the graph (the part names node {last}); a node-major "
                    "array [nodes, ...] is one graph sample: read it with read_nodes"
                )
            step = shift.get(name, 0)
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise DataError(f"shift[{name!r}] must be an int >= 0, got {step!r}")
            lengths.append(shape[0] - step)
        self.fields, self.part, self.shift = dict(fields), part, shift
        self.owned_fields = tuple(owned_fields)
        self.length = max(0, min(lengths))
        self.bytes_read = 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} of {self.length}")
        out: dict[str, Any] = {}
        for name, field in self.fields.items():
            i = index + self.shift.get(name, 0)
            rows_of = field[i] if isinstance(field, np.ndarray) else _SampleRows(field, i)  # numpy: a view
            nodes = self.part.owned if name in self.owned_fields else self.part.nodes
            rows, nbytes = read_rows(rows_of, nodes)
            chunks = getattr(field, "chunks", None)
            self.bytes_read += nbytes * (min(int(chunks[0]), int(field.shape[0])) if chunks else 1)
            out[name] = torch.from_numpy(rows)
        return out
