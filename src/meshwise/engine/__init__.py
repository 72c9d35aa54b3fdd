"""The ignite engines of a run and their handlers (layer 8: uses every layer below).

:mod:`~meshwise.engine.trainer` (``create_trainer``, ``TrainStep``, ``MeshEngine``), :mod:`~meshwise.engine.evaluator`
(``create_evaluator``, ``EvalMetrics``), :mod:`~meshwise.engine.batch` (batch preparation both share, ``shift_labels``),
:mod:`~meshwise.engine.handlers` (``Checkpointing``, ``ProgressBar``, ``PeriodicEvaluation``, ``TimeBudget``),
:mod:`~meshwise.engine.run_log` (``RunLogger``, ``setup_logging``) and :mod:`~meshwise.engine.ignite_engine`
(``on_mesh``, the supervised helpers' ``prepare_batch``/``global_loss``). See docs/training.md, docs/ignite.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshwise.causal_lm import shift_labels
from meshwise.engine.handlers import Checkpointing, EngineState, PeriodicEvaluation, ProgressBar, TimeBudget
from meshwise.engine.ignite_engine import on_mesh
from meshwise.engine.run_log import RunLogger, setup_logging
from meshwise.engine.trainer import MeshEngine, TrainStep, create_trainer
from meshwise.lazy import lazy_attributes

if TYPE_CHECKING:
    from meshwise.engine.evaluator import EvalMetrics, create_evaluator

# The evaluator loads on first use: it imports torchmetrics (~1.7 s of CPU a process), which a rank that only
# trains would pay at start.
_LAZY = {"EvalMetrics": "meshwise.engine.evaluator", "create_evaluator": "meshwise.engine.evaluator"}

__all__ = [
    "Checkpointing",
    "EngineState",
    "EvalMetrics",
    "MeshEngine",
    "PeriodicEvaluation",
    "ProgressBar",
    "RunLogger",
    "TimeBudget",
    "TrainStep",
    "create_evaluator",
    "create_trainer",
    "on_mesh",
    "setup_logging",
    "shift_labels",
]


__getattr__ = lazy_attributes(__name__, _LAZY)
