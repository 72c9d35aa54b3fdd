"""One model read whole from any meshwise checkpoint, in one process and without a process group: the folder a
path names (a checkpoint, or a root's latest), the saved object's key, and its tensors at their global shapes keyed
by the model's own FQNs. What ``export`` writes and the Hugging Face folder export reads.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from meshwise.checkpoint.protocol import MARKER, META, CheckpointFolder
from meshwise.checkpoint.safe import SafeLoadPlanner, SafeReader, read_dcp_metadata
from meshwise.checkpoint.validation import check_shards, read_record
from meshwise.checkpoint.writer import failure_text
from meshwise.errors import CheckpointError

__all__ = ["checkpoint_folder", "read_model"]


def checkpoint_folder(src: Path) -> Path:
    """The checkpoint folder ``src`` names: itself, or a root's ``latest`` (else its newest folder)."""
    if (src / META).is_file():
        return src
    if not (src / MARKER).is_file():
        raise CheckpointError(
            f"{src} is neither a meshwise checkpoint folder (no {META}) nor a checkpoint root (no {MARKER})"
        )
    folder = CheckpointFolder(src, keep_last=None, keep_best=None, mode="max")
    if folder.read_latest() is not None:  # refused when 'latest' leads outside src
        return folder.find("latest")[1]
    found = []
    for entry in src.iterdir():
        if entry.is_symlink():
            continue  # never a folder of a save
        try:
            found.append((json.loads((entry / META).read_text())["unix_time"], entry))
        except (OSError, ValueError, KeyError):
            continue
    if not found:
        raise CheckpointError(f"no complete checkpoint under {src}")
    return max(found)[1]


def _model_key(path: Path, meta: dict[str, Any], key: str) -> str:
    objects = meta.get("objects", {})
    single = meta.get("info", {}).get("ignite", {}).get("single")
    if key not in objects and single and "checkpoint" in objects:
        key = "checkpoint"  # ignite saved one object; its state dict is kept under ignite's own name
    if key not in objects:
        raise CheckpointError(f"checkpoint {path} has no object {key!r}; it holds {sorted(objects)}: pass key=")
    if objects[key]["kind"] not in ("module", "tensors"):
        raise CheckpointError(f"{key!r} in {path} is a {objects[key]['kind']}, not a model's tensors: pass key=")
    return key


def read_model(checkpoint: str | os.PathLike, key: str = "model", *, trust: bool = False) -> dict[str, Any]:
    """The model ``key`` of ``checkpoint`` as whole tensors at their global shapes, keyed by the model's own FQNs.

    One process, no process group; see :func:`export` for what ``checkpoint`` may name. Nothing in the files runs:
    a value only full pickle reads (a module's extra state holding objects) needs ``trust=True``.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    path = checkpoint_folder(Path(checkpoint))
    meta = read_record(path, {}, trust)
    key = _model_key(path, meta, key)
    check_shards(path, writer_torch=meta.get("torch"), trust=trust)
    saved = read_dcp_metadata(path, trust).state_dict_metadata
    prefix = f"{key}."
    target: dict[str, Any] = {}
    for name, md in saved.items():
        if not name.startswith(prefix):
            continue
        if isinstance(md, TensorStorageMetadata):
            target[name[len(prefix) :]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            target[name[len(prefix) :]] = None  # a non-tensor value (e.g. a module's extra state)
    if not target:
        raise CheckpointError(f"{key!r} in {path} holds no tensors to export")
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is what is asked here
            warnings.simplefilter("ignore", UserWarning)
            reader, planner = SafeReader(path, trust), SafeLoadPlanner(path, trust)
            dcp_load({key: target}, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise CheckpointError(f"reading {key!r} from {path} failed: {failure_text(exc)}") from exc
    return target
