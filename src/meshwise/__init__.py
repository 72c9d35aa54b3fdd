"""meshwise: make a whole PyTorch training run follow one declared parallel topology."""

from __future__ import annotations

import importlib
from typing import Any

from meshwise.errors import MeshwiseError
from meshwise.topology import Topology, current, init, shutdown

__version__ = "0.1.0"

# Heavier layers load on first use, so `import meshwise` stays cheap for the launcher.
_LAZY = {
    "parallelize": "meshwise.parallel",
    "create_trainer": "meshwise.engine",
    "create_evaluator": "meshwise.evaluation",
    "Checkpointer": "meshwise.checkpoint",
}

__all__ = ["MeshwiseError", "Topology", "current", "init", "shutdown", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in {"data", "metrics", "parallel", "engine", "evaluation", "checkpoint", "handlers", "plot", "testing"}:
        return importlib.import_module(f"meshwise.{name}")
    raise AttributeError(f"module 'meshwise' has no attribute {name!r}")
