"""A run's numbers written once (rank 0: JSON lines + TensorBoard), and log/warning lines tagged with the rank
and mesh coordinate that produced them."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events

from meshwise import dryrun
from meshwise.engine.handlers import scalar
from meshwise.engine.observe import observer_of
from meshwise.errors import MeshwiseError
from meshwise.plot import METRICS_FILE
from meshwise.topology import Topology, resolve

__all__ = ["METRICS_FILE", "TENSORBOARD_DIR", "RunLogger", "setup_logging"]

TENSORBOARD_DIR = "tensorboard"


class RunLogger:
    """Writes a run's numbers once: ``RUN_DIR/metrics.jsonl`` (one JSON object a line) and TensorBoard events.

    Only global rank 0 writes; on other ranks every method is a no-op, so the files exist once per
    run; a dry run (``meshwise run --dry-run``) writes nothing on any rank, not even the folder. Each line
    is ``{"tag": "train", "step": 12, "epoch": 1, "time": ..., "loss": 0.53, ...}``.
    Attach it to a trainer (logs ``engine.state.output`` as ``loss``, ``engine.state.metrics``,
    ``engine.state.grad_norm`` when clipping, and what the trainer's :class:`~meshwise.engine.observe.Observer`
    measured: ``lr``, ``step_time_s``, ``samples_per_s``, ``tokens_per_s``, ``peak_mem_mb``, ``data_mb_read``,
    ``flops_per_step``, ``tflops``, ``mfu``) and to evaluators (logs their ``state.metrics`` under their
    tag at the trainer's step). At each epoch's end every rank's peak memory and data read are logged under the
    tags ``rank0``, ``rank1``, ... (gathered by the observer, which ``create_trainer`` attaches on every rank).
    The file is appended to, so a resumed run continues its log; lines reach the disk at least every
    ``flush_seconds`` and when the run completes. TensorBoard gets the ``train`` numbers of every
    ``tensorboard_every``-th step (its writer costs about 60 us a number: 0.5 ms a step for ten numbers, measured
    on this project's CPU machine), everything else as it comes.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        topology: Topology | None = None,
        *,
        tensorboard: bool = True,
        every: int = 1,
        tensorboard_every: int = 10,
        flush_seconds: float = 5.0,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise MeshwiseError(f"RunLogger every={every!r}: log every n >= 1 iterations")
        self.run_dir = Path(run_dir)
        self.topology = resolve(topology)
        self.every = every
        if isinstance(tensorboard_every, bool) or not isinstance(tensorboard_every, int) or tensorboard_every < 1:
            raise MeshwiseError(f"RunLogger tensorboard_every={tensorboard_every!r}: a positive int of steps")
        self.tensorboard_every = tensorboard_every
        self.flush_seconds = float(flush_seconds)
        self._flushed = time.monotonic()
        self.enabled = self.topology.rank == 0 and dryrun.active() is None
        self._file = None
        self._writer = None
        self._trainer: Engine | None = None
        self._observer: Any = None
        self._ranks_logged: int | None = None
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115 - lives with the run
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))

    @property
    def path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def log(self, tag: str, values: Mapping[str, Any], step: int, epoch: int | None = None) -> None:
        """Write the numeric entries of ``values`` under ``tag`` at ``step`` (rank 0 only)."""
        if not self.enabled or self._file is None:
            return
        numbers = {k: v for k, v in ((k, scalar(v)) for k, v in values.items()) if v is not None}
        record: dict[str, Any] = {"tag": tag, "step": int(step), "epoch": epoch, "time": round(time.time(), 3)}
        record.update({k: (v if math.isfinite(v) else str(v)) for k, v in numbers.items()})
        self._file.write(json.dumps(record) + "\n")
        if time.monotonic() - self._flushed >= self.flush_seconds:
            self.flush()
        if self._writer is not None and (tag != "train" or step % self.tensorboard_every == 0):
            for key, value in numbers.items():
                self._writer.add_scalar(f"{tag}/{key}", value, int(step))

    def attach(self, trainer: Engine, evaluators: Mapping[str, Engine] | None = None) -> RunLogger:
        """Log the trainer's loss every ``every`` iterations and each evaluator's metrics when it completes."""
        self._trainer = trainer
        if not self.enabled:
            return self
        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=self.every), self._log_train)
        self._observer = observer_of(trainer)
        if self._observer is not None and self._observer.collectives:
            trainer.add_event_handler(Events.EPOCH_COMPLETED, self._log_ranks)
            trainer.add_event_handler(Events.COMPLETED, self._log_ranks)
        trainer.add_event_handler(Events.COMPLETED, lambda _: self.flush())
        for tag, evaluator in (evaluators or {}).items():
            evaluator.add_event_handler(Events.COMPLETED, self._log_evaluation, tag)
        return self

    def _log_train(self, engine: Engine) -> None:
        values = {"loss": engine.state.output, **engine.state.metrics}
        if getattr(engine.state, "grad_norm", None) is not None:
            values["grad_norm"] = engine.state.grad_norm
        values.update(getattr(engine.state, "observed", None) or {})
        self.log("train", values, engine.state.iteration, engine.state.epoch)

    def _log_ranks(self, engine: Engine) -> None:
        observer = self._observer
        step = engine.state.iteration
        if observer is None or observer.ranks_step != step or self._ranks_logged == step:
            return
        self._ranks_logged = observer.ranks_step
        for rank, values in enumerate(observer.ranks):
            self.log(f"rank{rank}", values, engine.state.iteration, engine.state.epoch)

    def _log_evaluation(self, evaluator: Engine, tag: str) -> None:
        state = self._trainer.state if self._trainer is not None else evaluator.state
        self.log(tag, evaluator.state.metrics, state.iteration, state.epoch)

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if self._file is not None:
            self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_HANDLER_FLAG = "_meshwise_handler"


def setup_logging(
    topology: Topology | None = None,
    *,
    level: int = logging.INFO,
    others: int = logging.WARNING,
    ignite_level: int = logging.WARNING,
) -> logging.Handler:
    """Send log records and Python warnings to stderr, each line tagged with this rank and its coordinate.

    ``[rank 3 (dp=1, tp=1)] WARNING py.warnings: ...`` tells which process of a multi-process run spoke
    (no tag in a world of one). Global rank 0 logs at ``level``, the other ranks at ``others`` (WARNING: the
    same INFO line from every rank says nothing more, an error or warning of one rank is kept), and ignite's
    own loggers (an engine's "run starting" / "Epoch[1] Complete" at every run of every evaluator) at
    ``ignite_level``. Replaces a handler installed by an earlier call; returns the handler.
    """
    topo = resolve(topology)
    prefix = f"[{topo.label()}] " if topo.world_size > 1 else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(prefix.replace("%", "%%") + "%(levelname)s %(name)s: %(message)s"))
    setattr(handler, _HANDLER_FLAG, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_FLAG, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if topo.rank == 0 else max(level, others))
    logging.getLogger("ignite").setLevel(ignite_level if topo.rank == 0 else max(ignite_level, others))
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    return handler
