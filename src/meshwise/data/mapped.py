"""The loader of map-style sources: a torch ``Dataset`` or a Hugging Face ``datasets.Dataset``, read by index.

Samples are read whole and joined by a collate function, so fields may vary in length from sample to sample.
The sampler is the same :class:`MeshSampler` as for arrays: the global cursor, its resume at another
data-parallel size and exact eval come with it. A replica group reads its batch with the array road's
strategies (``each``/``broadcast``/``scatter``), sending tensors in one flat buffer; ``parts=`` cuts the
collated batch along the split dims with the array road's part arithmetic (balanced token chunks included).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshwise.data.collate import LABEL_PAD, as_fields, pad_collate
from meshwise.data.parts import FieldPart, PartSpec, Replicate, Shard, as_parts, resolve_part
from meshwise.data.sampler import CursorLoader
from meshwise.dryrun import note_loader
from meshwise.errors import DataError
from meshwise.topology import Topology

__all__ = ["MeshSampleLoader", "check_map_style", "decode", "encode", "is_hf_dataset"]

_STREAMING = (
    "streaming (iterable) datasets are not supported yet: the global cursor needs random access. Materialise it "
    "(a datasets.Dataset, e.g. IterableDataset.take(n) then Dataset.from_generator, or save_to_disk/load_from_disk), "
    "or shard it yourself with datasets.distributed.split_dataset_by_node(ds, rank=topo.data_rank, "
    "world_size=topo.data_size) and a plain torch DataLoader"
)
_ALIGN = 64


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


# ---- the wire format: any picklable object, its tensors and numpy arrays as raw bytes in one flat buffer
def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[tuple[int, torch.Tensor]] = []
        self.size = 0

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor and obj.device.type == "cpu":
            flat, kind, dtype = obj.detach().contiguous().reshape(-1), "t", obj.dtype
        elif isinstance(obj, np.ndarray) and type(obj) is np.ndarray and obj.dtype.kind in "biufc":
            flat, kind, dtype = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1)), "n", obj.dtype.str
        else:
            return None
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        at, self.size = self.size, _aligned(self.size + raw.numel())
        self.arrays.append((at, raw))
        return (kind, at, raw.numel(), dtype, tuple(obj.shape))


def encode(obj: Any) -> torch.Tensor:
    """``obj`` as one uint8 tensor: a pickle whose tensors/arrays sit as raw bytes after it (no per-tensor pickle)."""
    file = io.BytesIO()
    pickler = _Pickler(file)
    pickler.dump(obj)
    head = file.getvalue()
    start = _aligned(8 + len(head))
    out = torch.empty(start + pickler.size, dtype=torch.uint8)
    out[:8] = torch.tensor([len(head)], dtype=torch.int64).view(torch.uint8)
    out[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    for at, raw in pickler.arrays:
        out[start + at : start + at + raw.numel()] = raw
    return out


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, data: torch.Tensor) -> None:
        super().__init__(file)
        self.data = data

    def persistent_load(self, pid: Any) -> Any:
        kind, at, nbytes, dtype, shape = pid
        raw = self.data[at : at + nbytes]
        if kind == "t":
            return (raw.view(dtype) if nbytes else torch.empty(0, dtype=dtype)).view(shape)
        return raw.numpy().view(np.dtype(dtype)).reshape(shape)


def decode(buffer: torch.Tensor) -> Any:
    """The object :func:`encode` wrote; its tensors and arrays are views into ``buffer`` (no copy)."""
    n = int(buffer[:8].view(torch.int64))
    head = buffer[8 : 8 + n].numpy().tobytes()
    return _Unpickler(io.BytesIO(head), buffer[_aligned(8 + n) :]).load()


# ---- reading, collating and cutting one batch
class _SampleReader:
    """Reads rows by index, collates a batch and cuts this rank's parts from it; picklable for workers.

    Items: ``("batch", rows)`` -> ``(batch, parts)`` with ``rows`` a local batch (``-1`` = padding, at the end);
    ``("chunk", rows, first)`` -> the encoded samples of the valid rows of a scatter chunk (``first``: the chunk
    that also carries the filler sample when the whole batch is padding).
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any] | None,
        specs: Mapping[str, PartSpec],
        split: Mapping[str, tuple[int, int]],
        mesh: str,
    ) -> None:
        self.dataset = dataset
        self.default = collate_fn is None
        self.collate_fn = pad_collate if collate_fn is None else collate_fn
        self.specs, self.split, self.mesh = dict(specs), dict(split), mesh
        self.hf = is_hf_dataset(dataset)

    def samples(self, idx: np.ndarray) -> list[Any]:
        if not len(idx):
            return []
        if self.hf:
            # One batched Arrow take of just these rows (the table stays memory-mapped); Python-formatted rows keep
            # token ids as Python ints, which collate turns into int64.
            columns = self.dataset[idx.tolist()]
            return [{k: v[i] for k, v in columns.items()} for i in range(len(idx))]
        return [self.dataset[int(i)] for i in idx]

    def valid_samples(self, rows: np.ndarray, filler: bool) -> list[Any]:
        """The samples of the valid rows; with ``filler`` and no valid row, sample 0 (padding must look like data)."""
        idx = rows[rows >= 0]
        return self.samples(idx if len(idx) or not filler else np.zeros(1, dtype=np.int64))

    def batch(self, got: list[Any], rows: np.ndarray) -> tuple[Any, dict[str, FieldPart]]:
        """Collate ``got`` (the valid rows' samples, or one filler) into the batch of ``rows``, cut to its parts."""
        valid = int(np.count_nonzero(rows >= 0))
        if np.any(rows[valid:] >= 0):
            raise DataError("internal: padded rows must come last in a batch")
        # Padded rows repeat a real sample so that the collate sees full-size shapes; they are zeroed below.
        samples = got[:valid] + [got[0]] * (len(rows) - valid)
        batch = self.collate_fn(samples)
        if valid < len(rows):
            _blank(batch, valid, len(rows))
        if not self.specs:
            return batch, {}
        return self.cut(batch if isinstance(batch, dict) else as_fields(batch))

    def cut(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, FieldPart]]:
        """This rank's part of each field named in ``parts``, with the array road's arithmetic (``resolve_part``)."""
        parts = {}
        for name, spec in self.specs.items():
            value = batch.get(name)
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                what = "missing" if value is None else f"a {type(value).__name__} of shape {_shape(value)}"
                raise DataError(
                    f"parts names field {name!r}, but the collated batch has it {what}; a part cuts a tensor "
                    f"[B, *sample] along a sample axis (the batch's fields: {sorted(batch)})"
                )
            if self.default:
                value = self._pad_balanced(name, spec, value)
            parts[name] = part = resolve_part(name, spec, tuple(value.shape[1:]), self.split, self.mesh)
            pieces = [value[(slice(None), *region)] for region in part.regions]
            batch[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=part.balanced[1] + 1)
        return batch, parts

    def _pad_balanced(self, name: str, spec: PartSpec, value: torch.Tensor) -> torch.Tensor:
        """pad_collate pads to the batch's longest sample; a balanced axis must cut into ``2k`` equal chunks."""
        for shard in [spec] if isinstance(spec, Shard) else spec if isinstance(spec, Sequence) else ():
            if not shard.balanced:
                continue
            dim = shard.dim or next(iter(self.split), None)
            if dim not in self.split:
                continue  # resolve_part says what is wrong with the dim
            axis = shard.axis % (value.dim() - 1) + 1
            chunks = 2 * self.split[dim][1]
            short = -value.shape[axis] % chunks
            if short:  # the same fill as pad_collate's: labels -100, every other field 0
                pad = [0, 0] * (value.dim() - axis - 1) + [0, short]
                value = torch.nn.functional.pad(value, pad, value=LABEL_PAD if name == "labels" else 0)
        return value

    def __getitem__(self, item: tuple) -> Any:
        if item[0] == "chunk":
            return encode(self.valid_samples(item[1], item[2]))
        return self.batch(self.valid_samples(item[1], True), item[1])

    def __len__(self) -> int:  # DataLoader asks; items are index arrays, not positions
        return 0


def _shape(value: Any) -> list[int] | str:
    return list(value.shape) if hasattr(value, "shape") else "(no shape)"


def _blank(batch: Any, valid: int, rows: int) -> None:
    """Padded rows carry zeros (``labels``: -100), never a repeated sample that a loss could count."""
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, list) else ()
    for name, value in items:
        if isinstance(value, torch.Tensor) and value.dim() and len(value) == rows:
            value[valid:] = LABEL_PAD if name == "labels" else 0


def _check_specs(specs: Mapping[str, PartSpec], split: Mapping[str, tuple[int, int]], mesh: str) -> None:
    """Refuse bad part specs when the loader is built (same verdict on every rank), before any sample is read.

    Sample shapes are known only per batch, so the specs are resolved against a stand-in shape that every
    well-formed spec fits: wrong types, unknown or ambiguous dims and two shards on one dim fail here.
    """
    for name, spec in specs.items():
        shards = [spec] if isinstance(spec, Shard) else list(spec) if isinstance(spec, (list, tuple)) else None
        if spec is not None and not isinstance(spec, Replicate) and shards is None:
            resolve_part(name, spec, (1,), split, mesh)  # raises the array road's message
        shards = [s for s in shards or () if isinstance(s, Shard)]
        ndim = max([s.axis + 1 if s.axis >= 0 else -s.axis for s in shards], default=1)
        cells = 2 * max([size for _, size in split.values()], default=1) * (1 + max([s.halo for s in shards] or [0]))
        resolve_part(name, spec, (cells,) * ndim, split, mesh)


class MeshSampleLoader(CursorLoader):
    """Dict batches of a map-style source for this rank: collated fields ``[B_local, ...]``, ``valid``, ``index``.

    Built by :func:`meshwise.data.mesh_dataloader` for a torch ``Dataset`` or a ``datasets.Dataset``. The same
    cursor API as :class:`MeshDataLoader` (``len``, ``set_epoch``, ``state_dict``, ``load_state_dict``) and the
    same read strategies; ``parts`` cuts the collated batch (``loader.parts``: the parts of the last batch).
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
        parts: Mapping[str, PartSpec] | Any = None,
        read: str = "each",
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        stage_fields: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        check_map_style(dataset)
        if stage_fields is not None:
            raise DataError(
                "stage_fields= is for array fields, whose parts are read from storage; map-style samples are read "
                "whole, so every stage would read them all anyway: drop stage_fields (or give an ArrayDataset)"
            )
        self.dataset = dataset
        topology = self._setup(
            topology,
            len(dataset),
            global_batch_size=global_batch_size,
            mode=mode,
            seed=seed,
            drop_last=drop_last,
            read=read,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context,
        )
        specs = as_parts(parts, topology)  # a mapping, or a model that states its input_parts
        split = {d: (topology.coordinate(d), topology.size(d)) for d in topology.split_dims}
        mesh = topology.layout.dims_text()
        _check_specs(specs, split, mesh)
        self.specs = specs
        self.parts: dict[str, FieldPart] = {}
        self._reader = _SampleReader(dataset, collate_fn, specs, split, mesh)
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
            positions = _positions(parts, batch)
            if positions is not None:
                batch["positions"] = positions.expand(len(local), -1)
            batch["valid"] = torch.from_numpy(local >= 0)
            batch["index"] = torch.from_numpy(local.copy())
            self.parts = parts
            self.bytes_read += nbytes
            self.sampler.advance()  # the cursor counts batches handed out, not batches prefetched
            cursor = self._cursor()
            yield batch

    def __repr__(self) -> str:
        return (
            f"MeshSampleLoader({len(self.dataset)} samples, global batch {self.sampler.global_batch_size}, "
            f"local {self.local_batch_size}, mode {self.sampler.mode!r}, read {self.read!r}, {len(self)} steps)"
        )


def _positions(parts: Mapping[str, FieldPart], batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The token positions of this batch's balanced parts (the array road's check that they agree)."""
    if not parts:
        return None
    from meshwise.data.loader import balanced_positions  # loader.py imports this module

    return balanced_positions(parts, tuple(batch))


def _tensor_bytes(batch: Any) -> int:
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))
