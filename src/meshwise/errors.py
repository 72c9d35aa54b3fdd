"""Every error and warning class meshwise raises: each message says what was wrong and what to do."""

from __future__ import annotations

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
    """A chatty (``replica``/``split``) mesh dim crosses nodes where a ``batch`` dim could have instead."""
