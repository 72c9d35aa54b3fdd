"""Objects other than modules and optimizers: one global copy of each ``state_dict()`` written by rank 0 (JSON or a
torch file), digests compared across ranks, read back as data and loaded.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from meshwise.checkpoint.protocol import OBJECTS_DIR, RNG_DIR, fsync_dir
from meshwise.checkpoint.rng import rng_state
from meshwise.checkpoint.safe import decode_json, encode_json, object_file, read_torch_file
from meshwise.errors import CheckpointError, MeshwiseError

__all__ = ["digest", "holds_tensors", "load_object", "read_object", "small_files", "warn_differences", "write_files"]


def digest(state: Any) -> str | None:
    """A digest of a state dict, to compare it across ranks; None when it cannot be pickled."""
    try:
        return hashlib.sha1(pickle.dumps(state, protocol=4)).hexdigest()
    except Exception:  # noqa: BLE001 - an unpicklable state is simply not checked
        return None


def small_files(
    tmp: Path, small: Mapping[str, Any], rng: bool, error: str | None, topology: Any, copied: bool
) -> tuple[dict[str, Any], dict[Path, Any]]:
    """This rank's RNG states and (rank 0) the other objects' states, as files to write (by the writer) into
    ``tmp``; ``copied``: deep copies (an async save writes them later). A state made of dicts, lists, tuples,
    numbers, strings and None becomes ``objects/<name>.json`` (its text, already a copy); any other is
    ``objects/<name>.pt``, which a load reads with ``weights_only=True`` (or, holding objects, ``trust=True``).

    Returns this rank's report for the commit (its error, the digests of its objects' states, compared
    there across ranks) and the files.
    """
    rank = topology.rank
    digests: dict[str, str | None] = {}
    files: dict[Path, Any] = {}
    try:
        if rng:
            files[tmp / RNG_DIR / f"rank-{rank:05d}.pt"] = rng_state(topology.device)
        for name, sd in small.items():
            digests[name] = digest(sd)
            if rank == 0:
                text = encode_json(sd)
                if text is not None:
                    files[tmp / OBJECTS_DIR / f"{name}.json"] = text
                else:
                    files[tmp / OBJECTS_DIR / f"{name}.pt"] = copy.deepcopy(sd) if copied else sd
    except Exception as exc:  # noqa: BLE001 - reported at the commit, so that no rank waits alone
        error = error or f"{type(exc).__name__}: {exc}"
    return {"error": error, "digests": digests}, files


def write_files(files: Mapping[Path, Any], fsync: bool = False) -> str | None:
    """``torch.save`` each value to its path (a ``.json`` path: the value is its text; ``fsync``: and onto the
    disk before returning); the error as text (reported at the commit), or None."""
    try:
        for path, value in files.items():
            if path.suffix == ".json":
                path.write_text(value)
            else:
                torch.save(value, path)
            if fsync:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if fsync:
            for folder in {path.parent for path in files}:
                fsync_dir(folder)  # the files' names too
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def warn_differences(reports: list[dict[str, Any]]) -> None:
    """Warn about objects whose digest differs from rank 0's (``reports[r]["digests"]``): only rank 0's is saved."""
    for name, mine in reports[0]["digests"].items():
        differ = [
            r for r, rep in enumerate(reports) if mine is not None and rep["digests"].get(name) not in (mine, None)
        ]
        if differ:
            warnings.warn(
                f"meshwise checkpoint: {name}.state_dict() on rank(s) {differ} differs from rank 0's; rank 0's "
                "copy was saved (objects other than models and optimizers must hold global state)",
                stacklevel=2,
            )


def holds_tensors(state: Any) -> bool:
    """True when a (nested) state dict holds a tensor: such state goes through DCP."""
    if isinstance(state, torch.Tensor):
        return True
    if isinstance(state, Mapping):
        return any(holds_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(holds_tensors(v) for v in state)
    return False


def read_object(folder: Path, name: str, trust: bool = False) -> tuple[str, Any]:
    """The file of object ``name``'s saved state in checkpoint ``folder`` (rank 0's copy) and that state, read as
    data (JSON, or a torch file with ``weights_only=True``; ``trust``: a torch file holding objects of its own with
    full pickle); raises naming the file."""
    file = object_file(folder, name)
    if file is None:
        raise CheckpointError(f"{folder / OBJECTS_DIR / (name + '.json')} is missing: the checkpoint is incomplete")
    if file.suffix == ".pt":
        return str(file), read_torch_file(folder, file, trust)
    try:
        return str(file), decode_json(file.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}): it is damaged") from exc


def load_object(name: str, obj: Any, state: Any, file: str) -> None:
    """Load ``state`` (rank 0's saved copy of the state of ``name``, read from ``file``) into ``obj``; raises
    naming the file."""
    try:
        obj.load_state_dict(state)
    except MeshwiseError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{name}.load_state_dict() rejected {file}: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- the metadata record
