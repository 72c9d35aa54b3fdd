"""Model parallelism over the topology: torch's TP plan and FSDP2 placed by roles, and the halo exchange."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "parallelize": "meshwise.parallel.apply",
    "clip_grad_norm": "meshwise.parallel.apply",
    "halo_exchange": "meshwise.parallel.halo",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshwise.parallel' has no attribute {name!r}")
