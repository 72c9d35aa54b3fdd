"""Run a function on N real gloo processes with a hard timeout, for tests and checks.

Processes are forked from a forkserver that has already imported torch, so a launch costs
a fraction of a second instead of an ``import torch`` per rank. The first failing rank's
traceback is re-raised, labelled with its rank and mesh coordinate; no process outlives the call.
"""

from __future__ import annotations

import contextlib
import io
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

__all__ = [
    "CollectiveCounter",
    "DistributedFailure",
    "describe_launches",
    "free_port",
    "process_context",
    "run_command",
    "run_distributed",
    "run_script",
]

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
    "meshwise.testing_extras",  # datasets, transformers, PhysicsNeMo where installed, each skipped on any error
]
_CTX: Any = None


class DistributedFailure(AssertionError):
    """A rank of :func:`run_distributed` raised, died or did not finish in time."""


def process_context() -> Any:
    """The multiprocessing context :func:`run_distributed` forks its ranks from: a forkserver that has imported
    torch, DTensor, FSDP, DCP, torchmetrics, ignite and meshwise. A test that needs fresh processes of its own
    (``ProcessPoolExecutor(mp_context=process_context(), max_tasks_per_child=1)``) starts them in a fraction of a
    second instead of an ``import torch`` each."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


class _Launch:
    """What one launch did and when (wall-clock seconds), for the messages of a launch or a test that ran too long."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start = time.time()
        self.end: float | None = None
        self.outcome = "still running"
        self.phases: dict[int, list[tuple[str, float]]] = {}  # rank -> [(phase, time)]

    def mark(self, rank: int, phase: str, when: float | None = None) -> None:
        self.phases.setdefault(rank, []).append((phase, time.time() if when is None else when))

    def finish(self, outcome: str) -> None:
        self.end, self.outcome = time.time(), outcome

    def text(self) -> str:
        took = (self.end or time.time()) - self.start
        lines = [f"{self.what}: {self.outcome} after {took:.1f}s"]
        for rank in sorted(self.phases):
            steps = ", ".join(f"{phase} at {when - self.start:.1f}s" for phase, when in self.phases[rank])
            lines.append(f"  rank {rank}: {steps}" if rank >= 0 else f"  {steps}")
        return "\n".join(lines)


_LAUNCHES: list[_Launch] = []  # the recent launches of this process, oldest first (the last 50)


def _record(what: str) -> _Launch:
    launch = _Launch(what)
    _LAUNCHES.append(launch)
    del _LAUNCHES[:-50]
    return launch


def describe_launches(since: float) -> str:
    """The launches of :func:`run_distributed` and :func:`run_command` started at or after ``since``
    (``time.time()``), phase by phase: when each rank started (forked, its function's module imported), joined
    the process group and finished, or that it was still running. ``tests/conftest.py`` adds this to a test that
    passed its timeout, so the message says which launch was slow and where."""
    return "\n".join(launch.text() for launch in _LAUNCHES if launch.start >= since)


def _call_text(fn: Callable[..., Any], nprocs: int, mesh: Any) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    where = f", mesh={mesh}" if mesh is not None else ""
    return f"run_distributed({getattr(fn, '__module__', '?')}.{name}, {nprocs} ranks{where})"


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

    results.put((rank, "phase", "started", time.time()))  # forked, fn's module imported
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
            results.put((rank, "phase", "joined", time.time()))
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

    ctx = process_context()
    launch = _record(_call_text(fn, nprocs, mesh))
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
    launch.mark(-1, "all forked")
    try:
        outputs = _collect(procs, results, timeout, launch)
        # Ranks that returned exit as a script would: after their non-daemon threads (a checkpoint's deferred
        # 'latest' update, say). Killing them at once would lose what such a thread still had to write.
        end = time.monotonic() + 10.0
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        launch.finish("finished")
        return outputs
    except DistributedFailure as exc:
        launch.finish("failed")
        _reap(procs)
        raise DistributedFailure(f"{exc}{reports_note(index)}") from None
    finally:
        if launch.end is None:
            launch.finish("interrupted")  # the test's own timeout, or ^C
        _reap(procs)
        results.close()
        del store
        shutil.rmtree(index, ignore_errors=True)


def _collect(procs: Sequence[Any], results: Any, timeout: float, launch: _Launch) -> list[Any]:
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
                    f"(finished: {sorted(labels.values())}); all processes were killed. Phases:\n{launch.text()}"
                ) from None
            continue
        if status == "phase":
            launch.mark(rank, label, payload)
            continue
        labels[rank] = label
        launch.mark(rank, "returned" if status == "ok" else "raised")
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
    launch = _record(f"run_command({' '.join(map(str, cmd))[:300]})")
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
        launch.finish(f"exited with {proc.returncode}")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        launch.finish("killed")
        raise DistributedFailure(f"{' '.join(cmd)} did not finish within {timeout:.0f}s; output:\n{out}") from None
    finally:
        if launch.end is None:
            launch.finish("interrupted")
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers, should any be left
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(list(cmd), proc.returncode, out, "")
    if check and proc.returncode != 0:
        raise DistributedFailure(f"{' '.join(cmd)} exited with {proc.returncode}; output:\n{out}")
    return result


def run_script(
    path: str | os.PathLike[str],
    nprocs: int,
    args: Sequence[str] = (),
    *,
    mesh: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> list[str]:
    """Run a training script as ``meshwise run --nproc-per-node nprocs [--mesh mesh] path args`` runs it, each rank
    the unmodified file as ``__main__`` with the launcher variables set (``MESHWISE_MESH`` from ``mesh``), but on
    ranks forked from :func:`process_context`'s forkserver instead of a fresh interpreter each: the script's own
    numbers in a fraction of the start-up. Returns each rank's output (stdout and stderr), by rank; a rank that
    raises or exits non-zero raises :class:`DistributedFailure` with its output. Test the launcher itself with
    :func:`run_command`."""
    variables = {"PYTHONUNBUFFERED": "1", **(env or {})}
    if mesh is not None:
        variables["MESHWISE_MESH"] = mesh
    where = None if cwd is None else os.fspath(cwd)
    return run_distributed(_script_rank, nprocs, os.fspath(path), list(args), where, env=variables, timeout=timeout)


def _script_rank(path: str, args: list[str], cwd: str | None) -> str:
    """One rank of :func:`run_script`: the script as ``__main__`` (its folder first on ``sys.path``, as python
    puts it), its output captured."""
    import runpy

    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise DistributedFailure(f"{path} exited with {exc.code}; its output:\n{buffer.getvalue()}") from None
    except BaseException as exc:
        raise DistributedFailure(f"{path} raised {type(exc).__name__}; its output:\n{buffer.getvalue()}") from exc
    return buffer.getvalue()
