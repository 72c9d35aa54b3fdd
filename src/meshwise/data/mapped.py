"""The loader of map-style sources: a torch ``Dataset`` or a Hugging Face ``datasets.Dataset``, read by index.

Samples are read whole and joined by a collate function, so fields may vary in length from sample to sample.
The sampler is the same :class:`MeshSampler` as for arrays: the global cursor, its resume at another
data-parallel size and exact eval come with it. A replica group reads its batch with the array road's
strategies (``each``/``broadcast``/``scatter``), sending tensors in one flat buffer; ``parts=`` cuts the
collated batch along the split dims with the array road's part arithmetic (balanced token chunks included).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshwise.data.collate import as_fields
from meshwise.data.options import LoaderOptions, OptionsLoader
from meshwise.data.parts import FieldPart, as_parts, resolve_part
from meshwise.data.reading import SampleReader, check_specs, decode, encode, positions_of
from meshwise.data.sampler import CursorLoader
from meshwise.dryrun import note_loader
from meshwise.errors import DataError
from meshwise.topology import Topology

__all__ = ["MeshSampleLoader", "check_map_style"]


_STREAMING = (
    "streaming (iterable) datasets are not supported yet: the global cursor needs random access. Materialise it "
    "(a datasets.Dataset, e.g. IterableDataset.take(n) then Dataset.from_generator, or save_to_disk/load_from_disk), "
    "or shard it yourself with datasets.distributed.split_dataset_by_node(ds, rank=topo.data_rank, "
    "world_size=topo.data_size) and a plain torch DataLoader"
)


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


class MeshSampleLoader(OptionsLoader, CursorLoader):
    """Dict batches of a map-style source for this rank: collated fields ``[B_local, ...]``, ``valid``, ``index``.

    Built by :func:`meshwise.data.mesh_dataloader` for a torch ``Dataset`` or a ``datasets.Dataset``. The same
    cursor API as :class:`MeshDataLoader` (``len``, ``set_epoch``, ``state_dict``, ``load_state_dict``) and the
    same read strategies; ``parts`` cuts the collated batch (``loader.parts``: the parts of the last batch).
    """

    def _build(self, dataset: Any, topology: Topology | None, options: LoaderOptions) -> None:
        """Built from :class:`LoaderOptions` (see ``OptionsLoader``); ``stage_fields`` is refused."""
        check_map_style(dataset)
        if options.stage_fields is not None:
            raise DataError(
                "stage_fields= is for array fields, whose parts are read from storage; map-style samples are read "
                "whole, so every stage would read them all anyway: drop stage_fields (or give an ArrayDataset)"
            )
        self.dataset = dataset
        topology = self._setup(topology, len(dataset), options)
        num_workers, collate_fn = options.num_workers, options.collate_fn
        specs = as_parts(options.parts, topology)  # a mapping, or a model that states its input_parts
        split = {d: (topology.coordinate(d), topology.size(d)) for d in topology.split_dims}
        mesh = topology.layout.dims_text()
        check_specs(specs, split, mesh)
        self.specs = specs
        self.parts: dict[str, FieldPart] = {}
        self._reader = SampleReader(dataset, collate_fn, specs, split, mesh)
        if num_workers > 0:
            try:
                pickle.dumps(self._reader)
            except Exception as exc:  # lambdas, open handles, locks: each raises its own type
                raise DataError(
                    f"num_workers={num_workers} sends the dataset and collate_fn to worker processes, but they do "
                    f"not pickle ({type(exc).__name__}: {exc}): use module-level functions and reopen handles in "
                    "__getitem__, or num_workers=0"
                ) from exc
        note_loader(self)  # a dry run reports this loader's slice (and, after a step, its parts)

    def parts_for(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, FieldPart]:
        """The parts this rank would cut from a batch whose fields have these per-sample ``shapes`` (no reading).

        For tools that describe the loader from shapes alone (a dry run); fields not named in ``parts`` are whole.
        """
        out = {}
        for name, shape in shapes.items():
            spec = self.specs.get(name)
            value = torch.empty((1, *shape), dtype=torch.uint8)
            if self._reader.default and spec is not None:
                value = self._reader._pad_balanced(name, spec, value)
            out[name] = resolve_part(name, spec, tuple(value.shape[1:]), self._reader.split, self._reader.mesh)
        return out

    # ---- reading
    def _items(self, plan: list[np.ndarray]) -> list[tuple] | None:
        """What this rank reads each step: its batch (each), the batch (broadcast leader), a chunk (scatter)."""
        if self.read == "broadcast" and self.replica_rank != 0:
            return None
        if self.read != "scatter":
            return [("batch", local) for local in plan]
        rows, j = self._scatter_rows(), self.replica_rank
        return [("chunk", local[j * rows : (j + 1) * rows], j == 0) for local in plan]

    def _read(self, items: list[tuple] | None, steps: int) -> Iterator[Any]:
        if items is None:
            yield from (None for _ in range(steps))
        elif self.num_workers == 0:
            yield from (self._reader[item] for item in items)
        else:
            yield from self._in_workers(self._reader, items)

    def _share(self, got: Any, local: np.ndarray) -> tuple[Any, dict[str, FieldPart], int]:
        """This rank's batch and parts from what it read; the bytes it read itself."""
        if self.read == "each":
            batch, parts = got
            return batch, parts, _tensor_bytes(batch)
        group = self.topology.group(self.topology.replica_dims)
        if self.read == "broadcast":
            leader = self._replica_ranks[0]
            payload = encode(got) if got is not None else None
            size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
            dist.broadcast(size, src=leader, group=group)
            if payload is None:
                payload = torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(payload, src=leader, group=group)
            batch, parts = got if got is not None else decode(payload)
            return batch, parts, _tensor_bytes(batch) if got is not None else 0
        # scatter: every replica rank read ceil(B/k) samples; all of them travel, then each rank collates the batch
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.replica_size)]
        dist.all_gather(sizes, torch.tensor([got.numel()], dtype=torch.int64), group=group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: got.numel()] = got
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.replica_size)]
        dist.all_gather(gathered, mine, group=group)
        samples = [s for g in gathered for s in decode(g)]
        batch, parts = self._reader.batch(samples, local)
        return batch, parts, got.numel()

    def _batches(self, token: object) -> Iterator[dict[str, Any]]:
        plan, cursor = self.sampler.plan(), self._cursor()
        for local, got in zip(plan, self._read(self._items(plan), len(plan))):
            if not self._may_hand_out(token, cursor):  # before the read strategy's collectives
                return
            batch, parts, nbytes = self._share(got, local)
            batch = as_fields(batch) if not isinstance(batch, dict) else batch
            positions = positions_of(parts, batch)
            if positions is not None:
                batch["positions"] = positions.expand(len(local), -1)
            self.parts = parts
            cursor = self._hand_out(batch, local, nbytes)
            yield batch


def _tensor_bytes(batch: Any) -> int:
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))
