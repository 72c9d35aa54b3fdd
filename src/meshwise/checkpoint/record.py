"""A checkpoint's metadata record (``meshwise.json``: format, mesh, versions, objects, score) and the line a
load at another mesh logs.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Mapping
from typing import Any

import torch

from meshwise.checkpoint.protocol import FORMAT, FORMAT_VERSION
from meshwise.version import __version__

__all__ = ["mesh_text", "record", "reshard_message"]


def mesh_text(dims: Mapping[str, int]) -> str:
    """``dp=2 x tp=2`` (``-`` for no dims)."""
    return " x ".join(f"{d}={s}" for d, s in dims.items()) or "-"


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
        "meshwise": __version__,
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
