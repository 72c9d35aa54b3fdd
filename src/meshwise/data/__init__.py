"""Topology-aware data: a global-cursor sampler, per-rank sample parts read lazily, replica read strategies."""

from __future__ import annotations

from meshwise.data.loader import MeshDataLoader, mesh_dataloader
from meshwise.data.parts import Replicate, Shard, chunk_bounds, from_placements, parts_of
from meshwise.data.sampler import MeshSampler
from meshwise.data.sources import ArrayDataset, Source

# What users call; the part arithmetic (FieldPart, resolve_part, as_dtensor, largest_halo) stays in meshwise.data.parts.
__all__ = [
    "ArrayDataset",
    "MeshDataLoader",
    "MeshSampler",
    "Replicate",
    "Shard",
    "Source",
    "chunk_bounds",
    "from_placements",
    "mesh_dataloader",
    "parts_of",
]
