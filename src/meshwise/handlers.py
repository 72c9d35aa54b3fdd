"""Rank-aware ignite handlers: one progress bar (global rank 0), one JSON-lines + TensorBoard log per run,
and log/warning lines tagged with the rank and mesh coordinate that produced them."""

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

import torch
from ignite.engine import Engine, Events

from meshwise.errors import MeshwiseError
from meshwise.topology import Topology

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _topology(topology: Topology | None, engine: Engine | None = None) -> Topology | None:
    if topology is not None:
        return topology
    found = getattr(engine, "topology", None)
    if found is not None:
        return found
    import meshwise

    return meshwise.current()


def _is_writer(topology: Topology | None) -> bool:
    return topology is None or topology.rank == 0


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().reshape(()).item())
    return None


def progress_bar(
    engine: Engine,
    topology: Topology | None = None,
    *,
    output_name: str = "loss",
    **tqdm_kwargs: Any,
) -> Any:
    """Attach a tqdm progress bar showing ``engine.state.output`` as ``output_name`` on global rank 0 only.

    Returns ignite's ``ProgressBar`` on rank 0 and ``None`` on every other rank, so a run of N
    processes draws one bar, not N. ``tqdm_kwargs`` go to tqdm (e.g. ``file=``, ``ncols=``).
    """
    topo = _topology(topology, engine)
    if not _is_writer(topo):
        return None
    from ignite.handlers import ProgressBar

    bar = ProgressBar(**tqdm_kwargs)
    bar.attach(engine, output_transform=lambda out: {output_name: out} if _scalar(out) is not None else {})
    return bar


class RunLogger:
    """Writes a run's numbers once: ``RUN_DIR/metrics.jsonl`` (one JSON object a line) and TensorBoard events.

    Only global rank 0 writes; on other ranks every method is a no-op, so the files exist once per
    run. Each line is ``{"tag": "train", "step": 12, "epoch": 1, "time": ..., "loss": 0.53, ...}``.
    Attach it to a trainer (logs ``engine.state.output`` as ``loss`` and ``grad_norm`` when clipping)
    and to evaluators (logs their ``state.metrics`` under their tag at the trainer's step). The file is
    appended to, so a resumed run continues its log.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        topology: Topology | None = None,
        *,
        tensorboard: bool = True,
        every: int = 1,
    ) -> None:
        if every < 1:
            raise MeshwiseError(f"RunLogger every={every}: log every n >= 1 iterations")
        self.run_dir = Path(run_dir)
        self.topology = _topology(topology)
        self.every = every
        self.enabled = _is_writer(self.topology)
        self._file = None
        self._writer = None
        self._trainer: Engine | None = None
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
        numbers = {k: v for k, v in ((k, _scalar(v)) for k, v in values.items()) if v is not None}
        record: dict[str, Any] = {"tag": tag, "step": int(step), "epoch": epoch, "time": round(time.time(), 3)}
        record.update({k: (v if math.isfinite(v) else str(v)) for k, v in numbers.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in numbers.items():
                self._writer.add_scalar(f"{tag}/{key}", value, int(step))

    def attach(self, trainer: Engine, evaluators: Mapping[str, Engine] | None = None) -> RunLogger:
        """Log the trainer's loss every ``every`` iterations and each evaluator's metrics when it completes."""
        self._trainer = trainer
        if self.topology is None:
            self.topology = getattr(trainer, "topology", None)
            self.enabled = self.enabled and _is_writer(self.topology)
        if not self.enabled:
            return self

        def log_train(engine: Engine) -> None:
            values = {"loss": engine.state.output, **engine.state.metrics}
            if getattr(engine.state, "grad_norm", None) is not None:
                values["grad_norm"] = engine.state.grad_norm
            self.log("train", values, engine.state.iteration, engine.state.epoch)

        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=self.every), log_train)
        trainer.add_event_handler(Events.COMPLETED, lambda _: self.flush())
        for tag, evaluator in (evaluators or {}).items():
            evaluator.add_event_handler(Events.COMPLETED, self._log_evaluation, tag)
        return self

    def _log_evaluation(self, evaluator: Engine, tag: str) -> None:
        state = self._trainer.state if self._trainer is not None else evaluator.state
        self.log(tag, evaluator.state.metrics, state.iteration, state.epoch)

    def flush(self) -> None:
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


def setup_logging(topology: Topology | None = None, *, level: int = logging.INFO) -> logging.Handler:
    """Send log records and Python warnings to stderr, each line tagged with this rank and its coordinate.

    ``[rank 3 (dp=1, tp=1)] WARNING py.warnings: ...`` tells which process of a multi-process run spoke.
    Replaces a handler installed by an earlier call; returns the handler.
    """
    topo = _topology(topology)
    label = topo.label() if topo is not None and topo.world_size > 1 else None
    prefix = f"[{label}] " if label else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(prefix.replace("%", "%%") + "%(levelname)s %(name)s: %(message)s"))
    setattr(handler, _HANDLER_FLAG, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_FLAG, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    return handler
