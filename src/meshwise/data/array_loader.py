"""The topology-aware data loader: sampler + per-rank sample parts + a read strategy for replica groups.

Each step this rank's local indices are read (only the rank's part of every field, halo included) into one
flat byte buffer, optionally in ``torch.utils.data.DataLoader`` workers; the main process then runs the read
strategy's collective on that buffer and hands out a dict batch of views into it. The cursor advances in the
main process when a batch is handed out, so ``state_dict()`` never counts batches that were only prefetched.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshwise.data.options import LoaderOptions, OptionsLoader
from meshwise.data.parts import FieldPart, as_parts, resolve_part
from meshwise.data.reading import balanced_positions
from meshwise.data.sampler import READS, CursorLoader
from meshwise.data.sources import ArrayDataset, read_factor, torch_dtype
from meshwise.dryrun import note_loader
from meshwise.errors import DataError, DataWarning
from meshwise.topology import Topology

__all__ = ["READS", "MeshDataLoader"]

_ALIGN = 64


class _BatchReader:
    """Reads a list of rows (``-1`` = padding, at the end) into one byte buffer; picklable for workers."""

    def __init__(self, dataset: ArrayDataset, parts: Mapping[str, FieldPart]) -> None:
        self.dataset = dataset
        self.parts = dict(parts)
        self.dtypes = {n: torch_dtype(dataset.sources[n].dtype) for n in parts}
        self.np_dtypes = {n: _numpy_dtype(d) for n, d in self.dtypes.items()}
        self.row_bytes = {n: math.prod(p.shape) * self.dtypes[n].itemsize for n, p in self.parts.items()}
        self._layouts: dict[int, tuple[dict[str, int], int]] = {}

    def layout(self, rows: int) -> tuple[dict[str, int], int]:
        if rows not in self._layouts:
            offsets, total = {}, 0
            for name in self.parts:
                offsets[name] = total
                total += -(-rows * self.row_bytes[name] // _ALIGN) * _ALIGN
            self._layouts[rows] = (offsets, total)
        return self._layouts[rows]

    def unpack(self, buffer: np.ndarray, rows: int) -> dict[str, np.ndarray | torch.Tensor]:
        """Views of each field ``[rows, *part shape]`` inside ``buffer`` (no copy): numpy where it can, else torch."""
        offsets, _ = self.layout(rows)
        out: dict[str, np.ndarray | torch.Tensor] = {}
        for name, part in self.parts.items():
            raw = buffer[offsets[name] : offsets[name] + rows * self.row_bytes[name]]
            if self.np_dtypes[name] is not None:
                out[name] = raw.view(self.np_dtypes[name]).reshape(rows, *part.shape)
            else:  # a torch-only dtype (bfloat16, ...)
                out[name] = torch.from_numpy(raw).view(self.dtypes[name]).view(rows, *part.shape)
        return out

    def tensors(self, buffer: np.ndarray, rows: int) -> dict[str, torch.Tensor]:
        return {
            n: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for n, v in self.unpack(buffer, rows).items()
        }

    def read(self, rows_indices: np.ndarray, buffer: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        rows = len(rows_indices)
        if buffer is None:  # numpy reuses freed blocks; a fresh torch.empty faults in new pages every batch
            buffer = np.empty(self.layout(rows)[1], dtype=np.uint8)
        valid = int(np.count_nonzero(rows_indices >= 0))
        idx = rows_indices[:valid]
        if np.any(rows_indices[valid:] >= 0):
            raise DataError("internal: padded rows must come last in a batch")
        nbytes = 0
        for name, field in self.unpack(buffer, rows).items():
            if valid:
                nbytes += self._read_field(name, idx, field[:valid])
            if valid < rows:
                field[valid:] = 0  # padded rows carry zeros, never stale memory
        return buffer, nbytes

    def _read_field(self, name: str, idx: np.ndarray, out: np.ndarray | torch.Tensor) -> int:
        part, source = self.parts[name], self.dataset.sources[name]
        if part.balanced is None:
            return source.read(idx, part.region, out)
        # A balanced part is two regions joined along its axis: each is read into its slot of the output.
        axis, at, nbytes = part.balanced[1] + 1, 0, 0
        for region in part.pieces:
            length = region[axis - 1].stop - region[axis - 1].start
            slot = out[(slice(None),) * axis + (slice(at, at + length),)]
            if source.kind == "numpy":  # numpy assigns into a strided slot directly
                nbytes += source.read(idx, region, slot)
            else:  # other sources may want a contiguous output
                tmp = torch.empty(slot.shape, dtype=self.dtypes[name])
                nbytes += source.read(idx, region, tmp if source.kind == "tensor" else tmp.numpy())
                slot[...] = tmp if isinstance(slot, torch.Tensor) else tmp.numpy()
            at += length
        return nbytes

    def __getitem__(self, rows_indices: np.ndarray) -> tuple[torch.Tensor, int]:
        buffer, nbytes = self.read(rows_indices)
        return torch.from_numpy(buffer), nbytes  # a tensor travels from a worker through shared memory

    def __len__(self) -> int:  # DataLoader asks; items are index arrays, not positions
        return 0


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


def _warn_partial_reads(dataset: ArrayDataset, parts: Mapping[str, FieldPart], topology: Topology) -> None:
    """One warning per field whose chunks are wider than a tile along a sharded axis: they are decoded whole."""
    for name, part in parts.items():
        source = dataset.sources[name]
        chunks = getattr(source, "chunks", None)
        if not chunks:
            continue
        wide = []
        for dim, axis in part.placements:
            if axis is None:
                continue
            tile = -(-part.sample_shape[axis] // topology.size(dim))
            if chunks[axis + 1] > tile:
                wide.append((axis, dim, tile))
        if not wide:
            continue
        factor = read_factor(source, part.region)  # a balanced part's pieces share one geometry
        better = list(chunks)
        for axis, _, tile in wide:
            better[axis + 1] = max(c for c in range(1, min(tile, 8) + 1) if tile % c == 0)
        where = ", ".join(f"axis {a} ({tile} cells a tile over {d!r})" for a, d, tile in wide)
        warnings.warn(
            f"field {name!r}: its {source.kind} chunks {tuple(chunks)} are wider than a tile along sample {where}, "
            f"and chunks are decoded whole: this rank reads {factor:.2f}x the bytes of its part. Rechunk, e.g. "
            f"chunks={tuple(better)} (Zarr: keep one sample a file with shards=(1, *sample shape)), to read its part "
            "only",
            DataWarning,
            stacklevel=4,
        )


def _stage_reads(topology: Topology, stage_fields: Mapping[str, Sequence[str]], dataset: ArrayDataset) -> set[str]:
    """The fields this rank reads: ``stage_fields["first"]`` on the first stage, ``["last"]`` on the last."""
    if not isinstance(stage_fields, Mapping) or set(stage_fields) - {"first", "last"}:
        raise DataError(f"stage_fields must map 'first'/'last' to field names, got {stage_fields!r}")
    wanted = {"first": topology.is_first_stage, "last": topology.is_last_stage}
    lists = {key: [fields] if isinstance(fields, str) else list(fields) for key, fields in stage_fields.items()}
    unknown = sorted({n for fields in lists.values() for n in fields} - set(dataset.names))
    if unknown:
        raise DataError(f"stage_fields names {unknown}; the dataset's fields are {dataset.names}")
    return {n for key, fields in lists.items() if wanted[key] for n in fields}


class MeshDataLoader(OptionsLoader, CursorLoader):
    """Iterate dict batches for this rank: fields ``[B_local, *part shape]``, ``valid`` (bool), ``index`` (int64).

    Build it with :func:`mesh_dataloader`. ``len()`` is the number of steps in an epoch (the same on every
    rank); ``state_dict()`` is the global cursor of :class:`MeshSampler`; ``bytes_read`` counts the bytes this
    rank read from storage for the batches handed out; ``parts[name]`` says where each field's part sits.
    """

    def _build(self, dataset: Any, topology: Topology | None, options: LoaderOptions) -> None:
        """Built from :class:`LoaderOptions` (see ``OptionsLoader``); ``collate_fn`` is refused."""
        if options.collate_fn is not None:
            raise DataError(
                "collate_fn= is for map-style datasets; array fields are fixed-shape and come as views of one buffer: "
                "post-process the batch dict instead"
            )
        if not isinstance(dataset, ArrayDataset):
            dataset = ArrayDataset(dataset)
        self.dataset = dataset
        topology = self._setup(topology, len(dataset), options)
        stage_fields = options.stage_fields
        parts = as_parts(options.parts, topology)  # a mapping, or a model that states its input_parts
        unknown = sorted(set(parts) - set(dataset.names))
        if unknown:
            raise DataError(f"parts names field(s) {unknown} that the dataset lacks; its fields are {dataset.names}")
        split = {d: (topology.coordinate(d), topology.size(d)) for d in topology.split_dims}
        mesh = topology.layout.dims_text()
        self.parts = {n: resolve_part(n, parts.get(n), dataset.sample_shape(n), split, mesh) for n in dataset.names}
        if stage_fields is not None:  # pipeline stages read only the fields they use (docs/pipeline.md)
            self.parts = {n: p for n, p in self.parts.items() if n in _stage_reads(topology, stage_fields, dataset)}
        _warn_partial_reads(dataset, self.parts, topology)
        self.positions = balanced_positions(self.parts, dataset.names)
        self._reader = _BatchReader(dataset, self.parts)
        note_loader(self)  # a dry run reports this loader's slice and parts (meshwise.dryrun)
        self._pool: list[np.ndarray] = []
        self._gathered: list[torch.Tensor] | None = None

    # ---- reading
    def _read_items(self, plan: list[np.ndarray]) -> list[np.ndarray] | None:
        """What this rank reads for each step: its rows (each), all rows (broadcast leader), 1/k (scatter)."""
        if self.read == "broadcast" and self.replica_rank != 0:
            return None
        if self.read != "scatter":
            return plan
        rows = self._scatter_rows()
        items = []
        for local in plan:
            chunk = local[self.replica_rank * rows : (self.replica_rank + 1) * rows]
            items.append(np.concatenate([chunk, np.full(rows - len(chunk), -1, dtype=np.int64)]))
        return items

    def _buffers(self, items: list[np.ndarray] | None, steps: int) -> Iterator[tuple[np.ndarray | None, int]]:
        if items is None:
            yield from ((None, 0) for _ in range(steps))
        elif self.num_workers == 0:
            yield from (self._reader.read(i, self._free_buffer(self._reader.layout(len(i))[1])) for i in items)
        else:
            yield from ((buffer.numpy(), nbytes) for buffer, nbytes in self._in_workers(self._reader, items))

    def _free_buffer(self, nbytes: int) -> np.ndarray:
        """A recycled batch buffer that no batch the user holds still points to (else a new one)."""
        for buffer in self._pool:
            # references: the pool, this loop variable and getrefcount's argument; any more is a live batch
            if len(buffer) == nbytes and sys.getrefcount(buffer) <= 3:
                return buffer
        buffer = np.empty(nbytes, dtype=np.uint8)
        if len(self._pool) < 4:
            self._pool.append(buffer)
        return buffer

    def _share(self, buffer: np.ndarray | None) -> dict[str, torch.Tensor]:
        b = self.local_batch_size
        if self.read == "each":
            return self._reader.tensors(buffer, b)
        group = self.topology.group(self.topology.replica_dims)
        if self.read == "broadcast":
            if buffer is None:
                buffer = np.empty(self._reader.layout(b)[1], dtype=np.uint8)
            dist.broadcast(torch.from_numpy(buffer), src=self._replica_ranks[0], group=group)
            return self._reader.tensors(buffer, b)
        rows = self._scatter_rows()
        if self._gathered is None or len(self._gathered[0]) != len(buffer):
            # reused every step: the batch below is a copy (torch.cat), so nothing handed out points here
            self._gathered = [torch.empty(len(buffer), dtype=torch.uint8) for _ in range(self.replica_size)]
        gathered = self._gathered
        dist.all_gather(gathered, torch.from_numpy(buffer), group=group)
        chunks = [self._reader.tensors(g.numpy(), rows) for g in gathered]
        return {n: torch.cat([c[n] for c in chunks])[:b] for n in self.parts}

    def _batches(self, token: object) -> Iterator[dict[str, torch.Tensor]]:
        plan, cursor = self.sampler.plan(), self._cursor()
        for local, (buffer, nbytes) in zip(plan, self._buffers(self._read_items(plan), len(plan))):
            if not self._may_hand_out(token, cursor):  # before the read strategy's collectives
                return
            batch = self._share(buffer)
            if self.positions is not None:  # one row per sample, so valid-row selection and micro-batches cut it
                batch["positions"] = self.positions.expand(len(local), -1)
            cursor = self._hand_out(batch, local, nbytes)
            yield batch
