"""Array sources that read only a region of chosen samples: numpy arrays and ``.npy`` memmaps, Zarr, HDF5, tensors.

Each read fills a preallocated output and returns the bytes it took from storage: the bytes of the region
for memmaps, contiguous HDF5 datasets and in-memory arrays; the (uncompressed) bytes of every chunk touched
for chunked Zarr arrays and chunked HDF5 datasets, since those are read whole.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshwise.errors import DataError

__all__ = [
    "ArrayDataset",
    "HDF5Source",
    "NumpySource",
    "Source",
    "TensorSource",
    "ZarrSource",
    "as_source",
    "chunk_bytes",
    "read_factor",
    "torch_dtype",
]

RESERVED = ("valid", "index")
_SMALL_ROW = 1 << 16  # below this many bytes a row, one fancy-indexing read beats a Python loop over rows


def torch_dtype(dtype: Any) -> torch.dtype:
    """The dtype a field is delivered in: numpy's torch twin; unsigned ints wider than 8 bits become int64."""
    if isinstance(dtype, torch.dtype):
        return torch.int64 if dtype in (torch.uint16, torch.uint32, torch.uint64) else dtype
    dtype = np.dtype(dtype)
    if dtype.kind == "u" and dtype.itemsize > 1:
        return torch.int64  # embedding and loss kernels take int64 indices; uint16 token files are common
    try:
        return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
    except TypeError:
        raise DataError(f"dtype {dtype} has no torch equivalent: convert the array (e.g. to float32)") from None


def _run(idx: np.ndarray) -> tuple[int, int] | None:
    """``(start, stop)`` when ``idx`` is one increasing run of consecutive indices."""
    if len(idx) and int(idx[-1]) - int(idx[0]) == len(idx) - 1 and (len(idx) == 1 or bool(np.all(np.diff(idx) == 1))):
        return int(idx[0]), int(idx[-1]) + 1
    return None


def chunk_bytes(
    shape: Sequence[int], chunks: Sequence[int], idx: np.ndarray, region: Sequence[slice], itemsize: int
) -> int:
    """Bytes of every chunk that rows ``idx`` x ``region`` touch (chunks are read whole)."""
    c0, n0 = chunks[0], shape[0]
    touched = np.unique(idx // c0)
    total = int(np.sum(np.minimum(c0 * (touched + 1), n0) - c0 * touched))
    for s, c, n in zip(region, chunks[1:], shape[1:]):
        if s.stop <= s.start:
            return 0
        j0, j1 = s.start // c, (s.stop - 1) // c
        total *= min(c * (j1 + 1), n) - c * j0
    return total * itemsize


class Source:
    """One field: ``shape`` (axis 0 = samples), ``dtype``, and ``read(idx, region, out) -> bytes``.

    ``out`` is a numpy array (or, for torch-only dtypes such as bfloat16, a tensor) of ``len(idx)`` rows.
    """

    shape: tuple[int, ...]
    dtype: Any
    kind = "source"

    def read(self, idx: np.ndarray, region: tuple[slice, ...], out: Any) -> int:
        raise NotImplementedError

    def read_into(self, idx: np.ndarray, region: tuple[slice, ...], out: Any, at: np.ndarray) -> int:
        """Rows ``idx`` into the rows ``at`` of ``out`` (a mixture's batch joins rows of several sources)."""
        shape = (len(at), *out.shape[1:])
        buf = np.empty(shape, out.dtype) if isinstance(out, np.ndarray) else torch.empty(shape, dtype=out.dtype)
        nbytes = self.read(idx, region, buf)
        out[at] = buf
        return nbytes

    def __len__(self) -> int:
        return self.shape[0]


class NumpySource(Source):
    """A numpy array or memmap; a ``.npy`` path is opened with ``mmap_mode="r"`` in each process that reads."""

    kind = "numpy"

    def __init__(self, array: np.ndarray | None = None, path: str | os.PathLike | None = None) -> None:
        self.path = None if path is None else str(path)
        self._array = array
        if array is None:
            array = self.array
        self.shape, self.dtype = tuple(array.shape), array.dtype

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            try:
                self._array = np.load(self.path, mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise DataError(f"cannot open {self.path} as a .npy array: {exc}") from exc
        return self._array

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "_views": {}}
        if self.path is not None:
            state["_array"] = None  # a worker reopens the memmap instead of receiving its pages
        return state

    def _view(self, region: tuple[slice, ...]) -> np.ndarray:
        views = self.__dict__.setdefault("_views", {})
        key = tuple((s.start, s.stop) for s in region)
        if key not in views:
            # a plain ndarray view of the memmap: slicing an np.memmap runs Python code on every access
            views[key] = np.asarray(self.array)[(slice(None), *region)]
        return views[key]

    def read(self, idx: np.ndarray, region: tuple[slice, ...], out: Any) -> int:
        view = self._view(region)  # a view: nothing is read yet
        dst = out
        run = _run(idx)
        if run is not None:
            dst[...] = view[run[0] : run[1]]
        elif dst[0].nbytes < _SMALL_ROW:
            dst[...] = view[idx]
        else:
            for j, i in enumerate(idx.tolist()):
                dst[j] = view[i]
        return len(idx) * math.prod(view.shape[1:]) * self.dtype.itemsize

    def read_into(self, idx: np.ndarray, region: tuple[slice, ...], out: Any, at: np.ndarray) -> int:
        """As :meth:`read`, into the rows ``at`` of ``out``, with no batch buffer between (as many copies)."""
        if not isinstance(out, np.ndarray):
            return super().read_into(idx, region, out, at)
        view = self._view(region)
        if out[0].nbytes < _SMALL_ROW:
            out[at] = view[idx]
        else:
            for j, i in zip(at.tolist(), idx.tolist()):
                out[j] = view[i]
        return len(idx) * math.prod(view.shape[1:]) * self.dtype.itemsize


class TensorSource(Source):
    """An in-memory (CPU) torch tensor."""

    kind = "tensor"

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise DataError(f"tensor fields must live on the CPU (got {tensor.device}): the loader moves nothing")
        self.tensor = tensor
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def read(self, idx: np.ndarray, region: tuple[slice, ...], out: Any) -> int:
        if isinstance(out, np.ndarray):
            out = torch.from_numpy(out)
        view = self.tensor[(slice(None), *region)]
        run = _run(idx)
        if run is not None:
            out.copy_(view[run[0] : run[1]])
        elif out.dtype == view.dtype:
            torch.index_select(view, 0, torch.from_numpy(idx), out=out)
        else:
            out.copy_(view.index_select(0, torch.from_numpy(idx)))
        return len(idx) * math.prod(view.shape[1:]) * self.tensor.element_size()


class ZarrSource(Source):
    """A Zarr array; only the chunks that the region touches are read (counted whole, uncompressed)."""

    kind = "zarr"

    def __init__(self, array: Any) -> None:
        self.array = array
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.chunks = tuple(array.chunks)

    def read(self, idx: np.ndarray, region: tuple[slice, ...], out: Any) -> int:
        run = _run(idx)
        if run is not None:
            out[...] = self.array[(slice(*run), *region)]
        else:  # one basic selection a sample: faster in zarr 3 than one orthogonal selection over all rows
            for j, i in enumerate(idx.tolist()):
                out[j] = self.array[(i, *region)]
        return chunk_bytes(self.shape, self.chunks, idx, region, self.dtype.itemsize)


class HDF5Source(Source):
    """An h5py dataset, reopened lazily by (file, name) in each process that reads (h5py handles do not fork)."""

    kind = "hdf5"

    def __init__(self, dataset: Any) -> None:
        self.filename, self.name = str(dataset.file.filename), dataset.name
        self.shape, self.dtype = tuple(dataset.shape), np.dtype(dataset.dtype)
        self.chunks = tuple(dataset.chunks) if dataset.chunks else None
        self._pid: int | None = None
        self._file: Any = None
        self._dataset: Any = None

    @property
    def dataset(self) -> Any:
        if self._pid != os.getpid():
            import h5py

            self._file = h5py.File(self.filename, "r")
            self._dataset = self._file[self.name]
            self._pid = os.getpid()
        return self._dataset

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pid": None, "_file": None, "_dataset": None}

    def read(self, idx: np.ndarray, region: tuple[slice, ...], out: Any) -> int:
        ds = self.dataset
        run = _run(idx)
        dst = out
        if run is not None:
            dst[...] = ds[(slice(*run), *region)]
        else:
            # h5py selects increasing, unique indices only: read those, then put the rows in batch order
            unique, inverse = np.unique(idx, return_inverse=True)
            dst[...] = ds[(unique.tolist(), *region)][inverse]
        if self.chunks:
            return chunk_bytes(self.shape, self.chunks, idx, region, self.dtype.itemsize)
        return len(idx) * math.prod(s.stop - s.start for s in region) * self.dtype.itemsize


def _zarr_source(name: str, node: Any, where: str) -> Source:
    """A Zarr array as a source; a Zarr group is a ``DataError`` that names its arrays."""
    import zarr

    if isinstance(node, zarr.Group):
        arrays = sorted(node.array_keys())
        hint = f"pass group[{arrays[0]!r}] or the folder {where}/{arrays[0]}" if arrays else "it holds no arrays"
        raise DataError(f"field {name!r}: {where} is a Zarr group (arrays: {arrays}), not an array: {hint}")
    return ZarrSource(node)


def _path_source(name: str, value: str | os.PathLike) -> Source:
    path = Path(value)
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative to the working directory {os.getcwd()})"
        raise DataError(f"field {name!r}: the path {str(value)!r} does not exist{where}: check the path")
    if path.suffix == ".npy":
        return NumpySource(path=path)
    if path.is_dir() and any((path / m).exists() for m in ("zarr.json", ".zarray", ".zgroup")):
        import zarr

        return _zarr_source(name, zarr.open(str(path), mode="r"), repr(str(value)))
    if path.suffix in (".h5", ".hdf5", ".hdf"):
        raise DataError(
            f"field {name!r}: {str(value)!r} is an HDF5 file, which holds several datasets: pass "
            "h5py.File(path, 'r')['<dataset>']"
        )
    raise DataError(
        f"field {name!r}: cannot read {value!r}; give a .npy path, a Zarr array folder, a numpy array, "
        "a torch tensor, a zarr.Array or an h5py.Dataset"
    )


def as_source(name: str, value: Any) -> Source:
    """Wrap one field's array-like as a :class:`Source` (see :class:`ArrayDataset`)."""
    if isinstance(value, Source):
        return value
    if isinstance(value, torch.Tensor):
        return TensorSource(value)
    if isinstance(value, np.ndarray):
        return NumpySource(value)
    if isinstance(value, (str, os.PathLike)):
        return _path_source(name, value)
    module = type(value).__module__
    if module.startswith("zarr"):
        return _zarr_source(name, value, "the object passed")
    if module.startswith("h5py"):
        import h5py

        if isinstance(value, h5py.Group):
            keys = sorted(value.keys())
            raise DataError(
                f"field {name!r}: HDF5 {value.name!r} is a group (members: {keys}), not a dataset: pass "
                f"group[{keys[0] if keys else '<dataset>'!r}]"
            )
        return HDF5Source(value)
    raise DataError(
        f"field {name!r} has type {type(value).__name__}: give a numpy array, a .npy path, a torch tensor, "
        "a zarr.Array or an h5py.Dataset"
    )


def read_factor(source: Source, region: Sequence[slice]) -> float:
    """Bytes a read of ``region`` of one sample takes from storage over the region's own bytes (1.0: no waste).

    Only chunked sources (Zarr, chunked HDF5) waste: their chunks are decoded whole. Axis 0 (samples) is left out.
    """
    chunks = getattr(source, "chunks", None)
    cells = math.prod(s.stop - s.start for s in region)
    if not chunks or not cells:
        return 1.0
    itemsize = np.dtype(source.dtype).itemsize
    shape = (1, *source.shape[1:])
    return chunk_bytes(shape, (1, *chunks[1:]), np.zeros(1, np.int64), region, itemsize) / (cells * itemsize)


class ArrayDataset:
    """Named array fields that share axis 0 (the sample axis); reads only the requested part of each sample.

    ``ArrayDataset({"input": "x.npy", "target": zarr_array})`` takes numpy arrays (memmaps included),
    ``.npy`` paths (opened with ``mmap_mode="r"``), Zarr arrays (or their folder), h5py datasets and CPU tensors.
    """

    def __init__(self, fields: Mapping[str, Any]) -> None:
        if not isinstance(fields, Mapping) or not fields:
            raise DataError("ArrayDataset needs a non-empty mapping field name -> array")
        clash = [k for k in fields if k in RESERVED]
        if clash:
            raise DataError(f"field names {clash} are reserved for the loader's batch keys {RESERVED}: rename them")
        self.sources: dict[str, Source] = {}
        for name, value in fields.items():
            src = as_source(name, value)
            if len(src.shape) < 1:
                raise DataError(f"field {name!r} is a scalar: axis 0 must be the sample axis")
            self.sources[name] = src
        lengths = {k: s.shape[0] for k, s in self.sources.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"fields have different numbers of samples {lengths}: axis 0 must be the sample axis")
        self.length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self.length

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.sources)

    def sample_shape(self, name: str) -> tuple[int, ...]:
        return self.sources[name].shape[1:]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """The full sample ``index`` (every field, no parts): a convenience and a test oracle."""
        out = {}
        for name, src in self.sources.items():
            t = torch.empty(1, *src.shape[1:], dtype=torch_dtype(src.dtype))
            dst = t if src.kind == "tensor" else t.numpy()
            src.read(np.array([index], dtype=np.int64), tuple(slice(0, n) for n in src.shape[1:]), dst)
            out[name] = t[0]
        return out
