"""Every error and warning class meshwise raises: each message says what was wrong and what to do."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DataError",
    "DataWarning",
    "MeshwiseError",
    "MetricError",
    "MetricSyncTimeout",
    "ParallelError",
    "PlacementWarning",
    "TopologyError",
    "import_extra",
]


class MeshwiseError(Exception):
    """Base class of every error meshwise raises on bad input or a failed collective."""


class TopologyError(MeshwiseError):
    """A mesh specification, a role or a launch environment is wrong."""


class DataError(MeshwiseError):
    """A sampler, sample-part spec, source or loader state is wrong."""


class ParallelError(MeshwiseError):
    """A parallelisation plan or model cannot be applied on this topology."""


class MetricError(MeshwiseError):
    """A metric update or synchronisation is wrong for this topology."""


class CheckpointError(MeshwiseError):
    """A checkpoint is missing, corrupt or incompatible with what is loading it."""


class CollectiveError(MeshwiseError):
    """A collective on a topology group went wrong; the message names the mesh dims, roles, op, step and ranks."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the timeout: some rank of the group never arrived."""


class CollectiveMismatchError(CollectiveError):
    """Ranks of one group reached the same collective with different ops, shapes, dtypes or steps (debug mode)."""


class MetricSyncTimeout(MetricError, CollectiveTimeoutError):
    """A metric synchronisation did not complete: some rank of the group skipped ``compute()`` or died."""


class DataWarning(UserWarning):
    """A data layout that works but costs: e.g. chunks wider than a tile, so each rank decodes more than its part."""


class PlacementWarning(UserWarning):
    """The mesh places work or memory where it costs more than it must; the run is still correct. Three cases:

    - a chatty (``replica``/``split``) dim crosses nodes where a ``batch`` dim could have instead, or the
      launcher put a group's ranks on several nodes (``srun -m cyclic``): the message names the dim order or the
      launcher option (``-m block``, ``--ntasks-per-node``) that keeps it inside one node (:func:`meshwise.init`,
      rank 0);
    - a replica dim of more than one rank but ``parallelize`` got no ``tp_plan``: those ranks repeat the same
      work on the same samples (pass a plan, or drop the dim);
    - FSDP2 shards parameters that have fewer rows than the data-parallel ranks: the trailing ranks hold empty
      shards and the memory sits on the first ones (the message gives a ``shard_placement_fn``).
    """


def import_extra(module: str, needed_by: str, install: str) -> Any:
    """``importlib.import_module(module)`` of an optional extra, or a :class:`TopologyError` that names who needs
    it and how to install it (``install``: the command and the page that says more)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TopologyError(f"{needed_by} needs {module.split('.')[0]}: {install}") from exc
