"""A clean stop on SIGINT, SIGTERM or SIGUSR1: the signal is noted, the ranks agree on one step to stop at, and the
process ends quietly with 128 + the signal's number, as shells report an interrupted command. SIGUSR1 is the
warning a scheduler sends before it kills a job (SLURM's ``--signal=USR1@120``): the run saves and ends with 138,
which a batch script takes as "requeue me" (docs/cluster.md).

Ctrl-C reaches ``meshwise run`` (torchrun's workers run in sessions of their own), which forwards it to every
worker; SLURM's pre-kill signal and ``scancel`` send SIGTERM to every task. Each rank's handler only notes the
signal while a training loop runs (:func:`loop_started`), because a Python handler cannot run while the main
thread waits in a collective, and a rank that left mid-step would leave its peers in that step's collectives.
The first rank to see the signal at the end of a step proposes the next step as the last through the
rendezvous store (``compare_set``: one proposal wins) and tells every rank's watchdog thread, so a rank
that got no signal of its own stops there too. Ranks step in lockstep, at most one step apart, so every rank
can still reach that step. Outside a training loop, or at a second signal, the process exits at once; a
SIGTERM again within a few seconds of the first is the same stop told twice (SLURM signals every process of a
step, torchrun's workers included, and torchrun forwards its own copy), not a second signal.

What the stop leaves (the step, the checkpoint written, the command that resumes) goes to the launcher's
report folder, and ``meshwise run`` prints it as one line; without a launcher rank 0 prints it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshwise import compat
from meshwise.topology import Topology

__all__ = [
    "INDEX_VARIABLE",
    "REQUEUE_CODE",
    "STORE_PREFIX",
    "STOP_FILE",
    "agreed_step",
    "exit_code",
    "install",
    "learn",
    "loop_ended",
    "loop_started",
    "note_checkpoint",
    "received",
    "slurm_job_note",
    "stop_line",
    "uninstall",
    "write_stop",
]

INDEX_VARIABLE = "MESHWISE_REPORT_INDEX"  # a folder where each rank names its report file (set by launchers)
STORE_PREFIX = "meshwise/debug"  # every key the debug package keeps in the rendezvous store starts with it
STOP_FILE = "stopped.json"  # in the launcher's report folder: what meshwise run prints after a stop
_STORE_KEY = "meshwise/interrupt/stop-at"
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
REQUEUE_CODE = 128 + signal.SIGUSR1  # a run stopped by the scheduler's warning: saved, to be requeued
_REPEAT_S = 5.0  # a SIGTERM/SIGUSR1 within this many seconds of the stop's is the same stop (SLURM's, torchrun's)


class _State:
    def __init__(self) -> None:
        self.signum: int | None = None  # the signal this process got (or learnt from a peer)
        self.since: float | None = None  # when (time.monotonic()) it came
        self.stop_at: int | None = None  # the agreed last step
        self.loops = 0  # training loops running now
        self.previous: dict[int, Any] = {}
        self.topo: Topology | None = None
        self.checkpoint: dict[str, Any] | None = None


_STATE = _State()


def install(topo: Topology) -> None:
    """Handle SIGINT, SIGTERM and SIGUSR1 for this run, where they still have Python's default handlers (a handler
    the program installed itself is left alone), and only from the main thread (Python's rule for handlers)."""
    _STATE.__init__()
    _STATE.topo = topo
    if threading.current_thread() is not threading.main_thread():
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    defaults[signal.SIGUSR1] = signal.SIG_DFL
    for sig in _SIGNALS:
        current = signal.getsignal(sig)
        if current is defaults[sig]:
            _STATE.previous[sig] = current
            signal.signal(sig, _handle)


def uninstall() -> None:
    """Give the signals their earlier handlers back (``meshwise.shutdown``)."""
    if threading.current_thread() is threading.main_thread():
        for sig, handler in _STATE.previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
    _STATE.previous.clear()


def _handle(signum: int, frame: Any) -> None:
    now = time.monotonic()
    if _STATE.signum is None and _STATE.loops > 0:
        _STATE.signum, _STATE.since = signum, now  # the training loop stops at the agreed step (loop_step)
        return
    recent = _STATE.since is not None and now - _STATE.since < _REPEAT_S
    if signum == _STATE.signum != signal.SIGINT and recent:
        return  # the same stop told twice: SLURM signals every process of the step, and torchrun forwards its own
    # No loop to stop cleanly, or a second signal: end now, quietly. ignite logs an exception leaving a run at
    # ERROR ("Engine run is terminating due to exception"), which is noise here: the process is ending.
    _STATE.signum = _STATE.signum or signum
    logging.disable(logging.ERROR)
    raise SystemExit(128 + signum)


def received() -> int | None:
    """The signal this process got (or learnt from a peer that stops the run), or None."""
    return _STATE.signum


def exit_code() -> int:
    """128 + the signal's number (130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1: requeue), as shells report it."""
    return 128 + (_STATE.signum or signal.SIGINT)


def loop_started() -> None:
    """A training loop runs: a signal now stops it at an agreed step instead of ending the process."""
    _STATE.loops += 1


def loop_ended() -> None:
    _STATE.loops = max(0, _STATE.loops - 1)


def learn(stop_at: int, signum: int) -> None:
    """A peer stops the run after step ``stop_at`` (called by the watchdog thread that received the message)."""
    if _STATE.stop_at is None:
        _STATE.stop_at = int(stop_at)
    if _STATE.signum is None:
        _STATE.signum, _STATE.since = int(signum), time.monotonic()


def agreed_step(iteration: int) -> int | None:
    """At the end of step ``iteration``: the step every rank stops after, once a signal came, else None.

    The first rank to propose wins; it proposes the next step, which every rank can still reach (no rank is
    past it: it would need this rank in that step's collectives)."""
    if _STATE.stop_at is not None or _STATE.signum is None:
        return _STATE.stop_at
    topo = _STATE.topo
    if topo is None or topo.world_size == 1 or not dist.is_initialized():
        _STATE.stop_at = iteration
        return iteration
    proposal = json.dumps({"stop_at": iteration + 1, "signal": _STATE.signum})
    try:
        store = compat.default_store()
        stored = store.compare_set(_STORE_KEY, "", proposal).decode()
        if stored == proposal:
            for r in range(topo.world_size):
                if r != topo.rank:
                    store.queue_push(f"{STORE_PREFIX}/queue/{r}", proposal)
        _STATE.stop_at = int(json.loads(stored)["stop_at"])
    except (RuntimeError, dist.DistError, ValueError, KeyError):
        _STATE.stop_at = iteration + 1  # no store: every rank got the signal from the launcher and proposes alike
    return _STATE.stop_at


def note_checkpoint(step: int | None, folder: str | os.PathLike[str], saved: bool) -> None:
    """What the stop leaves to resume from (told by ``Checkpointing``): ``step`` None when there is none."""
    _STATE.checkpoint = {"step": step, "folder": str(folder), "saved": saved}


def write_stop(iteration: int, epoch: int, epoch_length: int | None) -> None:
    """Tell the launcher where the run stopped (one file in its report folder, from every rank: each node's launcher
    says it), or, with no launcher to say it, print the one line here (rank 0)."""
    topo = _STATE.topo
    index = os.environ.get(INDEX_VARIABLE)
    launched = bool(index) and os.path.isdir(str(index))
    if topo is not None and topo.rank != 0 and not launched:
        return
    record = {
        "signal": _STATE.signum,
        "step": iteration,
        "epoch": epoch,
        "epoch_length": epoch_length,
        "checkpoint": _STATE.checkpoint,
    }
    if launched:
        with contextlib.suppress(OSError):
            mine = Path(str(index), f"{STOP_FILE}.{os.getpid()}")
            mine.write_text(json.dumps(record), encoding="utf-8")
            os.replace(mine, Path(str(index), STOP_FILE))  # the node's ranks agree: any one of them whole
            return
    if topo is not None and topo.rank != 0:
        return
    command = shlex.join([os.path.basename(sys.executable), *sys.argv])
    print(stop_line(record, command, "meshwise"), file=sys.stderr, flush=True)


def slurm_job_note() -> str:
    """`` (SLURM job N)`` inside a SLURM job (scancel, scontrol requeue and the time limit all send SIGTERM), else
    nothing; a requeued job says which run of the job it was."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return ""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return f" (SLURM job {job}" + (f", requeued {restarts} time(s)" if restarts not in ("", "0") else "") + ")"


def stop_line(record: dict[str, Any], command: str, who: str) -> str:
    """The one line a stopped run ends with: the signal (and the SLURM job it ended), the step and epoch, what to
    resume from, and how."""
    name = signal.Signals(record["signal"]).name if record.get("signal") else "a signal"
    name += slurm_job_note()
    where = f"step {record['step']}"
    if record.get("epoch"):
        where += f" (epoch {record['epoch']}"
        length = record.get("epoch_length")
        if length:
            where += f", step {record['step'] - (record['epoch'] - 1) * length} of {length}"
        where += ")"
    ckpt = record.get("checkpoint")
    if ckpt is None:
        return (
            f"{who}: stopped by {name} after {where}; no checkpoint to resume from (attach "
            f"meshwise.engine.handlers.Checkpointing to keep one). Run again from the start: {command}"
        )
    if ckpt.get("step") is None:
        return f"{who}: stopped by {name} after {where}; no checkpoint in {ckpt['folder']} yet. Run again: {command}"
    saved = "saved" if ckpt.get("saved") else "latest"
    return (
        f"{who}: stopped by {name} after {where}; checkpoint {saved} at step {ckpt['step']} in {ckpt['folder']}. "
        f"Resume: {command}"
    )
