"""The loader of map-style sources: a torch ``Dataset`` or a Hugging Face ``datasets.Dataset``, read by index.

Samples are whole (no parts) and joined by a collate function, so fields may vary in length from sample to
sample. The sampler is the same :class:`MeshSampler` as for arrays: the global cursor, its resume at another
data-parallel size and exact eval come with it. Every rank of a replica group reads its rows itself.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from meshwise.data.collate import as_fields, pad_collate
from meshwise.data.sampler import MeshSampler
from meshwise.errors import DataError
from meshwise.topology import Topology, resolve

__all__ = ["MeshSampleLoader", "check_map_style", "is_hf_dataset"]

_STREAMING = (
    "streaming (iterable) datasets are not supported yet: the global cursor needs random access. Materialise it "
    "(a datasets.Dataset, e.g. IterableDataset.take(n) then Dataset.from_generator, or save_to_disk/load_from_disk), "
    "or shard it yourself with datasets.distributed.split_dataset_by_node(ds, rank=topo.data_rank, "
    "world_size=topo.data_size) and a plain torch DataLoader"
)


def is_hf_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.Dataset`` (checked without importing ``datasets``)."""
    return any(c.__module__.startswith("datasets.") and c.__name__ == "Dataset" for c in type(dataset).__mro__)


def check_map_style(dataset: Any) -> None:
    """Raise a DataError that says what to do for sources the map-style loader cannot index."""
    names = {c.__name__ for c in type(dataset).__mro__}
    if isinstance(dataset, torch.utils.data.IterableDataset) or "IterableDataset" in names:
        raise DataError(_STREAMING)
    if "DatasetDict" in names or "IterableDatasetDict" in names:
        raise DataError(f"a DatasetDict holds splits {sorted(dataset)}: pass one split, e.g. ds['train']")
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DataError(
            f"mesh_dataloader takes an ArrayDataset, a mapping of arrays, a map-style torch Dataset or a "
            f"datasets.Dataset; {type(dataset).__name__} has no __len__/__getitem__"
        )


class _SampleReader:
    """Reads a list of rows (``-1`` = padding, at the end) and collates them; picklable for workers."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn
        self.hf = is_hf_dataset(dataset)

    def samples(self, idx: np.ndarray) -> list[Any]:
        if self.hf:
            # One batched Arrow take of just these rows (the table stays memory-mapped); Python-formatted rows keep
            # token ids as Python ints, which collate turns into int64.
            columns = self.dataset[idx.tolist()]
            return [{k: v[i] for k, v in columns.items()} for i in range(len(idx))]
        return [self.dataset[int(i)] for i in idx]

    def read(self, rows_indices: np.ndarray) -> Any:
        valid = int(np.count_nonzero(rows_indices >= 0))
        # Padded rows repeat a real sample so that the collate sees full-size shapes; they are zeroed below.
        filler = int(rows_indices[0]) if valid else 0
        idx = np.where(rows_indices >= 0, rows_indices, filler)
        batch = self.collate_fn(self.samples(idx))
        if valid < len(rows_indices):
            _blank(batch, valid, len(rows_indices))
        return batch

    def __getitem__(self, rows_indices: np.ndarray) -> Any:
        return self.read(rows_indices)

    def __len__(self) -> int:  # DataLoader asks; items are index arrays, not positions
        return 0


def _blank(batch: Any, valid: int, rows: int) -> None:
    """Padded rows carry zeros (``labels``: -100), never a repeated sample that a loss could count."""
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, list) else ()
    for name, value in items:
        if isinstance(value, torch.Tensor) and value.dim() and len(value) == rows:
            value[valid:] = -100 if name == "labels" else 0


def _identity(x: Any) -> Any:
    return x


class MeshSampleLoader:
    """Dict batches of a map-style source for this rank: collated fields ``[B_local, ...]``, ``valid``, ``index``.

    Built by :func:`meshwise.data.mesh_dataloader` for a torch ``Dataset`` or a ``datasets.Dataset``. The same
    API as :class:`MeshDataLoader` for the cursor (``len``, ``set_epoch``, ``state_dict``, ``load_state_dict``);
    no sample parts and only ``read="each"``.
    """

    def __init__(
        self,
        dataset: Any,
        topology: Topology | None = None,
        *,
        global_batch_size: int,
        mode: str = "train",
        seed: int = 0,
        drop_last: bool = True,
        parts: Any = None,
        read: str = "each",
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        stage_fields: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        check_map_style(dataset)
        if read != "each":
            raise DataError(
                f"read={read!r} is not supported for map-style datasets yet (their batches vary in shape, so there is "
                "no fixed buffer to broadcast or scatter): use read='each' (every replica rank reads its rows)"
            )
        if parts is not None or stage_fields is not None:
            raise DataError(
                "parts= and stage_fields= need fixed-shape array fields: pack() the dataset (meshwise.data.pack) or "
                "give an ArrayDataset; map-style samples are read whole"
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise DataError(f"num_workers must be an int >= 0, got {num_workers!r}")
        topology = resolve(topology)
        self.dataset, self.topology = dataset, topology
        self.sampler = MeshSampler.from_topology(
            topology, len(dataset), global_batch_size, mode=mode, seed=seed, drop_last=drop_last
        )
        self.read, self.parts = "each", {}
        self._reader = _SampleReader(dataset, pad_collate if collate_fn is None else collate_fn)
        if num_workers > 0:
            try:
                pickle.dumps(self._reader)
            except Exception as exc:  # lambdas, open handles, locks: each raises its own type
                raise DataError(
                    f"num_workers={num_workers} sends the dataset and collate_fn to worker processes, but they do "
                    f"not pickle ({type(exc).__name__}: {exc}): use module-level functions and reopen handles in "
                    "__getitem__, or num_workers=0"
                ) from exc
        if multiprocessing_context is None and "fork" in multiprocessing.get_all_start_methods():
            multiprocessing_context = "fork"  # as for arrays: a worker starts in milliseconds, not seconds
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self.bytes_read = 0  # tensor bytes of the batches handed out (storage reads are the source's business)

    @property
    def local_batch_size(self) -> int:
        return self.sampler.local_batch_size

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def _batches(self, plan: list[np.ndarray]) -> Iterator[Any]:
        if self.num_workers == 0:
            yield from (self._reader.read(local) for local in plan)
            return
        yield from torch.utils.data.DataLoader(
            self._reader,
            batch_size=None,
            sampler=plan,
            num_workers=self.num_workers,
            collate_fn=_identity,
            prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self.multiprocessing_context,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        plan = self.sampler.plan()
        for local, batch in zip(plan, self._batches(plan)):
            batch = as_fields(batch) if not isinstance(batch, dict) else batch
            batch["valid"] = torch.from_numpy(local >= 0)
            batch["index"] = torch.from_numpy(local.copy())
            self.bytes_read += sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor))
            self.sampler.advance()  # the cursor counts batches handed out, not batches prefetched
            yield batch

    def __repr__(self) -> str:
        return (
            f"MeshSampleLoader({len(self.dataset)} samples, global batch {self.sampler.global_batch_size}, "
            f"local {self.local_batch_size}, mode {self.sampler.mode!r}, {len(self)} steps)"
        )
