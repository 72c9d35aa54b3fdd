"""ignite habits judged when a handler is attached, not an epoch later: ignite's progress bars and loggers made
leader-only, ignite checkpoint handlers that would save one shard refused, on engines meshwise builds or adopts."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

from ignite.engine import Engine, RemovableEventHandle

from meshwise import compat
from meshwise.checkpoint import check_ignite_checkpoints
from meshwise.topology import Topology, resolve

__all__ = ["check_on_attach", "ignite_logger_of"]

log = logging.getLogger(__name__)
_FLAG = "_meshwise_attach_checks"
_warned: set[str] = set()  # logger classes already warned about in this process


def ignite_logger_of(handler: Any, args: tuple) -> Any:
    """The ignite ``BaseLogger`` (``ProgressBar``, ``TensorboardLogger``, W&B, MLflow, ...) a handler belongs to, or
    None: its log handlers get the logger as first argument, its own methods (a bar's close) are bound to it."""
    from ignite.handlers.base_logger import BaseLogger

    if args and isinstance(args[0], BaseLogger):
        return args[0]
    owner = getattr(compat.handler_parent(handler), "__self__", None)
    return owner if isinstance(owner, BaseLogger) else None


def _leader_only(logger: Any, topo: Topology) -> None:
    """Say once (rank 0) that an ignite logger attached on every rank is kept on rank 0 only, and how to avoid it."""
    from ignite.handlers import ProgressBar

    name = type(logger).__name__
    if isinstance(logger, ProgressBar) or name in _warned or topo.rank != 0:
        return  # a bar made leader-only is exactly what was meant: nothing to say
    _warned.add(name)
    warnings.warn(
        f"ignite's {name} is attached on every rank: meshwise keeps its handlers on global rank 0 only, so the "
        f"run is logged once (not {topo.world_size} times), but each rank built its own {name} (a TensorBoard "
        "event file, a tracker run per rank). Create it on rank 0 only: `if topo.rank == 0: logger = "
        f"{name}(...); logger.attach(...)`, or use meshwise.engine.RunLogger (docs/training.md)",
        stacklevel=4,
    )


def check_on_attach(engine: Engine, topology: Topology | None = None) -> Engine:
    """Judge every handler as it is attached to ``engine`` (its ``add_event_handler``, used by ``engine.on``, ignite
    loggers' and checkpoints' ``attach``); returns the engine. A second call adds nothing.

    - ignite's ``ProgressBar`` and other loggers (``TensorboardLogger``, W&B, MLflow, ...): registered on global
      rank 0 only (their handlers make no collective, so leaving them out elsewhere cannot hang); a logger
      other than a bar is warned about once, since each rank still built one;
    - an ignite ``Checkpoint``/``ModelCheckpoint`` with ``DiskSaver`` on sharded state: refused now with the
      :class:`~meshwise.errors.CheckpointError` of :func:`~meshwise.checkpoint.check_ignite_checkpoints`.
    """
    topo = resolve(topology)
    if getattr(engine, _FLAG, False):
        return engine
    original = engine.add_event_handler

    @functools.wraps(original)
    def add_event_handler(event_name: Any, handler: Any, *args: Any, **kwargs: Any) -> RemovableEventHandle:
        logger = ignite_logger_of(handler, args)
        if logger is not None:
            _leader_only(logger, topo)
            if topo.rank != 0:
                return RemovableEventHandle(event_name, handler, engine)  # removing it later is a no-op
        handle = original(event_name, handler, *args, **kwargs)
        try:
            check_ignite_checkpoints(engine, topo)
        except Exception:
            handle.remove()
            raise
        return handle

    engine.add_event_handler = add_event_handler  # type: ignore[method-assign]
    setattr(engine, _FLAG, True)
    return engine
