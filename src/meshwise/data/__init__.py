"""Topology-aware data: a global-cursor sampler, per-rank sample parts read lazily, replica read strategies."""

from __future__ import annotations

from meshwise.data.loader import MeshDataLoader, mesh_dataloader
from meshwise.data.parts import FieldPart, Replicate, Shard, as_dtensor, chunk_bounds, resolve_part
from meshwise.data.sampler import MeshSampler
from meshwise.data.sources import ArrayDataset, Source

__all__ = [
    "ArrayDataset",
    "FieldPart",
    "MeshDataLoader",
    "MeshSampler",
    "Replicate",
    "Shard",
    "Source",
    "as_dtensor",
    "chunk_bounds",
    "mesh_dataloader",
    "resolve_part",
]
