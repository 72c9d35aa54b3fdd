"""Torchmetrics that count every sample once: synced over the topology's batch + split dims with one fused collective.

:class:`MeshMetric` attaches a torchmetrics ``Metric`` or ``MetricCollection`` to a :class:`~meshwise.Topology`
(:mod:`~meshwise.metrics.mesh_metric`); :class:`MeanLoss` is a sample- or token-weighted mean
(:mod:`~meshwise.metrics.mean_loss`); :func:`compute_all` fuses several metrics into one sync
(:mod:`~meshwise.metrics.sync`); :func:`adopt_ignite_metrics` does the same for ignite's own metrics attached to an
``Engine`` (:mod:`~meshwise.metrics.ignite_metrics`, computed by :mod:`~meshwise.metrics.ignite_compute`).
``MetricSyncTimeout`` lives in :mod:`meshwise.errors` and is re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshwise.errors import MetricSyncTimeout
from meshwise.lazy import lazy_attributes
from meshwise.metrics.ignite_metrics import adopt_ignite_metrics

if TYPE_CHECKING:
    from meshwise.metrics.mean_loss import MeanLoss
    from meshwise.metrics.mesh_metric import MeshMetric, Select, compute_all, filter_rows

# The torchmetrics road loads on first use: importing torchmetrics costs ~1.7 s of CPU (it imports transformers
# and matplotlib), which every rank of a script that uses only ignite's metrics, or none, would pay at start.
_LAZY = {
    "MeanLoss": "meshwise.metrics.mean_loss",
    "MeshMetric": "meshwise.metrics.mesh_metric",
    "Select": "meshwise.metrics.mesh_metric",
    "compute_all": "meshwise.metrics.mesh_metric",
    "filter_rows": "meshwise.metrics.mesh_metric",
}

__all__ = [
    "MeanLoss",
    "MeshMetric",
    "MetricSyncTimeout",
    "Select",
    "adopt_ignite_metrics",
    "compute_all",
    "filter_rows",
]


__getattr__ = lazy_attributes(__name__, _LAZY)
