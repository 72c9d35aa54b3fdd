"""The ignite engines of a run and their handlers (layer 8: uses every layer below).

:mod:`~meshwise.engine.trainer` (``create_trainer``, ``TrainStep``), :mod:`~meshwise.engine.evaluator`
(``create_evaluator``, ``EvalMetrics``), :mod:`~meshwise.engine.batch` (batch preparation both share),
:mod:`~meshwise.engine.handlers` (``Checkpointing``, ``ProgressBar``, ``PeriodicEvaluation``, ``TimeBudget``)
and :mod:`~meshwise.engine.run_log` (``RunLogger``, ``setup_logging``). See docs/training.md.
"""

from __future__ import annotations

from meshwise.engine.evaluator import EvalMetrics, create_evaluator
from meshwise.engine.handlers import Checkpointing, EngineState, PeriodicEvaluation, ProgressBar, TimeBudget
from meshwise.engine.run_log import RunLogger, setup_logging
from meshwise.engine.trainer import TrainStep, create_trainer

__all__ = [
    "Checkpointing",
    "EngineState",
    "EvalMetrics",
    "PeriodicEvaluation",
    "ProgressBar",
    "RunLogger",
    "TimeBudget",
    "TrainStep",
    "create_evaluator",
    "create_trainer",
    "setup_logging",
]
