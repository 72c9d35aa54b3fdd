"""Topology-aware data: a global-cursor sampler, per-rank sample parts, replica reads, map-style and stream sources,
weighted mixtures of sources, and node-set parts of graphs (one graph, or each sample its own)."""

from __future__ import annotations

from meshwise.data.array_loader import MeshDataLoader
from meshwise.data.blend import Schedule
from meshwise.data.collate import pad_collate
from meshwise.data.factory import mesh_dataloader
from meshwise.data.graph import NodePart, node_parts, partition_nodes, read_nodes, reorder_nodes
from meshwise.data.graph_local import read_node_part
from meshwise.data.graph_samples import GraphSamples, NodeSamples
from meshwise.data.mapped import MeshSampleLoader
from meshwise.data.mixture import mix
from meshwise.data.packing import pack
from meshwise.data.parts import Replicate, Shard, chunk_bounds, from_placements, parts_of
from meshwise.data.sampler import MeshSampler
from meshwise.data.sources import ArrayDataset, Source
from meshwise.data.streaming import MeshStreamLoader

# What users call; the part arithmetic (FieldPart, resolve_part, as_dtensor, largest_halo) stays in meshwise.data.parts.
__all__ = [
    "ArrayDataset",
    "GraphSamples",
    "MeshDataLoader",
    "MeshSampleLoader",
    "MeshSampler",
    "MeshStreamLoader",
    "NodePart",
    "NodeSamples",
    "Schedule",
    "Replicate",
    "Shard",
    "Source",
    "chunk_bounds",
    "from_placements",
    "mesh_dataloader",
    "mix",
    "node_parts",
    "pack",
    "pad_collate",
    "partition_nodes",
    "parts_of",
    "read_node_part",
    "read_nodes",
    "reorder_nodes",
]
