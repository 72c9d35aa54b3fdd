"""How a ``meshwise run`` ends when its ranks do not all finish: a stop by a signal as one line (where it stopped,
the checkpoint, how to resume; exit code 128 + the signal) and a failure as its first root cause (which rank, where,
its error and message). Read from the launcher's report folder, where the ranks leave their records."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

__all__ = ["failure_story", "stop_signal", "stopped"]

# A rank that ended by one of these signals, or with 128 + it, stopped as asked: the first one found names the stop.
_STOPS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def _stop_record(index: str | os.PathLike[str]) -> dict | None:
    from meshwise.debug.interrupt import STOP_FILE

    try:
        return json.loads(Path(index, STOP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def stopped(index: str | os.PathLike[str], sig: int, command: str) -> int:
    """A run stopped by a signal: one line (which signal, which SLURM job, where it stopped, how to resume), exit
    code 128 + the signal. Later signals are ignored meanwhile (torchrun's handler would raise a traceback)."""
    from meshwise.debug.interrupt import slurm_job_note, stop_line

    for each in _STOPS:
        signal.signal(each, signal.SIG_IGN)
    record = _stop_record(index)
    if record is None:
        name = signal.Signals(sig).name + slurm_job_note()
        line = f"meshwise run: stopped by {name} before a training step ended; run again: {command}"
    else:
        line = stop_line(record, command, "meshwise run")
    print(line, file=sys.stderr, flush=True)
    return 128 + sig


def failure_story(exc: Exception, index: str) -> str:
    """The last lines of a failed run: which ranks failed, where their reports are, then the first root cause
    (which rank, where, its error and message: meshwise's messages end with the fix)."""
    from meshwise.debug.crash import compact, left_reports, read_failures, summary

    failures = dict(getattr(exc, "failures", {}))  # global rank -> torchrun's ProcessFailure
    records = read_failures(index)
    reports = left_reports(index)
    for path, _ in reports.values():
        compact(path)
    first_rank = min(failures, key=lambda r: failures[r].timestamp) if failures else None
    roots = sorted((r for r in records.values() if not r["collective"]), key=lambda r: r["time"])
    silent = [r for r in failures if r not in records]  # ended without a Python exception meshwise saw
    if roots:
        root: dict | None = roots[0]
    elif silent:
        root = None
        first_rank = first_rank if first_rank in silent else silent[0]
    else:
        root = min(records.values(), key=lambda r: r["time"]) if records else None

    lines = []
    ranks = sorted(set(failures) | set(records))
    folders = sorted({str(Path(p).parent) for p, _ in reports.values()})
    head = f"meshwise run: {len(ranks)} rank(s) failed ({', '.join(map(str, ranks))})"
    if folders:
        head += f"; each one's report (last collectives, traceback): {', '.join(folders)}"
    lines.append(head)
    if root is not None:
        others = sorted(r for r, rec in records.items() if r != root["rank"])
        same = [r for r in others if (records[r]["type"], records[r]["message"]) == (root["type"], root["message"])]
        after = [r for r in others if r not in same]
        if same:
            lines.append(f"meshwise run: ranks {', '.join(map(str, same))} failed with the same error")
        if after:
            kinds = sorted({records[r]["type"] for r in after})
            lines.append(f"meshwise run: ranks {', '.join(map(str, after))} failed after it ({', '.join(kinds)})")
        where = f" at {root['site']}" if root.get("site") else ""
        lines.append(f"meshwise run: the first error, on {root['label']}{where}:")
        lines.append(f"{root['type']}: {root['message']}")
    elif first_rank is not None:
        failure = failures[first_rank]
        how = (
            f"was killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exited with code {failure.exitcode} without a Python exception meshwise saw (an error before "
            "meshwise.init, or sys.exit): its own output above says why"
        )
        report = reports.get(first_rank)
        if report is not None:
            how += f" ({summary(report[1])}; report {report[0]})"
        lines.append(f"meshwise run: the first failure: rank {first_rank} {how}")
    return "\n".join(lines)


def stop_signal(index: str | os.PathLike[str], codes: set[int]) -> int | None:
    """The signal that stopped the run when its ranks ended with exit ``codes`` (a rank's stop record first), or
    None when they failed."""
    record = _stop_record(index)
    if record is not None and record.get("signal"):
        return int(record["signal"])
    ended = {s: {128 + s, -s} for s in _STOPS}
    if record is None and not codes <= set().union(*ended.values()):
        return None
    return next((int(s) for s, e in ended.items() if codes & e), int(signal.SIGTERM))
