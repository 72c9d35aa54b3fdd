"""Each rank's RNG streams in a checkpoint: taken as data, read back and checked, restored at the same mesh, or
re-derived from a seed, the step and the data rank at another.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshwise.checkpoint.protocol import RNG_DIR
from meshwise.checkpoint.safe import read_torch_file
from meshwise.errors import CheckpointError

__all__ = ["derived_seed", "read_rng", "rederive_rng", "rng_state", "set_rng_state"]


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
