"""Run a function on N real gloo processes with a hard timeout, for tests and checks.

Processes are forked from a forkserver that has already imported torch, so a launch costs
a fraction of a second instead of an ``import torch`` per rank. The first failing rank's
traceback is re-raised, labelled with its rank and mesh coordinate; no process outlives the call.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["CollectiveCounter", "DistributedFailure", "free_port", "run_command", "run_distributed"]

# What most ranks import: loaded once in the forkserver instead of once per rank. Missing packages are
# skipped (ImportError); only finished modules belong here, since any other error stops the forkserver.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "numpy",
    "torchmetrics",
    "ignite.engine",
    "meshwise",
    "meshwise.topology",
]
_CTX: Any = None


class DistributedFailure(AssertionError):
    """A rank of :func:`run_distributed` raised, died or did not finish in time."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


class CollectiveCounter:
    """Records the ``torch.distributed`` collectives called while active, by name; calls go through unchanged.

    ``with CollectiveCounter() as c: metric.compute()`` then ``c.calls == ["all_reduce"]``.
    """

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "broadcast_object_list", "barrier")

    def __init__(self, names: Sequence[str] = NAMES) -> None:
        self.names = tuple(names)
        self.calls: list[str] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed as dist

        for name in self.names:
            real = self._saved[name] = getattr(dist, name)

            def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                self.calls.append(_name)
                return _real(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for name, real in self._saved.items():
            setattr(dist, name, real)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    mesh: Any,
    roles: Any,
    pg_timeout: float,
    env: Mapping[str, str],
    results: Any,
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **env,
        }
    )
    import torch

    torch.set_num_threads(1)  # N ranks on 2 cores: oversubscribing threads only slows every rank
    import meshwise
    from meshwise.debug.watchdog import leave_report

    label = f"rank {rank}"
    try:
        if mesh is None:
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                leave_report(traceback.format_exc())  # its crash report (last guarded calls) stays, with this
                raise
            finally:
                if meshwise.current() is not None:  # as a script should: tell the others this rank has left
                    meshwise.shutdown()
        else:
            topo = meshwise.init(mesh, roles=roles, timeout=pg_timeout)
            label = topo.label()
            try:
                out = fn(topo, *args, **kwargs)
            except BaseException:
                leave_report(traceback.format_exc())
                raise
            finally:
                meshwise.shutdown()
        # Plain pickle: torch's queue reducer would pass tensors by shared memory that dies with this process.
        results.put((rank, "ok", label, pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        current = meshwise.current()
        if current is not None:
            label = current.label()
        results.put((rank, "error", label, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()  # the message must leave before the process does
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # do not run atexit hooks that could block on a dead group


def run_distributed(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    mesh: Mapping[str, int] | str | None = None,
    roles: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` on ``nprocs`` gloo processes and return each rank's return value, by rank.

    With ``mesh``, each rank calls ``meshwise.init(mesh, roles=roles, timeout=pg_timeout)`` and
    ``fn(topology, *args, **kwargs)``; without, ``fn(*args, **kwargs)`` runs with the launcher
    variables set. ``fn`` must be importable (a module-level function). After ``timeout``
    seconds every process is killed and :class:`DistributedFailure` names the ranks that had not
    finished. Put many checks in one ``fn``: each launch costs process start-up. Return plain values
    (numbers, lists, tensors are pickled by value). Inside the ranks the default start method is the
    forkserver's; DataLoader workers should ask for ``fork`` (``meshwise.data`` does).
    """
    import datetime

    from torch.distributed import TCPStore

    from meshwise.debug.crash import INDEX_VARIABLE, reports_note

    ctx = _context()
    results = ctx.Queue()
    # The store lives here, as torchrun's agent hosts it: a rank that exits (rank 0 included) leaves it to the others.
    store = TCPStore(
        "127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )
    port = store.port
    index = tempfile.mkdtemp(prefix="meshwise-reports-")  # where each rank names its crash report
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", INDEX_VARIABLE: index, **(env or {})}
    if "MESHWISE_RUN_DIR" not in env and "MESHWISE_RUN_DIR" not in os.environ:  # hang reports of tests: not in cwd
        env["MESHWISE_RUN_DIR"] = os.path.join(tempfile.gettempdir(), "meshwise-run-distributed")
    procs = [
        ctx.Process(
            target=_child,
            args=(r, nprocs, port, fn, args, kwargs, mesh, roles, pg_timeout, env, results),
            daemon=False,  # ranks may start DataLoader workers; _reap kills them whatever happens
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    try:
        outputs = _collect(procs, results, timeout)
        # Ranks that returned exit as a script would: after their non-daemon threads (a checkpoint's deferred
        # 'latest' update, say). Killing them at once would lose what such a thread still had to write.
        end = time.monotonic() + 10.0
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        return outputs
    except DistributedFailure as exc:
        _reap(procs)
        raise DistributedFailure(f"{exc}{reports_note(index)}") from None
    finally:
        _reap(procs)
        results.close()
        del store
        shutil.rmtree(index, ignore_errors=True)


def _collect(procs: Sequence[Any], results: Any, timeout: float) -> list[Any]:
    """Each rank's return value, by rank; the first failing, dead or late rank raises :class:`DistributedFailure`."""
    nprocs = len(procs)
    outputs: dict[int, Any] = {}
    labels: dict[int, str] = {}
    failure: tuple[int, str, str] | None = None
    deadline = time.monotonic() + timeout
    while len(outputs) < nprocs and failure is None:
        try:
            rank, status, label, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
            if dead:
                time.sleep(0.5)  # a dying rank may still have its traceback in the queue
                try:
                    rank, status, label, payload = results.get(timeout=0.5)
                except queue.Empty:
                    r = dead[0]
                    failure = (r, f"rank {r}", f"process died: {_exit_text(procs[r].exitcode)}")
                    break
            elif time.monotonic() > deadline:
                missing = [r for r in range(nprocs) if r not in outputs]
                raise DistributedFailure(
                    f"ranks {missing} of {nprocs} did not finish within {timeout:.0f}s "
                    f"(finished: {sorted(labels.values())}); all processes were killed"
                ) from None
            continue
        labels[rank] = label
        if status == "ok":
            outputs[rank] = pickle.loads(payload)
        else:
            failure = (rank, label, payload)
    if failure is not None:
        rank, label, text = failure
        raise DistributedFailure(f"{label} of {nprocs} failed:\n{text}")
    return [outputs[r] for r in range(nprocs)]


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _reap(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


def run_command(
    cmd: Sequence[str],
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a command in its own process group; on timeout the whole group is killed.

    Used for tests of ``meshwise run`` and of scripts under it, where torchrun's children must not
    outlive the test.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise DistributedFailure(f"{' '.join(cmd)} did not finish within {timeout:.0f}s; output:\n{out}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers, should any be left
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(list(cmd), proc.returncode, out, "")
    if check and proc.returncode != 0:
        raise DistributedFailure(f"{' '.join(cmd)} exited with {proc.returncode}; output:\n{out}")
    return result
