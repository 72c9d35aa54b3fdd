"""A report that survives a process killed by a fatal signal: each rank's last guarded calls and its Python stacks.

gloo aborts a process (SIGABRT, no Python exception) when a collective's peers disagree on sizes; nothing in
Python runs after that. So every rank keeps, from ``meshwise.init`` on, a file ``RUN_DIR/crash-<time>/rank-N.txt``
whose head is rewritten in place (a shared memory map: no system call, the kernel keeps the page when the
process dies) with the calls the watchdog knows this rank is in, and after which ``faulthandler`` writes every
thread's Python stack on a fatal signal. A rank that shuts down cleanly deletes its file. Launchers that
set ``MESHWISE_REPORT_INDEX`` (``meshwise run``, ``run_distributed``) learn each rank's file there and point
to the files left behind; peers find them through the store (``crash_report``).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import mmap
import os
import sys
from pathlib import Path
from typing import IO

import torch.distributed as dist

from meshwise.topology import Topology

__all__ = [
    "HEAD_BYTES",
    "INDEX_VARIABLE",
    "CrashRecord",
    "crash_report",
    "left_reports",
    "read_report",
    "reports_note",
    "summary",
]

HEAD_BYTES = 4096  # the rewritten head: the last calls; the stacks follow it
INDEX_VARIABLE = "MESHWISE_REPORT_INDEX"  # a folder where each rank names its report file (set by launchers)
_STORE_KEY = "meshwise/debug/crash"


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

    def write(self, *lines: str) -> None:
        """Replace the head with the title and ``lines`` (a memory copy: cheap enough for every guarded call)."""
        text = "\n".join(
            (self.title, *lines, "Python stacks of every thread, if a fatal signal killed the process:", "")
        )
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
            self.head.close()
            if failure is not None:
                self.file.write(failure.encode("utf-8", "replace"))
                self.file.close()
                return
            self.file.close()
            self.path.unlink()
            self.path.parent.rmdir()  # fails while another rank's file is still there: the last one removes it


def _job_stamp(store: dist.Store | None) -> str:
    """One folder name for every rank of the job: the first rank to ask sets it in the store."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    if store is None:
        return stamp
    return store.compare_set(f"{_STORE_KEY}/stamp", "", stamp).decode()


def read_report(path: str | os.PathLike[str]) -> str:
    """A report file as text: the head without its padding, then the stacks (if a fatal signal wrote them)."""
    data = Path(path).read_bytes()
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
