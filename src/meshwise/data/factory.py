"""``mesh_dataloader``: the one entry point that picks the loader for a source (arrays, a map-style dataset, a
stream) and hands it the options as one :class:`~meshwise.data.options.LoaderOptions`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshwise.data.array_loader import MeshDataLoader
from meshwise.data.mapped import MeshSampleLoader
from meshwise.data.options import LoaderOptions
from meshwise.data.parts import PartSpec
from meshwise.data.sources import ArrayDataset
from meshwise.data.streaming import MeshStreamLoader, is_streaming
from meshwise.topology import Topology

__all__ = ["mesh_dataloader"]


def mesh_dataloader(
    dataset: ArrayDataset | Mapping[str, Any],
    topology: Topology | None = None,
    *,
    global_batch_size: int,
    mode: str = "train",
    seed: int = 0,
    drop_last: bool = True,
    parts: Mapping[str, PartSpec] | Any = None,
    read: str = "each",
    num_workers: int = 0,
    **kwargs: Any,
) -> MeshDataLoader | MeshSampleLoader | MeshStreamLoader:
    """A loader that gives this rank ``global_batch_size // topology.data_size`` samples a step, parts only.

    ``mode="train"``: a permutation per (seed, epoch), last partial batch dropped or (``drop_last=False``)
    padded; ``mode="eval"``: every sample exactly once, padded rows have ``valid=False`` and ``index=-1``.
    ``parts`` maps a field to ``Shard(axis, halo)``/``Replicate()`` over the split dims; ``read`` picks who
    reads in a replica group: ``"each"``, ``"broadcast"`` (the leader reads) or ``"scatter"`` (1/k each).
    ``num_workers > 0`` reads in DataLoader worker processes (``prefetch_factor``, ``multiprocessing_context``
    are passed through; the context defaults to ``"fork"`` where the platform has it).

    A map-style torch ``Dataset`` or a ``datasets.Dataset`` gets a :class:`MeshSampleLoader` instead: samples
    read by index and joined by ``collate_fn`` (default :func:`meshwise.data.pad_collate`), the same ``read``
    strategies, and ``parts`` cut from the collated batch (balanced token chunks included).
    A torch ``IterableDataset`` or a ``datasets.IterableDataset`` gets a :class:`MeshStreamLoader`: the stream
    divided by data rank, read in order, with an exact resume at the same data size.
    """
    keywords = dict(global_batch_size=global_batch_size, mode=mode, seed=seed, drop_last=drop_last, parts=parts)
    options = LoaderOptions.of(None, dict(keywords, read=read, num_workers=num_workers, **kwargs), "mesh_dataloader")
    if is_streaming(dataset):
        return MeshStreamLoader(dataset, topology, options=options)
    # a DatasetDict is a dict of splits, not of arrays: the sample loader's checks say to pick a split
    if not isinstance(dataset, (ArrayDataset, Mapping)) or type(dataset).__name__.endswith("DatasetDict"):
        return MeshSampleLoader(dataset, topology, options=options)
    return MeshDataLoader(dataset, topology, options=options)
