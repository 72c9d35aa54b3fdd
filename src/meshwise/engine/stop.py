"""A trainer that stops cleanly on SIGINT/SIGTERM: at the step the ranks agreed on (:mod:`meshwise.debug.interrupt`),
after the ``TERMINATE`` handlers (``Checkpointing`` writes its checkpoint there), the process exits quietly with
128 + the signal's number and the one line that says where it stopped and how to resume."""

from __future__ import annotations

from ignite.engine import Engine, Events

from meshwise.debug import interrupt

__all__ = ["attach", "stopping"]


def attach(engine: Engine) -> None:
    """Let a signal stop ``engine``'s runs at an agreed step (``create_trainer`` calls this)."""
    engine.add_event_handler(Events.STARTED, _started)
    engine.add_event_handler(Events.ITERATION_COMPLETED, _check)
    engine.add_event_handler(Events.COMPLETED, _completed)


def stopping(engine: Engine) -> bool:
    """Whether ``engine`` is stopping because of a signal (``TERMINATE`` handlers ask, e.g. to save first)."""
    return bool(getattr(engine.state, "meshwise_signal_stop", False))


def _started(engine: Engine) -> None:
    if not getattr(engine, "_meshwise_in_loop", False):
        engine._meshwise_in_loop = True  # type: ignore[attr-defined]
        interrupt.loop_started()


def _leave(engine: Engine) -> None:
    if getattr(engine, "_meshwise_in_loop", False):
        engine._meshwise_in_loop = False  # type: ignore[attr-defined]
        interrupt.loop_ended()


def _check(engine: Engine) -> None:
    if interrupt.received() is None:
        return
    stop_at = interrupt.agreed_step(engine.state.iteration)
    if stop_at is not None and engine.state.iteration >= stop_at and not stopping(engine):
        engine.state.meshwise_signal_stop = True
        # The exit runs after every other TERMINATE handler (a checkpoint first); COMPLETED handlers (a final
        # evaluation, "training done") do not run: the run did not complete.
        engine.add_event_handler(Events.TERMINATE, _exit)
        engine.terminate(skip_completed=True)


def _exit(engine: Engine) -> None:
    _leave(engine)
    s = engine.state
    interrupt.write_stop(s.iteration, s.epoch, s.epoch_length)
    engine.logger.disabled = True  # ignite logs the exit below at ERROR as if the run had failed
    raise SystemExit(interrupt.exit_code())


def _completed(engine: Engine) -> None:
    _leave(engine)
    if interrupt.received() is not None:  # the signal came in the last step: the run is whole, stop here anyway
        s = engine.state
        interrupt.write_stop(s.iteration, s.epoch, s.epoch_length)
        engine.logger.disabled = True
        raise SystemExit(interrupt.exit_code())
