"""meshwise: make a whole PyTorch training run follow one declared parallel topology."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from meshwise import debug as _debug
from meshwise import topology as _topology
from meshwise.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, MeshwiseError
from meshwise.topology import Topology, current

__version__ = "0.1.0"

# Heavier layers load on first use, so `import meshwise` stays cheap for the launcher.
_LAZY = {
    "parallelize": "meshwise.parallel",
    "create_trainer": "meshwise.engine",
    "create_evaluator": "meshwise.evaluation",
    "Checkpointer": "meshwise.checkpoint",
}

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "MeshwiseError",
    "Topology",
    "current",
    "init",
    "shutdown",
    "__version__",
    *_LAZY,
]


@functools.wraps(_topology.init)
def init(*args: Any, **kwargs: Any) -> Topology:
    # The topology, then its watchdog (and, in debug mode, the fingerprinting of collectives): layer 8 on layer 1.
    topo = _topology.init(*args, **kwargs)
    _debug.attach(topo)
    return topo


def shutdown() -> None:
    """Leave the process group that :func:`init` made (telling ranks that wait on this one); safe to call twice."""
    topo = _topology.current()
    if topo is not None:
        _debug.detach(topo)
    _topology.shutdown()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in {"data", "metrics", "parallel", "engine", "evaluation", "checkpoint", "handlers", "plot", "testing"}:
        return importlib.import_module(f"meshwise.{name}")
    raise AttributeError(f"module 'meshwise' has no attribute {name!r}")
