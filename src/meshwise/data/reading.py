"""What the map-style and streaming loaders share to read a batch: the reader that collates samples and cuts this
rank's parts from the batch (:class:`SampleReader`, picklable for workers), the padding of rows past the data, the
checks of part specs, the token positions of balanced parts, and the wire format that sends any batch as one flat
buffer (:func:`encode`/:func:`decode`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from meshwise.data.collate import LABEL_PAD, as_fields, pad_collate
from meshwise.data.parts import FieldPart, PartSpec, Replicate, Shard, resolve_part
from meshwise.errors import DataError

__all__ = [
    "SampleReader",
    "balanced_positions",
    "blank_padding",
    "check_specs",
    "decode",
    "encode",
    "is_hf_dataset",
    "positions_of",
]


_ALIGN = 64


def is_hf_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.Dataset`` (checked without importing ``datasets``)."""
    return any(c.__module__.startswith("datasets.") and c.__name__ == "Dataset" for c in type(dataset).__mro__)


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
class SampleReader:
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
            blank_padding(batch, valid, len(rows))
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


def blank_padding(batch: Any, valid: int, rows: int) -> None:
    """Padded rows carry zeros (``labels``: -100), never a repeated sample that a loss could count."""
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, list) else ()
    for name, value in items:
        if isinstance(value, torch.Tensor) and value.dim() and len(value) == rows:
            value[valid:] = LABEL_PAD if name == "labels" else 0


def check_specs(specs: Mapping[str, PartSpec], split: Mapping[str, tuple[int, int]], mesh: str) -> None:
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


def positions_of(parts: Mapping[str, FieldPart], batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The token positions of this batch's balanced parts (the array road's check that they agree)."""
    if not parts:
        return None
    return balanced_positions(parts, tuple(batch))


def balanced_positions(parts: Mapping[str, FieldPart], names: Sequence[str]) -> torch.Tensor | None:
    """The token positions of this rank's balanced parts (every balanced field must agree), or ``None``."""
    balanced = {n: p for n, p in parts.items() if p.balanced is not None}
    if not balanced:
        return None
    if "positions" in names:
        raise DataError(
            "a balanced Shard adds batch['positions'] (the global index of each loaded token), but the dataset "
            "already has a field 'positions': rename that field"
        )
    first, part = next(iter(balanced.items()))
    dim, axis = part.balanced
    for name, other in parts.items():
        axes = dict(other.placements)
        if name == first or axes.get(dim) is None:
            continue
        their = other.balanced or (dim, axes[dim])
        n, m = part.sample_shape[axis], other.sample_shape[their[1]]
        if other.balanced is None or their[1] != axis or n != m:
            raise DataError(
                f"split dim {dim!r} splits the windows two ways (two axes or two orders): field {first!r} is split "
                f"balanced along axis {axis} "
                f"({n} cells), field {name!r} {'balanced' if other.balanced else 'in plain chunks'} along axis "
                f"{their[1]} ({m} cells); the tokens of a window must be split one way: give every field sharded over "
                f"{dim!r} Shard({axis}, dim={dim!r}, balanced=True) on windows of the same length"
            )
    return part.positions()
