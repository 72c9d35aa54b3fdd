"""meshwise: make a whole PyTorch training run follow one declared parallel topology."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from meshwise import debug, topology
from meshwise.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, MeshwiseError
from meshwise.lazy import lazy_attributes
from meshwise.topology import Topology, current, init, shutdown
from meshwise.version import __version__

if TYPE_CHECKING:
    from meshwise.checkpoint import Checkpointer
    from meshwise.engine import create_evaluator, create_trainer
    from meshwise.parallel import parallelize


# The debug watchdog (layer 2) starts with every topology and stops before its process group goes. It is
# registered here, once: the topology (layer 1) does not import the layers above it.
topology.on_init(debug.attach)
topology.on_shutdown(debug.detach)


def _release_ignite(topo: Topology) -> None:
    """ignite.distributed keeps the process group it last found: one that meshwise made and is about to destroy
    must not outlive it there (the next idist call, e.g. of a one-process run after it, would use a dead group)."""
    if topo.owns_group and "ignite.distributed.utils" in sys.modules:
        from meshwise.dryrun import leave_ignite

        leave_ignite()


topology.on_shutdown(_release_ignite)

# Heavier layers load on first use, so `import meshwise` stays cheap for the launcher.
_LAZY = {
    "parallelize": "meshwise.parallel",
    "create_trainer": "meshwise.engine",
    "create_evaluator": "meshwise.engine",
    "Checkpointer": "meshwise.checkpoint",
}
_SUBMODULES = {
    "data",
    "metrics",
    "parallel",
    "engine",
    "checkpoint",
    "physicsnemo",
    "hf",
    "debug",
    "plot",
    "testing",
    "layout",
    "environment",
    "topology",
    "launch",
    "dryrun",
}

__all__ = [
    "Checkpointer",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "MeshwiseError",
    "Topology",
    "__version__",
    "create_evaluator",
    "create_trainer",
    "current",
    "init",
    "parallelize",
    "shutdown",
]


__getattr__ = lazy_attributes(__name__, _LAZY, _SUBMODULES)
