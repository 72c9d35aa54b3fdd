"""What a checkpoint holds, and how each kind of object is taken from and put back into memory.

Modules and optimizers go through DCP (each optimizer paired with the module whose parameters it holds);
every other object's ``state_dict()`` is one global copy written by rank 0 (digests compared across ranks);
each rank's RNG streams are saved, restored at the same mesh, or re-derived at another.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import os
import pickle
import random
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from meshwise.checkpoint.protocol import FORMAT, FORMAT_VERSION, OBJECTS_DIR, RNG_DIR, fsync_dir
from meshwise.checkpoint.safe import decode_json, encode_json, object_file, read_torch_file
from meshwise.errors import CheckpointError, MeshwiseError
from meshwise.parallel.apply import reshard

__all__ = [
    "apply_dcp_state",
    "check_options",
    "classify",
    "dcp_state",
    "derived_seed",
    "digest",
    "holds_tensors",
    "load_object",
    "mesh_text",
    "object_kind",
    "optimizer_owners",
    "read_object",
    "record",
    "read_rng",
    "rederive_rng",
    "reshard_message",
    "rng_state",
    "score_value",
    "set_rng_state",
    "small_files",
    "warn_differences",
    "write_files",
]


# --------------------------------------------------------------------------- options and score


def check_options(keep_last: Any, keep_best: Any, score: Any, mode: Any, async_save: Any) -> None:
    """Check the options of a ``Checkpointer``: a :class:`CheckpointError` names a bad one."""
    for name, value in (("keep_last", keep_last), ("keep_best", keep_best)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"{name} must be a positive int or None, got {value!r}")
    if keep_best is not None and score is None:
        raise CheckpointError("keep_best needs score=: a metric name (engine.state.metrics key) or a callable")
    if score is not None and not (isinstance(score, str) or callable(score)):
        raise CheckpointError(f"score must be a metric name or a callable returning a float, got {score!r}")
    if mode not in ("max", "min"):
        raise CheckpointError(f"mode must be 'max' (higher score is better) or 'min', got {mode!r}")
    if async_save not in (True, False, "stage-first"):
        raise CheckpointError(f"async_save must be True, False or 'stage-first', got {async_save!r}")


def score_value(score: str | Callable[[], float] | None, objects: Mapping[str, Any]) -> float | None:
    """The score of a save for ``keep_best``: ``score()``, or the metric ``score`` of an Engine in ``objects``."""
    if score is None:
        return None
    if callable(score):
        value = score()
    else:
        value = None
        for obj in objects.values():
            metrics = getattr(getattr(obj, "state", None), "metrics", None)
            if isinstance(metrics, Mapping) and score in metrics:
                value = metrics[score]
                break
        if value is None:
            return None  # no score yet (e.g. before the first evaluation): not a candidate for best
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"score {score!r} gave {value!r}, not a number") from None


# --------------------------------------------------------------------------- kinds of objects


def object_kind(obj: Any) -> str:
    """``"module"``, ``"optimizer"``, ``"state"`` (has ``state_dict``/``load_state_dict``) or ``""`` (none)."""
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "state"
    return ""


def classify(objects: Mapping[str, Any]) -> dict[str, str]:
    """The kind of each named object; raises for an object that cannot be checkpointed."""
    kinds = {}
    for name, obj in objects.items():
        kind = object_kind(obj)
        if not kind:
            raise CheckpointError(
                f"cannot checkpoint {name}={type(obj).__name__}: pass an nn.Module, an Optimizer, or an object "
                "with state_dict() and load_state_dict() (wrap plain values in such an object)"
            )
        kinds[name] = kind
    return kinds


def optimizer_owners(objects: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, str]:
    """For each optimizer, the name of the module whose parameters it holds.

    Every module is resharded first: after a forward without backward (an evaluation) FSDP2's root holds
    unsharded parameters, other objects than the optimizer's (docs/torch.md, "Checkpoints (DCP)"), and the
    state dicts taken next must see the sharded ones too.
    """
    for name, kind in kinds.items():
        if kind == "module":
            reshard(objects[name])
    modules = {n: {id(p) for p in objects[n].parameters()} for n, k in kinds.items() if k == "module"}
    owners = {}
    for name, kind in kinds.items():
        if kind != "optimizer":
            continue
        params = {id(p) for g in objects[name].param_groups for p in g["params"]}
        owner = next((m for m, ids in modules.items() if params <= ids), None)
        if owner is None:
            raise CheckpointError(
                f"optimizer {name!r} holds parameters of no module passed with it: pass its model too, "
                f"e.g. save(step, model=model, {name}={name})"
            )
        owners[name] = owner
    return owners


# --------------------------------------------------------------------------- DCP state of modules and optimizers

# Optimizer hyperparameters keyed by parameter name, not one param_groups list: DCP keeps one rank's copy of a
# replicated list, which names only that pipeline stage's parameters (docs/pipeline.md).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def dcp_state(
    objects: Mapping[str, Any], kinds: Mapping[str, str], owners: Mapping[str, str], skip: Collection[str]
) -> dict[str, Any]:
    """The DCP state dict of every module and optimizer not in ``skip`` (call :func:`optimizer_owners` first)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {}
    for name, kind in kinds.items():
        if name in skip:
            continue
        if kind == "module":
            state[name] = get_model_state_dict(objects[name])
        elif kind == "optimizer":
            state[name] = get_optimizer_state_dict(objects[owners[name]], objects[name], options=FLAT)
    return state


def apply_dcp_state(
    objects: Mapping[str, Any],
    kinds: Mapping[str, str],
    owners: Mapping[str, str],
    names: Collection[str],
    state: Mapping[str, Any],
) -> None:
    """Put the loaded DCP ``state`` of ``names`` back: modules first, then the optimizers that hold their params."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for n in names:
        if kinds[n] == "module":
            set_model_state_dict(objects[n], state[n])
    for n in names:
        if kinds[n] == "optimizer":
            set_optimizer_state_dict(objects[owners[n]], objects[n], state[n], options=FLAT)


# --------------------------------------------------------------------------- RNG streams


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch, numpy and python RNG states (and CUDA's on a CUDA ``device``), as tensors, numbers and
    names only (what ``torch.load(weights_only=True)`` reads back: no numpy array, no pickled object)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "python": {"version": int(version), "words": torch.tensor(words, dtype=torch.int64), "gauss": py_gauss},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Restore what :func:`read_rng` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


_NUMPY_SCRATCH: list[np.random.RandomState] = []


def _scratch_numpy() -> np.random.RandomState:
    """One generator to try saved numpy states on (a new one costs ~0.1 ms: it seeds from the OS)."""
    if not _NUMPY_SCRATCH:
        _NUMPY_SCRATCH.append(np.random.RandomState(0))
    return _NUMPY_SCRATCH[0]


def read_rng(folder: Path, rank: int, trust: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s saved RNG states in checkpoint ``folder``, read as data (``weights_only=True``; the first
    format's numpy state holds an array, which that allows) and checked on scratch generators, as
    :func:`set_rng_state` takes them; raises naming the file."""
    file = folder / RNG_DIR / f"rank-{rank:05d}.pt"
    saved = read_torch_file(folder, file, trust)
    try:
        saved_np, saved_py = saved["numpy"], saved["python"]
        if isinstance(saved_np, Mapping):  # this format: tensors, numbers and names
            keys = np.asarray(saved_np["keys"].numpy(), dtype=np.uint32)
            saved_np = (saved_np["name"], keys, saved_np["pos"], saved_np["has_gauss"], saved_np["cached_gaussian"])
        if isinstance(saved_py, Mapping):
            saved_py = (saved_py["version"], tuple(int(w) for w in saved_py["words"].tolist()), saved_py["gauss"])
        state = {"torch": saved["torch"], "numpy": saved_np, "python": saved_py}
        torch.Generator().set_state(state["torch"])
        _scratch_numpy().set_state(state["numpy"])
        random.Random().setstate(state["python"])
        if "cuda" in saved:
            state["cuda"] = saved["cuda"]
    except Exception as exc:  # noqa: BLE001 - whatever is wrong in it, the file is named
        raise CheckpointError(f"{file} does not hold RNG states ({type(exc).__name__}: {exc}): it is damaged") from exc
    return state


def derived_seed(base: int, step: int, stream: int) -> int:
    """A 63-bit seed from ``base``, ``step`` and ``stream`` (the data rank): the same on every rank that asks."""
    hashed = hashlib.sha256(f"meshwise-rng/{base}/{step}/{stream}".encode()).digest()
    return int.from_bytes(hashed[:8], "little") & ((1 << 63) - 1)


def rederive_rng(base: int, step: int, stream: int) -> None:
    """Seed torch, numpy and python from :func:`derived_seed` (RNG states cannot move to another mesh)."""
    seed = derived_seed(base, step, stream)
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)


# --------------------------------------------------------------------------- small objects


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


def mesh_text(dims: Mapping[str, int]) -> str:
    """``dp=2 x tp=2`` (``-`` for no dims)."""
    return " x ".join(f"{d}={s}" for d, s in dims.items()) or "-"


def _meshwise_version() -> str:
    try:
        from meshwise import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def record(
    topo: Any,
    entry: int | str,
    started: float,
    kinds: Mapping[str, str],
    owners: Mapping[str, str],
    fresh: Collection[str],
    score: float | None,
    use_dcp: bool,
    score_name: str | None,
    rng_seed: int = 0,
) -> dict[str, Any]:
    """The metadata record (``meshwise.json``) of checkpoint ``entry`` (a step, or a name) saved on ``topo``."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": entry if isinstance(entry, int) else None,
        **({"name": entry} if isinstance(entry, str) else {}),
        "time": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(),
        "unix_time": started,
        "mesh": {"dims": list(topo.dims), "sizes": [topo.sizes[d] for d in topo.dims], "roles": topo.roles},
        "world_size": topo.world_size,
        "backend": topo.backend,
        "torch": torch.__version__,
        "meshwise": _meshwise_version(),
        "objects": {
            n: {"kind": k, **({"module": owners[n], "fresh": n in fresh} if k == "optimizer" else {})}
            for n, k in kinds.items()
        },
        "score": score,
        "score_name": score_name,
        "rng_seed": rng_seed,
        "dcp": use_dcp,
    }


def reshard_message(
    root: Any,
    topo: Any,
    step: int,
    meta: Mapping[str, Any],
    dcp_names: list[str],
    kinds: Mapping[str, str],
    rng: str,
) -> str:
    """What a load at another mesh than the saved one did, in one line (logged by rank 0)."""
    saved_mesh = dict(zip(meta["mesh"]["dims"], meta["mesh"]["sizes"]))
    parts = [
        f"meshwise checkpoint: loaded step-{step} from {root}, resharded from mesh {mesh_text(saved_mesh)} "
        f"(world {meta.get('world_size')}) to {mesh_text(topo.sizes)} (world {topo.world_size})"
    ]
    if dcp_names:
        parts.append(f"DCP resharded {', '.join(dcp_names)}")
    others = [n for n, k in kinds.items() if k == "state"]
    if others:
        parts.append(f"{', '.join(others)} loaded from rank 0's global copy")
    if rng == "re-derived":
        parts.append("RNG streams re-derived from rng_seed + step + data rank")
    return "; ".join(parts)
