"""What this rank is in: the open collectives, the stall watchdog, hang reports and every rank's stacks.

meshwise's own collectives (the trainer step, metric syncs) run inside :func:`guarded`, which only notes in
local memory what this rank is in (a :class:`Call`). When a collective fails — gloo's timeout, a peer that
closed its connection — the failing rank asks every rank, through the rendezvous store, what it is doing:
each rank's watchdog thread (blocked on the store, never polling) answers with its open collectives and
writes the Python stacks of all its threads to ``RUN_DIR/hang-*/rank-N.txt``. The error, a
:class:`CollectiveTimeoutError`, names the dims, their roles, the op, the step and, for every rank that did
not arrive, where it is instead. A region that outlives the timeout without an error (NCCL collectives are
asynchronous) is reported by the watchdog in the same way; a rank that leaves writes an exit record. In debug
mode a guarded call first compares its fingerprint with its group's (:func:`compare`; the wrappers of torch's
own collectives are in :mod:`meshwise.debug.fingerprint`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from meshwise import compat
from meshwise.debug import interrupt
from meshwise.debug.crash import CrashRecord, crash_report, summary
from meshwise.debug.interrupt import STORE_PREFIX
from meshwise.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from meshwise.layout import Dims, Layout
from meshwise.topology import Topology

__all__ = [
    "compare",
    "STORE_PREFIX",
    "Call",
    "default_store",
    "describe",
    "guarded",
    "innermost",
    "leave_report",
    "rank_label",
    "start",
    "stop",
    "timeout_error",
]

_GRACE_S = 3.0  # how long a failing rank waits for the others' answers (live ranks answer in milliseconds)
# ... and when gloo says a peer's connection closed: that peer's process is gone and will never answer, while every
# live rank got the same error at the same moment and answers at once. A lost node then costs an elastic restart
# half a second here, not three (docs/cluster.md, "Elastic runs").
_LOST_PEER_GRACE_S = 0.5
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe")
_REQUEST_REUSE_S = 30.0  # failures this close together share one report folder
_DEBUG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # frames here are never the call site
_PACKAGE = os.path.dirname(_DEBUG_DIR.rstrip(os.sep)) + os.sep  # meshwise itself: a library frame


# --------------------------------------------------------------------------- what this rank is in


@dataclass(eq=False)
class Call:
    """One collective, or one meshwise region of collectives (a trainer step), on one topology group."""

    dims: tuple[str, ...]
    ranks: tuple[int, ...]
    where: str  # "dp (batch), tp (replica)"
    op: str
    shapes: str
    step: int | None
    seq: int  # how many guarded calls this rank made on this group before
    region: bool  # many collectives inside (a trainer step), not one
    frame: FrameType | None = field(repr=False)
    thread: int = field(default_factory=threading.get_ident, repr=False)
    started: float = field(default_factory=time.monotonic, repr=False)
    finished_at: tuple[str, int, str] | None = field(default=None, repr=False)
    _text: str | None = field(default=None, init=False, repr=False)

    def finish(self) -> None:
        """Drop the frame (a finished frame would keep its locals, a batch say, alive) but keep its line."""
        f = self.frame
        if f is not None:
            self.frame = None
            self.finished_at = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)

    def site(self) -> str:
        """``metrics/sync.py:186 in _fused_sync, from train.py:88 in main``: where the call was made, and the
        user's line that led there when the call itself is inside a library (meshwise, torch, ignite, ...)."""
        f = self.frame
        if f is None:
            if self.finished_at is None:
                return "?"
            path, line, name = self.finished_at
            return f"{_short(path)}:{line} in {name}"
        text = _line(f)
        if _in_library(f):
            while f is not None and _in_library(f):
                f = f.f_back
            if f is not None:
                text += f", from {_line(f)}"
        return text

    def fingerprint(self) -> dict[str, Any]:
        """What every rank of the group must agree on."""
        return {"op": self.op, "shapes": self.shapes, "step": self.step}

    def text(self) -> str:
        """:func:`describe` of this call, made once: the crash report's head is rewritten at every guarded call,
        and walking the frames for the call site each time would cost more than the collective's bookkeeping."""
        if self._text is None:
            self._text = describe(self.record())
        return self._text

    def record(self) -> dict[str, Any]:
        """The fingerprint with the group, call site and age: what reports and messages are made of."""
        return {
            **self.fingerprint(),
            "dims": list(self.dims),
            "ranks": list(self.ranks),
            "where": self.where,
            "seq": self.seq,
            "site": self.site(),
            "age": round(time.monotonic() - self.started, 3),
        }


def _short(path: str) -> str:
    """A path relative to the working directory or to site-packages, so messages stay readable."""
    for base in (os.getcwd(), *(p for p in sys.path if p.endswith("site-packages"))):
        if base and path.startswith(base + os.sep):
            return path[len(base) + 1 :]
    return path


def _in_library(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    return path.startswith(_PACKAGE) or f"{os.sep}site-packages{os.sep}" in path or path.startswith("<")


def _line(frame: FrameType) -> str:
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _caller() -> FrameType | None:
    """The first frame outside this package and ``contextlib``: where the guarded call was made."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_DEBUG_DIR) or frame.f_code.co_filename == contextlib.__file__
    ):
        frame = frame.f_back
    return frame


def _shapes(tensors: torch.Tensor | Sequence[torch.Tensor] | None) -> str:
    if tensors is None:
        return ""
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    return " ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)


def describe(call: dict[str, Any]) -> str:
    """``all_reduce(op=SUM) float32[4] over dp (batch), group [1, 3], step 5, at train.py:40 in step``."""
    text = call["op"] + (f" {call['shapes']}" if call.get("shapes") else "")
    text += f" over {call['where']}, group {call['ranks']}"
    if call.get("step") is not None:
        text += f", step {call['step']}"
    return text + f", at {call['site']}"


_OPEN: list[Call] = []  # calls this process is inside, outermost first (read by the watchdog thread)
_LAST: list[Call | None] = [None]  # the last call this process finished
_SEQ: dict[tuple[Any, ...], int] = {}


def innermost() -> Call | None:
    """The innermost call this process is inside, or ``None``."""
    return _OPEN[-1] if _OPEN else None


_KEEP = 16  # fingerprints older than this many calls on a group are deleted: every member has long passed them


def compare(topo: Topology, call: Call) -> None:
    """Exchange fingerprints with the group through the store; raise if they differ or a rank never comes."""
    store = default_store()
    base = f"{STORE_PREFIX}/fp/{'_'.join(call.dims)}/{call.ranks[0]}"
    keys = [f"{base}/{call.seq}/{r}" for r in call.ranks]
    mine = call.record()
    store.set(f"{base}/{call.seq}/{topo.rank}", json.dumps(mine))
    if call.seq >= _KEEP:
        store.delete_key(f"{base}/{call.seq - _KEEP}/{topo.rank}")
    try:
        store.wait(keys, topo.timeout)
    except (RuntimeError, dist.DistError):
        missing = [r for r, k in zip(call.ranks, keys) if not store.check([k])]
        raise timeout_error(topo, call, None, missing=missing) from None
    theirs = {r: json.loads(v) for r, v in zip(call.ranks, store.multi_get(keys))}
    want = call.fingerprint()
    if all({k: t[k] for k in want} == want for t in theirs.values()):
        return
    lines = [f"  {rank_label(topo.layout, r)}: {describe(t)}" for r, t in theirs.items()]
    fields = sorted({k for t in theirs.values() for k in want if t[k] != want[k]})
    raise CollectiveMismatchError(
        f"{topo.label()}: the ranks of the {call.where} group {list(call.ranks)} reached their collective "
        f"#{call.seq} on it with different {', '.join(fields)}:\n" + "\n".join(lines) + "\nEvery rank of a group "
        "must make the same collectives, in the same order, with the same shapes and dtypes: look for a branch "
        "on the rank, a skipped step or a tensor of another shape. Nothing was sent; the group is still usable"
    )


@contextmanager
def guarded(
    topo: Topology,
    dims: Dims,
    op: str,
    *,
    tensor: torch.Tensor | Sequence[torch.Tensor] | None = None,
    step: int | None = None,
    check: bool | None = None,
    region: bool = False,
) -> Iterator[None]:
    """Run the collective(s) in the ``with`` body on ``topo.group(dims)`` so that a failure names them.

    ``op``, the shapes of ``tensor`` and ``step`` (inherited from an enclosing region when not given)
    form the fingerprint. With debug mode (or ``check=True``) the group compares fingerprints before the
    body runs: :class:`CollectiveMismatchError` when they differ. A collective failure in the body
    becomes a :class:`CollectiveTimeoutError` naming the dims, roles, step and the ranks that did not
    arrive. ``region=True`` marks a body of many collectives (a trainer step) whose own collectives are
    still fingerprinted one by one in debug mode.
    """
    names = topo.layout.normalize(dims)
    ranks = topo.group_ranks(names)
    if len(ranks) == 1:  # nothing to wait for
        yield
        return
    key = (names, ranks[0])
    seq = _SEQ.get(key, 0)
    _SEQ[key] = seq + 1
    if step is None and _OPEN:
        step = _OPEN[-1].step
    where = ", ".join(f"{d} ({topo.roles[d]})" for d in names)
    call = Call(names, tuple(ranks), where, op, _shapes(tensor), step, seq, region, _caller())
    _OPEN.append(call)
    _note()
    try:
        if topo.debug if check is None else check:
            compare(topo, call)
        yield
    except Exception as exc:
        if isinstance(exc, CollectiveError) or not _is_collective_failure(exc):
            raise  # already named by an inner call, or not a collective's failure (e.g. the user's model)
        raise timeout_error(topo, call, exc) from exc
    finally:
        _OPEN.remove(call)
        call.finish()
        _LAST[0] = call
        _note()


def _note() -> None:
    """Copy what this rank is in to its crash report's head, which outlives a process that gloo aborts."""
    record = _RECORD[0]
    if record is not None:
        last = _LAST[0]
        record.write(
            "open collectives: " + ("; ".join(c.text() for c in _OPEN) or "none"),
            "last finished: " + ("none" if last is None else last.text()),
        )


def _is_collective_failure(exc: BaseException) -> bool:
    """gloo reports timeouts and lost peers as plain RuntimeErrors whose text starts with its source path
    (``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer``); NCCL and the store raise DistErrors.
    Anything else (a DataLoader that "timed out", a shape error in the model) is not a collective's failure."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return type(exc) is RuntimeError and ("gloo" in text or "nccl" in text)


def rank_label(layout: Layout, rank: int) -> str:
    """``rank 3 (dp=1, tp=1)``: how messages name another rank of the layout."""
    coords = ", ".join(f"{d}={c}" for d, c in layout.coordinates(rank).items())
    return f"rank {rank} ({coords})"


def default_store() -> dist.Store:
    """The rendezvous store of the default process group, where reports and fingerprints are exchanged."""
    return compat.default_store()


# --------------------------------------------------------------------------- hang reports


def _snapshot(topo: Topology, state: str = "running") -> dict[str, Any]:
    last = _LAST[0]
    return {
        "label": topo.label(),
        "state": state,
        "open": [c.record() for c in list(_OPEN)],
        "last": None if last is None else last.record(),
        "started": {_group_key(*key): n for key, n in list(_SEQ.items())},  # calls begun on each group
    }


def _group_key(dims: tuple[str, ...], first: int) -> str:
    return f"{'_'.join(dims)}/{first}"


def _request(topo: Topology, store: dist.Store, reason: str) -> dict[str, Any]:
    """Ask every rank for its state and stacks, or join the request another rank made moments ago."""
    latest = int(store.add(f"{STORE_PREFIX}/requests", 0))
    if latest:
        with contextlib.suppress(RuntimeError, dist.DistError):  # its maker may be between claim and count
            store.wait([f"{STORE_PREFIX}/request/{latest}"], datetime.timedelta(seconds=1))
            info = json.loads(store.get(f"{STORE_PREFIX}/request/{latest}"))
            if time.time() - info["time"] < _REQUEST_REUSE_S:
                return info
    n = latest + 1
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = (topo.run_dir / f"hang-{stamp}-{n}").absolute()
    mine = json.dumps({"n": n, "folder": str(folder), "by": topo.label(), "reason": reason, "time": time.time()})
    stored = store.compare_set(f"{STORE_PREFIX}/request/{n}", "", mine)  # ranks failing together: one wins
    if stored.decode() != mine:
        return json.loads(stored)
    store.add(f"{STORE_PREFIX}/requests", 1)
    for r in range(topo.world_size):
        store.queue_push(f"{STORE_PREFIX}/queue/{r}", mine)
    return json.loads(mine)


def timeout_error(
    topo: Topology, call: Call, cause: BaseException | None, missing: list[int] | None = None
) -> CollectiveTimeoutError:
    """Ask the other ranks where they are, then name the dims, roles, op, step and the ranks that did not arrive."""
    seconds = topo.timeout.total_seconds()
    head = f"{topo.label()}: {describe(call.record())} "
    if cause is None:
        head += f"could not start: not every rank of the group came within {seconds:.0f}s"
    else:
        first = str(cause).splitlines()[0] if str(cause) else ""
        first = first.split("] ", 1)[-1] if first.startswith("[") else first  # drop gloo's source path
        head += f"failed ({type(cause).__name__}: {first})"
    peers = [r for r in call.ranks if r != topo.rank]
    try:
        store = default_store()
        info = _request(topo, store, head)
        # Our own answer too: until our watchdog thread has answered with this call still open, a peer that
        # fails at the same moment could be told we are in no collective (we would leave the call first).
        lost = cause is not None and any(text in str(cause).lower() for text in _LOST_PEER)
        records = _records(store, info["n"], [*peers, topo.rank], _LOST_PEER_GRACE_S if lost else _GRACE_S)
    except (RuntimeError, dist.DistError) as exc:  # the store's host is gone: say so, and what we know
        return CollectiveTimeoutError(
            f"{head}. The other ranks could not be asked where they are: the rendezvous store is unreachable "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}), so its host (rank 0 or "
            "the launcher) has probably exited. " + _ADVICE
        )
    absent, notes = [], []
    for r in peers:
        state, record = records.get(r, ("silent", None))
        open_calls = record["open"] if record is not None and state == "running" else []
        same = [c for c in open_calls if c["ranks"] == list(call.ranks) and c["seq"] == call.seq]
        begun = record["started"].get(_group_key(call.dims, call.ranks[0]), 0) if record is not None else 0
        if begun > call.seq if missing is None else r not in missing:  # it reached this call (and may have left)
            if same and (same[0]["op"], same[0]["shapes"]) != (call.op, call.shapes):
                notes.append(f"{rank_label(topo.layout, r)} arrived with another call: {describe(same[0])}")
            continue
        absent.append(r)
        crashed = crash_report(store, r) if record is None else None
        notes.append(f"{rank_label(topo.layout, r)} {_whereabouts(state, record, crashed)}")
    if absent:
        text = f"{head}; ranks {absent} did not arrive"
    else:
        text = f"{head}; every rank of the group reached it, so a collective inside failed"
    text += (": " if notes else "") + "; ".join(notes)
    text += f". Python stacks of every rank: {info['folder']}. " + _ADVICE
    return CollectiveTimeoutError(text)


_ADVICE = (
    "Every rank of a group must make the same collectives in the same order: look for a rank that skipped a "
    "step or a compute(), left the loop early, crashed, or called a collective on another group"
)


def _whereabouts(state: str, record: dict[str, Any] | None, crashed: tuple[str, str] | None = None) -> str:
    if record is None and crashed is not None and "Fatal Python error" in crashed[1]:  # e.g. gloo aborted it
        return f"died without a Python exception ({summary(crashed[1])}); its report and stacks: {crashed[0]}"
    if record is None:
        seen = f" (its report: {summary(crashed[1])}; {crashed[0]})" if crashed is not None else ""
        return (
            "did not answer and left no exit record: its process was killed or ended without meshwise.shutdown(), "
            "or it is busy without releasing the GIL" + seen
        )
    last = record.get("last")
    after = f" after {describe(last)}" if last else " and has made none yet"
    if state == "exited":
        return f"has left: {record.get('how', 'exited')}{after}"
    if record["open"]:
        inner = record["open"][-1]
        return f"is in {describe(inner)} (for {inner['age']:.1f}s)"
    return f"is in no meshwise collective{after}"


def _records(
    store: dist.Store, n: int, ranks: list[int], grace_s: float
) -> dict[int, tuple[str, dict[str, Any] | None]]:
    """Each rank's answer to request ``n``, or its exit record; ranks silent after ``grace_s`` are left out."""
    out: dict[int, tuple[str, dict[str, Any] | None]] = {}
    deadline = time.monotonic() + grace_s
    waiting = list(ranks)
    while waiting:
        for r in list(waiting):
            for key, state in ((f"{STORE_PREFIX}/answer/{n}/{r}", "running"), (f"{STORE_PREFIX}/exit/{r}", "exited")):
                if store.check([key]):
                    out[r] = (state, json.loads(store.get(key)))
                    waiting.remove(r)
                    break
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return out


def _write_stacks(topo: Topology, info: dict[str, Any], record: dict[str, Any]) -> str:
    folder = Path(info["folder"])
    path = folder / f"rank-{topo.rank:05d}.txt"
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [
        f"{topo.label()} of {topo.world_size}, pid {os.getpid()}, host {os.uname().nodename}",
        f"report requested by {info['by']}: {info['reason']}",
        "open collectives: " + ("; ".join(describe(c) for c in record["open"]) or "none"),
        "last finished: " + (describe(record["last"]) if record["last"] else "none"),
        "",
    ]
    for ident, frame in sys._current_frames().items():
        mark = " (meshwise watchdog)" if ident == threading.get_ident() else ""
        lines.append(f"--- thread {names.get(ident, ident)}{mark}, most recent call last:")
        lines.append("".join(traceback.format_stack(frame)))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines), encoding="utf-8")
    except OSError as exc:
        return f"could not write {path}: {exc}"
    return str(path)


# --------------------------------------------------------------------------- the watchdog


class _Watchdog:
    """Two daemon threads per rank: one answers report requests (blocked on the store, no polling), one notices
    a region that outlives the timeout without an error (asynchronous NCCL collectives never raise in Python)."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.stopped = threading.Event()
        # One store connection per thread: a client serves one request at a time, and the answering thread's
        # connection is blocked on its queue for the life of the run. The stall thread's own connection is made
        # when it first reports: each new connection costs the store two reverse DNS lookups, and a resolver
        # that drops bursts of them makes a connection wait 5 s (docs/dev/test-durations.md).
        self.inbox = default_store().clone()
        self.inbox.set_timeout(datetime.timedelta(days=365))
        self.outbox: dist.Store | None = None
        self.answer = threading.Thread(target=self._answer, name="meshwise-watchdog", daemon=True)
        self.stall = threading.Thread(target=self._watch_stalls, name="meshwise-stall-check", daemon=True)
        self.answer.start()
        self.stall.start()

    def _answer(self) -> None:
        queue = f"{STORE_PREFIX}/queue/{self.topo.rank}"
        while True:
            try:
                message = self.inbox.queue_pop(queue, True)
            except (RuntimeError, dist.DistError):
                return  # the store is gone: the job is over
            if message == b"stop" or self.stopped.is_set():
                return
            with contextlib.suppress(RuntimeError, dist.DistError, OSError, ValueError, KeyError):
                info = json.loads(message)
                if "stop_at" in info:  # a peer got SIGINT/SIGTERM: stop after that step too
                    interrupt.learn(info["stop_at"], info["signal"])
                    continue
                record = _snapshot(self.topo)
                record["stacks"] = _write_stacks(self.topo, info, record)
                self.inbox.set(f"{STORE_PREFIX}/answer/{info['n']}/{self.topo.rank}", json.dumps(record))

    def _watch_stalls(self) -> None:
        limit = self.topo.timeout.total_seconds()
        tick = min(max(limit / 10, 0.5), 30.0)
        reported: set[int] = set()
        while not self.stopped.wait(tick):
            open_calls = list(_OPEN)
            if not open_calls:
                continue
            call = open_calls[-1]
            age = time.monotonic() - call.started
            if age <= limit + tick or id(call) in reported:
                continue
            reported.add(id(call))
            text = (
                f"{self.topo.label()}: {describe(call.record())} has not finished after {age:.0f}s, longer than the "
                f"collective timeout of {limit:.0f}s"
            )
            with contextlib.suppress(RuntimeError, dist.DistError, ValueError):
                self.outbox = self.outbox or default_store().clone()
                info = _request(self.topo, self.outbox, text)
                text += f". Python stacks of every rank: {info['folder']}"
            print(f"meshwise: stall: {text}", file=sys.stderr, flush=True)

    def stop(self, store: dist.Store) -> None:
        self.stopped.set()
        store.queue_push(f"{STORE_PREFIX}/queue/{self.topo.rank}", "stop")
        # Wait for both threads to end: a daemon thread still returning from the store's C++ code when the
        # interpreter finalizes is killed inside it, and the process aborts ("terminate called without an
        # active exception"). Measured: sys.exit right after the push aborts; after the join it does not.
        for thread in (self.answer, self.stall):
            thread.join(5.0)


_WATCHDOG: list[_Watchdog | None] = [None]
_RECORD: list[CrashRecord | None] = [None]


def start(topo: Topology) -> None:
    """Forget the calls of an earlier topology and, with several ranks, start this one's watchdog threads."""
    _OPEN.clear()
    _SEQ.clear()
    _LAST[0] = None
    if topo.world_size > 1:
        _WATCHDOG[0] = _Watchdog(topo)
        with contextlib.suppress(OSError):  # no report file (a read-only run folder) must not stop a run
            _RECORD[0] = CrashRecord(topo, default_store())


def leave_report(failure: str | None) -> str | None:
    """Close this rank's crash report: deleted on a clean end (``failure`` None), else kept with ``failure``
    (a Python traceback) after its head. The path of a kept report, else None."""
    record, _RECORD[0] = _RECORD[0], None
    if record is None:
        return None
    record.close(failure)
    return None if failure is None else str(record.path)


def stop(topo: Topology, how: str, failure: str | None = None) -> None:
    """Leave an exit record saying ``how`` this rank left (read by ranks that wait on it), stop the watchdog;
    keep the crash report with ``failure`` (a traceback) when the process is ending on an exception."""
    leave_report(failure)
    watchdog, _WATCHDOG[0] = _WATCHDOG[0], None
    if watchdog is None:
        return
    record = {**_snapshot(topo, "exited"), "how": how}
    with contextlib.suppress(RuntimeError, ValueError):  # the group or its store may be gone already
        store = default_store()
        store.set(f"{STORE_PREFIX}/exit/{topo.rank}", json.dumps(record))
        watchdog.stop(store)
