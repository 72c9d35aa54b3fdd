"""Validation of a checkpoint before anything is loaded from it.

The metadata record, the files each object needs, every DCP shard file (present and long enough), and the keys
and global shapes the objects expect against the DCP metadata: a damaged or foreign checkpoint raises a
:class:`CheckpointError` naming the file while the objects are still untouched. Runs on rank 0.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from meshwise import compat
from meshwise.checkpoint.protocol import DCP_META, FORMAT, FORMAT_VERSION, META, OBJECTS_DIR, CheckpointFolder
from meshwise.checkpoint.safe import check_byte_values, inside, object_file, read_dcp_metadata
from meshwise.checkpoint.small_state import read_object
from meshwise.errors import CheckpointError
from meshwise.version import __version__

__all__ = ["check_keys", "check_shards", "find_and_read", "locate_and_read", "read_record"]


def read_record(path: Path, kinds: Mapping[str, str], trust: bool = False) -> dict[str, Any]:
    """Read checkpoint ``path``'s metadata and check it holds every object of ``kinds`` (name → kind), whole.

    Every file it checks must stay inside ``path`` (no symlink leading out); ``trust``: DCP's metadata may name
    classes beyond its own (docs/checkpoint.md, "Security")."""
    meta_path = path / META
    if meta_path.is_symlink() or meta_path.is_file():
        inside(path, meta_path)
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: {path} is not a complete meshwise checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON ({exc}): the checkpoint is damaged") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("objects", {}), dict):
        raise CheckpointError(f"{meta_path} is not a meshwise checkpoint record: the checkpoint is damaged")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not a meshwise checkpoint record (format {meta.get('format')!r})")
    if int(meta.get("version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path} was written by meshwise {meta.get('meshwise', '?')} in checkpoint format "
            f"{meta.get('version')}; this is meshwise {__version__}, which reads format {FORMAT_VERSION} and older: "
            f"load it with meshwise {meta.get('meshwise', '?')} or newer"
        )
    saved = meta.get("objects", {})
    absent = [n for n in kinds if n not in saved]
    if absent:
        raise CheckpointError(
            f"checkpoint {path} has no object(s) {absent}; it holds {sorted(saved)} (see {meta_path})"
        )
    wrong = [f"{n} (saved as {saved[n]['kind']}, given a {k})" for n, k in kinds.items() if saved[n]["kind"] != k]
    if wrong:
        raise CheckpointError(f"checkpoint {path}: object kinds differ: {', '.join(wrong)}")
    for n, k in kinds.items():
        if k == "state" and object_file(path, n) is None:
            raise CheckpointError(f"{path / OBJECTS_DIR / (n + '.json')} is missing: the checkpoint is incomplete")
    if meta.get("dcp") and any(k in ("module", "optimizer", "tensors") for k in kinds.values()):
        check_shards(path, writer_torch=meta.get("torch"), trust=trust)
    return meta


def find_and_read(
    folder: CheckpointFolder, step: int | str, kinds: Mapping[str, str], trust: bool
) -> tuple[int, str, dict[str, Any], dict[str, tuple[str, Any]]]:
    """Rank 0, for a load of ``step`` (an int or ``"latest"``): its number, folder and metadata record, every file
    the objects of ``kinds`` need checked, and the saved states of the plain objects among them (name → (file,
    state), read as data)."""
    number, path = folder.find(step)
    meta = read_record(path, kinds, trust)
    states = {n: read_object(path, n, trust) for n, k in kinds.items() if k == "state"}
    return number, str(path), meta, states


def locate_and_read(
    folder: CheckpointFolder, entry: int | str | os.PathLike, names: list[str], trust: bool
) -> tuple[str, dict[str, Any], dict[str, tuple[str, Any]]]:
    """Rank 0, for ``load_states``: the folder of ``entry`` (a step, ``"latest"``, a name under the root or a
    folder's path), its record checked to hold ``names`` whole, and the states saved without tensors among them."""
    if isinstance(entry, int) or entry == "latest":
        path = folder.find(entry)[1]
    elif isinstance(entry, str) and "/" not in entry and os.sep not in entry:
        path = inside(folder.root, folder.entry_path(entry))  # a name under the root: no symlink leading out
    else:
        path = Path(entry)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder {path}: pass a folder a save wrote under {folder.root}")
    saved = read_record(path, {})["objects"]
    absent = [n for n in names if n not in saved]
    if absent:
        raise CheckpointError(f"checkpoint {path} has no object(s) {absent}; it holds {sorted(saved)}")
    meta = read_record(path, {n: saved[n]["kind"] for n in names}, trust)
    states = {n: read_object(path, n, trust) for n in names if saved[n]["kind"] == "state"}
    return str(path), meta, states


def _newer_torch(writer: str | None) -> bool:
    """Whether the torch that wrote a checkpoint is a newer release than this one (local tags such as +cpu aside)."""

    def release(text: str) -> tuple[int, ...] | None:
        found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
        return tuple(int(x or 0) for x in found.groups()) if found else None

    theirs, ours = release(writer or ""), release(torch.__version__)
    return theirs is not None and ours is not None and theirs > ours


def check_shards(path: Path, writer_torch: str | None = None, trust: bool = False) -> None:
    """Check that the DCP metadata of ``path`` is readable and every shard file it names is there, long enough.

    ``writer_torch``: the torch version the metadata record says wrote the checkpoint. DCP's metadata gains fields
    between torch releases (2.15 added tensor strides), and an older torch cannot unpickle it: when the writer was
    newer, the error says so instead of calling the file damaged. The metadata is read through meshwise's allowlist
    (``trust``: beyond it), and every shard file must be a file of ``path``."""
    dcp_meta = path / DCP_META
    if not (dcp_meta.is_file() or dcp_meta.is_symlink()):
        raise CheckpointError(f"{dcp_meta} (the DCP metadata) is missing: the checkpoint {path} is incomplete")
    try:
        md = read_dcp_metadata(path, trust)
    except CheckpointError as exc:
        if _newer_torch(writer_torch):
            raise CheckpointError(f"{exc}. It was written by torch {writer_torch}, a newer one than this") from None
        raise
    except Exception as exc:  # noqa: BLE001
        if _newer_torch(writer_torch):
            raise CheckpointError(
                f"{dcp_meta} was written by torch {writer_torch} and cannot be read by this torch {torch.__version__} "
                f"({type(exc).__name__}: {exc}): DCP's metadata format changes between torch releases. Load it with "
                f"torch {writer_torch.split('+')[0]} or newer (e.g. to export it: meshwise export), or upgrade torch "
                "here; the checkpoint itself is intact"
            ) from None
        raise CheckpointError(f"{dcp_meta} cannot be read ({type(exc).__name__}: {exc}): it is damaged") from None
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        shard = path / rel
        if shard.is_symlink():
            inside(path, shard)
        if not shard.is_file():
            raise CheckpointError(f"shard file {shard} is missing: the checkpoint {path} is incomplete")
        actual = shard.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"shard file {shard} is truncated: {actual} bytes, the DCP metadata needs {size}; "
                "load an older checkpoint"
            )


def _tensor_shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor):  # DTensor included: its shape is the global one
        return tuple(value.shape)
    return None


def _listing(keys: list[str]) -> str:
    return ", ".join(keys[:12]) + (f", ... ({len(keys)} in all)" if len(keys) > 12 else "")


def check_keys(
    path: Path,
    state: Mapping[str, Any],
    allow_extra: bool = False,
    trust: bool = False,
    decoded: dict[bytes, Any] | None = None,
) -> None:
    """Compare the keys and global shapes the DCP ``state`` expects with those the DCP metadata of ``path`` holds,
    then read the byte values among them as the load will (``weights_only=True``, unless ``trust``): a refused one
    raises naming its shard file before anything is loaded; ``decoded`` keeps what was read, for the load.

    ``allow_extra=True``: keys the checkpoint holds beyond ``state`` are fine (one pipeline stage's part)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(path, trust)
    saved = metadata.state_dict_metadata
    flat = compat.flatten_state_dict(dict(state))
    prefixes = tuple(f"{n}." for n in state)
    missing = sorted(k for k in flat if k not in saved)
    unexpected = sorted(k for k in saved if not allow_extra and k.startswith(prefixes) and k not in flat)
    shapes = []
    for k, v in flat.items():
        shape = _tensor_shape(v)
        md = saved.get(k)
        if shape is not None and isinstance(md, TensorStorageMetadata) and tuple(md.size) != shape:
            shapes.append(f"{k}: saved {list(md.size)}, expected {list(shape)}")
    if not (missing or unexpected or shapes):
        check_byte_values(path, metadata, flat, trust, decoded)
        return
    parts = []
    if missing:
        parts.append(f"missing keys (expected, not in the checkpoint): {_listing(missing)}")
    if unexpected:
        parts.append(f"unexpected keys (in the checkpoint, not expected): {_listing(unexpected)}")
    if shapes:
        parts.append(f"shape mismatches: {_listing(shapes)}")
    raise CheckpointError(
        f"checkpoint {path / DCP_META} is of another model or optimizer: " + "; ".join(parts) + ". "
        "Build the same model (and optimizer) that was saved, or load only the objects that match"
    )
