"""Reading a checkpoint's files as data, never as code, and keeping every path read inside the checkpoint.

A checkpoint folder may come from anywhere (a shared file system, a colleague's run, a download), and a pickle runs
whatever its bytes name. So: DCP's ``.metadata`` is unpickled by an allowlist of the classes DCP's metadata is made
of; DCP's byte values and every torch file are read with ``torch.load(weights_only=True)``; meshwise's small states
are JSON (:func:`encode_json`/:func:`decode_json`); a file name read from a checkpoint (``latest``, a step folder,
a shard named in ``.metadata``, a symlink) must stay inside its folder. Full pickle only with ``trust=True``, and the
error that asks for it names the file and what it holds (docs/checkpoint.md, "Security").
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta

from meshwise import compat
from meshwise.checkpoint.protocol import DCP_META, OBJECTS_DIR
from meshwise.errors import CheckpointError

__all__ = [
    "TRUST_HINT",
    "SafeLoadPlanner",
    "SafeReader",
    "check_byte_values",
    "decode_json",
    "encode_json",
    "inside",
    "object_file",
    "read_dcp_metadata",
    "read_torch_file",
]

TRUST_HINT = (
    "meshwise does not unpickle it: a pickle can run any code its bytes name. Load it with trust=True only if you "
    "trust where this checkpoint came from (the folder and everyone who could write to it)"
)


# --------------------------------------------------------------------------- paths


def inside(folder: Path, path: Path) -> Path:
    """``path``, once it is checked to lead (through any symlink) to ``folder`` or below it; else a
    :class:`CheckpointError`, before anything is read or written there."""
    root, real = os.path.realpath(folder), os.path.realpath(path)
    if real != root and os.path.commonpath([root, real]) != root:
        raise CheckpointError(
            f"{path} leads outside the checkpoint folder {folder} (to {real}): a checkpoint's files and names must "
            "stay inside it; refused, nothing was read or written"
        )
    return path


def _plain_name(name: str) -> bool:
    """One file or folder name: no separator, not '.' or '..', not empty."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def object_file(folder: Path, name: str) -> Path | None:
    """The file of object ``name``'s saved state in checkpoint ``folder``: ``objects/<name>.json`` (JSON, this
    format), else ``objects/<name>.pt`` (a torch file: a state JSON cannot hold, or an earlier format); None when
    neither is there."""
    if not _plain_name(name) or name.startswith("."):
        raise CheckpointError(f"{name!r} cannot name a saved object: a single name without '/' or a leading '.'")
    for suffix in (".json", ".pt"):
        path = folder / OBJECTS_DIR / f"{name}{suffix}"
        if path.is_file() or path.is_symlink():
            return inside(folder, path)
    return None


# --------------------------------------------------------------------------- JSON states

_TAG = "__meshwise__"


class NotJSON(TypeError):
    """A state holds a value meshwise's JSON encoding does not keep exactly."""


def _encode(value: Any) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, str, float):
        return value
    if kind is list:
        return [_encode(v) for v in value]
    if kind is tuple:
        return {_TAG: "tuple", "items": [_encode(v) for v in value]}
    if kind is dict and _TAG not in value and all(type(k) is str for k in value):
        return {k: _encode(v) for k, v in value.items()}
    if kind in (dict, OrderedDict):
        tag = "odict" if kind is OrderedDict else "dict"
        return {_TAG: tag, "items": [[_encode(k), _encode(v)] for k, v in value.items()]}
    raise NotJSON(kind.__name__)


def _decode(obj: dict[str, Any]) -> Any:
    tag = obj.get(_TAG)
    if tag is None:
        return obj
    items = obj.get("items")
    if not isinstance(items, list) or len(obj) != 2:
        raise ValueError(f"a {_TAG} entry needs exactly 'items', a list")
    if tag == "tuple":
        return tuple(items)
    pairs = [(_hashable(k), v) for k, v in (_pair(i) for i in items)]
    if tag == "odict":
        return OrderedDict(pairs)
    if tag == "dict":
        return dict(pairs)
    raise ValueError(f"unknown {_TAG} tag {tag!r}")


def _pair(item: Any) -> tuple[Any, Any]:
    if not isinstance(item, list) or len(item) != 2:
        raise ValueError("a mapping's items must be [key, value] pairs")
    return item[0], item[1]


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise ValueError(f"a mapping key cannot be a {type(key).__name__}")
    return key


def encode_json(state: Any) -> str | None:
    """``state`` as JSON text that :func:`decode_json` gives back equal and of the same types (dicts, lists,
    tuples, OrderedDicts, str, int, float, bool, None); None when it holds anything else (a tensor, a numpy value,
    an object of its own), which is then saved as a torch file."""
    try:
        return json.dumps(_encode(state), separators=(",", ":"))
    except (NotJSON, RecursionError, ValueError):
        return None


def decode_json(text: str) -> Any:
    """What :func:`encode_json` wrote: plain data only (json builds no object of another kind)."""
    return json.loads(text, object_hook=_decode)


# --------------------------------------------------------------------------- torch files and byte values


def _numpy_globals() -> list:
    try:
        return compat.numpy_array_globals()
    except ImportError:  # pragma: no cover - numpy is a dependency of torch's tests, not of torch
        return []


def _refusal(exc: BaseException) -> str | None:
    """What torch's weights-only unpickler refused (its error's reason), or None for another failure."""
    text = str(exc)
    if "weights_only" not in text and "WeightsUnpickler" not in text:
        return None
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if found:
        return f"a pickle that names {found.group(1)}"
    found = re.search(r"(Unsupported operand[^\n]*?|Can only build[^\n]*?)(?=\.? Please|\.?$|\n)", text, re.MULTILINE)
    return (
        f"a pickle torch's weights-only reader refuses ({found.group(1).strip()})" if found else "a pickle of objects"
    )


def load_torch_bytes(data: bytes | io.BytesIO, what: str, trust: bool) -> Any:
    """A ``torch.save`` archive read with ``weights_only=True`` (numpy arrays allowed: data only); with ``trust`` a
    refused one is read with full pickle. ``what`` names the file (and key) in the error."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(stream, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - classified below
        reason = _refusal(exc)
        if reason is None:
            raise CheckpointError(f"{what} cannot be read ({type(exc).__name__}: {exc}): it is damaged") from exc
        if not trust:
            raise CheckpointError(f"{what} holds {reason}; {TRUST_HINT}") from None
    stream.seek(0)
    return torch.load(stream, weights_only=False, map_location="cpu")


def read_torch_file(folder: Path, path: Path, trust: bool) -> Any:
    """A torch file of checkpoint ``folder`` (an object's state, an RNG file), read as :func:`load_torch_bytes`
    does, once ``path`` is checked to stay inside ``folder``."""
    inside(folder, path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from exc
    return load_torch_bytes(data, str(path), trust)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, whose byte values (optimizer hyperparameters, a module's extra state) are read
    with ``weights_only=True``, not DCP's full ``torch.load``; ``trust``: a refused one with full pickle.

    ``decoded`` maps a value's bytes to what they held (filled by :func:`check_byte_values` before the load, and
    here): equal values are stored as equal bytes (every parameter's ``lr``), so each is decoded once.
    """

    def __init__(self, folder: Path, trust: bool = False, decoded: dict[bytes, Any] | None = None) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.trust = trust
        self.decoded = decoded if decoded is not None else {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        info = self.metadata.storage_data[read_item.storage_index] if self.metadata is not None else None
        where = f"{self.folder / info.relative_path if info is not None else self.folder} (key {fqn!r})"
        obj = _decoded(self.decoded, value.getvalue(), where, self.trust)
        if self.flatten_state_dict:  # DefaultLoadPlanner.load_bytes' own placement, without its full torch.load
            target, path = self.original_state_dict, self.mappings[fqn]
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = obj
        else:
            self.state_dict[fqn] = obj


def _decoded(cache: dict[bytes, Any], data: bytes, where: str, trust: bool) -> Any:
    if data not in cache:
        cache[data] = load_torch_bytes(data, where, trust)
    value = cache[data]
    return value if isinstance(value, (int, float, bool, str, type(None))) else copy.deepcopy(value)


def check_byte_values(
    folder: Path, md: Metadata, keys: Any, trust: bool, decoded: dict[bytes, Any] | None = None
) -> None:
    """Read every byte value among ``keys`` (DCP's flat keys) as :class:`SafeLoadPlanner` will: a refused one
    raises, naming its shard file and key, before anything is loaded. ``decoded`` keeps what was read."""
    if trust:
        return
    cache = decoded if decoded is not None else {}
    wanted = sorted(k for k in keys if isinstance(md.state_dict_metadata.get(k), BytesStorageMetadata))
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for key in wanted:
        info = (md.storage_data or {}).get(MetadataIndex(key))
        if info is not None and not info.transform_descriptors:  # a transformed stream: decoded by the planner
            by_file.setdefault(info.relative_path, []).append((key, info))
    for rel, items in by_file.items():
        shard = inside(folder, folder / rel)
        with open(shard, "rb") as f:
            for key, info in items:
                f.seek(info.offset)
                _decoded(cache, f.read(info.length), f"{shard} (key {key!r})", trust)


# --------------------------------------------------------------------------- DCP's metadata

# What DCP's .metadata is made of, beside torch's dtypes (docs/torch.md, "What a checkpoint unpickles").
_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
        )
    }
    | {("torch", "Size"), ("collections", "OrderedDict")}
    | {(module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")}
    | {(module, name) for module in ("pathlib", "pathlib._local") for name in ("WindowsPath", "PureWindowsPath")}
    | set(compat.DCP_METADATA_PRIVATE_GLOBALS)
)


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the classes DCP's metadata is made of (and torch's dtypes): any other name is refused before
    it is looked up, so nothing else can be called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id {pid!r}")


def read_dcp_metadata(folder: Path, trust: bool = False) -> Metadata:
    """DCP's ``.metadata`` of ``folder``, unpickled through the allowlist of its classes (``trust``: a name
    outside it is unpickled anyway); every shard file it names must be a plain name inside ``folder``.

    Raises :class:`CheckpointError` for a refused name, a shard path leading out, or a file that is not DCP's
    metadata; other failures (a damaged file, one of a newer torch) come through as they are, for the caller."""
    path = inside(folder, folder / DCP_META)
    with open(path, "rb") as f:
        try:
            md = _MetadataUnpickler(f).load()
        except _Refused as exc:
            if not trust:
                raise CheckpointError(
                    f"{path} names {exc}, which DCP's metadata is not made of; {TRUST_HINT}"
                ) from None
            f.seek(0)
            md = pickle.load(f)
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path} holds a {type(md).__name__}, not DCP's Metadata: the checkpoint is damaged")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not _plain_name(rel):
            raise CheckpointError(
                f"{path} names the shard file {rel!r}, which is not a file of {folder}: refused, nothing was read"
            )
    return md


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose metadata is read by :func:`read_dcp_metadata` (DCP's own unpickles it with
    plain ``pickle``); tensors are read by DCP's reader, with ``weights_only=True``."""

    def __init__(self, path: str | os.PathLike, trust: bool = False) -> None:
        super().__init__(str(path))
        self.trust = trust

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_dcp_metadata(Path(self.path), self.trust)
        if getattr(md, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
