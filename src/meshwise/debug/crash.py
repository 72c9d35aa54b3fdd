"""A report that survives a process killed by a fatal signal: each rank's last guarded calls and its Python stacks.

gloo aborts a process (SIGABRT, no Python exception) when a collective's peers disagree on sizes; nothing in
Python runs after that. So every rank keeps, from ``meshwise.init`` on, a file ``RUN_DIR/crash-<time>/rank-N.txt``
whose head is rewritten in place (a shared memory map: no system call, the kernel keeps the page when the
process dies) with the calls the watchdog knows this rank is in, and after which ``faulthandler`` writes every
thread's Python stack on a fatal signal. A rank that shuts down cleanly deletes its file; one that ends on an
exception keeps it, rewritten as its head and the traceback (no padding). Launchers that set
``MESHWISE_REPORT_INDEX`` (``meshwise run``, ``run_distributed``) learn each rank's file there, and each failing
rank's error in one line (:func:`read_failures`), so the launcher can end with the first root cause; peers find
the reports through the store (``crash_report``). Ranks failing with the same error print its traceback once.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import mmap
import os
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch.distributed as dist

from meshwise.debug import interrupt
from meshwise.debug.interrupt import INDEX_VARIABLE
from meshwise.topology import Topology

__all__ = [
    "HEAD_BYTES",
    "INDEX_VARIABLE",
    "CrashRecord",
    "compact",
    "install_launch_hook",
    "crash_report",
    "error_record",
    "left_reports",
    "read_failures",
    "read_report",
    "reports_note",
    "summary",
]

HEAD_BYTES = 4096  # the rewritten head: the last calls; the stacks follow it
_STORE_KEY = "meshwise/debug/crash"
_STACKS_LINE = "Python stacks of every thread, if a fatal signal killed the process:"


class CrashRecord:
    """This rank's report file: a head rewritten at every guarded call, then ``faulthandler``'s stacks."""

    def __init__(self, topo: Topology, store: dist.Store | None) -> None:
        folder = topo.run_dir / f"crash-{_job_stamp(store)}"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = (folder / f"rank-{topo.rank:05d}.txt").absolute()
        self.file: IO[bytes] = open(self.path, "w+b")  # noqa: SIM115 - open for the life of the run
        self.file.truncate(HEAD_BYTES)
        self.head = mmap.mmap(self.file.fileno(), HEAD_BYTES)
        self.title = (
            f"{topo.label()} of {topo.world_size}, pid {os.getpid()}, host {os.uname().nodename}; mesh "
            + ", ".join(f"{d}={topo.sizes[d]} ({topo.roles[d]})" for d in topo.dims)
        )
        self.written = 0
        self.write("open collectives: none", "last finished: none")
        self.file.seek(HEAD_BYTES)  # faulthandler writes at the descriptor's offset: after the head
        self.had_faulthandler = faulthandler.is_enabled()
        faulthandler.enable(file=self.file, all_threads=True)
        if store is not None:
            store.set(f"{_STORE_KEY}/{topo.rank}", str(self.path))
        index = os.environ.get(INDEX_VARIABLE)
        if index:
            with contextlib.suppress(OSError):
                Path(index, f"rank-{topo.rank:05d}").write_text(str(self.path), encoding="utf-8")
        _HOOK.update(topo.rank, topo.label(), str(self.path))

    def write(self, *lines: str) -> None:
        """Replace the head with the title and ``lines`` (a memory copy: cheap enough for every guarded call)."""
        text = "\n".join((self.title, *lines, _STACKS_LINE, ""))
        data = text.encode("utf-8", "replace")[: HEAD_BYTES - 1]
        n = len(data)
        self.head[:n] = data
        if self.written > n:  # blank what is left of a longer earlier text
            self.head[n : self.written] = b" " * (self.written - n)
        self.written = n

    def close(self, failure: str | None = None) -> None:
        """Stop ``faulthandler`` writing here. A clean end (``failure`` None) deletes the file (and its folder
        once empty); a failure (a Python traceback, as text) is written after the head and the file kept."""
        faulthandler.disable()
        if self.had_faulthandler:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        with contextlib.suppress(OSError, ValueError, BufferError):
            head = bytes(self.head[: self.written]).decode("utf-8", "replace")
            self.head.close()
            if failure is not None:  # the head and the traceback, without the padding between them
                head = head.replace(_STACKS_LINE, "The exception that ended the process:")
                self.file.seek(0)
                self.file.truncate(0)
                self.file.write((head + failure).encode("utf-8", "replace"))
                self.file.close()
                return
            self.file.close()
            self.path.unlink()
            self.path.parent.rmdir()  # fails while another rank's file is still there: the last one removes it


class _LaunchHook:
    """``sys.excepthook`` under a launcher that collects errors (``MESHWISE_REPORT_INDEX``), from ``import meshwise``
    on, so that an error in ``meshwise.init`` itself reaches the launcher too."""

    def __init__(self) -> None:
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        self.rank = int(rank) if rank.isdigit() else 0
        self.label = f"rank {self.rank}"
        self.path = "its crash report"
        self.previous: Any = None

    def update(self, rank: int, label: str, path: str) -> None:
        self.rank, self.label, self.path = rank, label, path

    def install(self) -> None:
        if self.previous is None and os.environ.get(INDEX_VARIABLE):
            self.previous = sys.excepthook
            sys.excepthook = self

    def __call__(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        """Note this rank's error for the launcher; print the traceback unless another rank printed the same.

        A signal that stops the run makes the peers' collectives fail as they leave: nothing is printed then
        (the launcher says where the run stopped)."""
        # torch.distributed's hook, set by init_process_group after this one, calls this one and prefixes every
        # line it prints with "[rankN]: "; before that this hook is called directly and prefixes its own lines.
        prefix = f"[rank{self.rank}]: " if sys.excepthook is self else ""
        try:
            self._handle(kind, exc, tb, self.previous, prefix)
        except Exception:  # noqa: BLE001 - the traceback must be printed whatever went wrong here
            self.previous(kind, exc, tb)

    def _handle(
        self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None, previous: Any, prefix: str
    ) -> None:
        record = error_record(exc, self.rank, self.label)
        index = os.environ.get(INDEX_VARIABLE)
        if index:
            with contextlib.suppress(OSError, ValueError):
                Path(index, f"failure-{self.rank:05d}.json").write_text(json.dumps(record), encoding="utf-8")
        if interrupt.received() is not None:
            return
        if record["collective"] and index:  # most often a peer's failure seen from here: the launcher names the cause
            first_line = record["message"].split("\n")[0]
            short = first_line if len(first_line) <= 160 else first_line[:160] + "..."
            print(f"{prefix}{record['type']}: {short} (all of it: {self.path})", file=sys.stderr, flush=True)
            return
        first: dict[str, Any] | None = None
        if index:
            with contextlib.suppress(OSError, ValueError):
                first = _first_error(Path(index), record)
        if first is not None and first["rank"] != self.rank and _same(first, record):
            print(
                f"{prefix}{record['type']}: the same error as rank {first['rank']} (traceback above)",
                file=sys.stderr,
                flush=True,
            )
            return
        previous(kind, exc, tb)


_HOOK = _LaunchHook()


def install_launch_hook() -> None:
    """Under ``meshwise run`` or ``run_distributed``: note each rank's uncaught error for the launcher."""
    _HOOK.install()


def _first_error(index: Path, record: dict[str, Any]) -> dict[str, Any]:
    """The first error a rank of this node noted (``O_EXCL``: one rank creates the file), maybe ``record``."""
    path = index / "first-error.json"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        for _ in range(20):  # the winner may not have written it yet
            text = path.read_text(encoding="utf-8")
            if text:
                return json.loads(text)
            time.sleep(0.01)
        return record
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(record))
    return record


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["type"], a["message"]) == (b["type"], b["message"])


_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # meshwise itself


def error_record(exc: BaseException, rank: int, label: str) -> dict[str, Any]:
    """What a launcher needs of a rank's error: type, message, the user's line it came from, the time, and
    whether it is a collective that failed because a peer left (a consequence, not a root cause)."""
    from meshwise.errors import CollectiveError

    frames = traceback.extract_tb(exc.__traceback__)
    user = [
        f for f in frames if not f.filename.startswith(_PACKAGE) and f"{os.sep}site-packages{os.sep}" not in f.filename
    ]
    where = (user or frames)[-1] if frames else None
    text = str(exc)
    collective = isinstance(exc, CollectiveError) or (
        type(exc) is RuntimeError and any(w in text.lower() for w in ("gloo", "nccl", "connection closed by peer"))
    )
    return {
        "rank": rank,
        "label": label,
        "type": type(exc).__name__,
        "message": text,
        "site": f"{_short(where.filename)}:{where.lineno} in {where.name}" if where else "",
        "time": time.time(),
        "collective": bool(collective),
    }


def _short(path: str) -> str:
    cwd = os.getcwd() + os.sep
    return path[len(cwd) :] if path.startswith(cwd) else path


def read_failures(index: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The errors failing ranks noted in a launcher's report folder (:func:`error_record`), by rank."""
    found: dict[int, dict[str, Any]] = {}
    for entry in sorted(Path(index).glob("failure-*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            record = json.loads(entry.read_text(encoding="utf-8"))
            found[int(record["rank"])] = record
    return found


def compact(path: str | os.PathLike[str]) -> None:
    """Rewrite a report a fatal signal left (head, padding, stacks) as plain text: the head, then the stacks."""
    with contextlib.suppress(OSError):
        data = Path(path).read_bytes()
        if _padded(data):
            Path(path).write_text(read_report(path), encoding="utf-8")


def _job_stamp(store: dist.Store | None) -> str:
    """One folder name for every rank of the job: the first rank to ask sets it in the store."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    if store is None:
        return stamp
    return store.compare_set(f"{_STORE_KEY}/stamp", "", stamp).decode()


def _padded(data: bytes) -> bool:
    """A report as the process left it: the head's page, padded with zeros, then what faulthandler wrote."""
    return len(data) >= HEAD_BYTES and b"\0" in data[:HEAD_BYTES]


def read_report(path: str | os.PathLike[str]) -> str:
    """A report file as text: the head without its padding, then the stacks (if a fatal signal wrote them)."""
    data = Path(path).read_bytes()
    if not _padded(data):  # already compact: a rank that ended on an exception, or compact() ran
        return data.decode("utf-8", "replace").rstrip() + "\n"
    head, stacks = data[:HEAD_BYTES], data[HEAD_BYTES:]
    text = head.rstrip(b"\0 ").decode("utf-8", "replace").rstrip()
    tail = stacks.decode("utf-8", "replace").strip()
    return text + "\n" + (tail if tail else "(none: the process was not killed by a fatal signal)") + "\n"


def crash_report(store: dist.Store, rank: int) -> tuple[str, str] | None:
    """``(path, its first lines)`` of the report a dead ``rank`` left, if the store names one that still exists."""
    key = f"{_STORE_KEY}/{rank}"
    try:
        if not store.check([key]):
            return None
        path = store.get(key).decode()
        return path, read_report(path)
    except (RuntimeError, dist.DistError, OSError):
        return None


def left_reports(index: str | os.PathLike[str]) -> dict[int, tuple[str, str]]:
    """The reports ranks left behind (they did not shut down cleanly), by rank: ``(path, text)``."""
    found: dict[int, tuple[str, str]] = {}
    folder = Path(index)
    if not folder.is_dir():
        return found
    for entry in sorted(folder.glob("rank-*")):
        with contextlib.suppress(OSError, ValueError):
            path = entry.read_text(encoding="utf-8").strip()
            if Path(path).is_file():
                found[int(entry.name.removeprefix("rank-"))] = (path, read_report(path))
    return found


def reports_note(index: str | os.PathLike[str]) -> str:
    """What a launcher adds to a failure: where each rank that did not end cleanly left its report."""
    found = left_reports(index)
    if not found:
        return ""
    lines = [f"  rank {r}: {path}\n    {summary(text)}" for r, (path, text) in sorted(found.items())]
    return "\nmeshwise reports (last guarded calls, Python stacks) of the ranks that did not end cleanly:\n" + (
        "\n".join(lines)
    )


def summary(text: str) -> str:
    """The lines of a report that say where the rank was, and the fatal error faulthandler saw, if any."""
    lines = text.splitlines()
    keep = [ln for ln in lines[1:4] if ln.startswith(("open collectives", "last finished"))]
    fatal = next((ln for ln in lines if ln.startswith("Fatal Python error")), None)
    return "; ".join(([fatal] if fatal else []) + keep)
