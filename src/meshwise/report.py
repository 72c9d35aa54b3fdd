"""A run folder summed up on one screen (``meshwise report RUN_DIR``): steps, time, throughput, memory per rank,
final metrics and where the checkpoints are, read from ``metrics.jsonl`` and the ``step-N`` folders."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from meshwise.errors import MeshwiseError
from meshwise.plot import METRICS_FILE

__all__ = ["WORLDS_FILE", "report_text"]

WORLDS_FILE = "worlds.jsonl"  # a checkpoint folder's history of worlds (meshwise.engine.worlds), one line a start

_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_TAG = re.compile(r"^rank(\d+)$")


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file() and _world_files(run_dir):
        return []  # a run without a RunLogger: its checkpoints and worlds are still worth a report
    if not path.is_file():
        raise MeshwiseError(
            f"no {METRICS_FILE} in {run_dir}: is it the folder given to meshwise.engine.RunLogger(run_dir)?"
        )
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a killed run: the rest still tells the story
    return out


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    return [v for r in records if (v := _number(r.get(key))) is not None]


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


def _checkpoints(run_dir: Path) -> list[str]:
    """Each folder under the run (two levels deep) that holds ``step-N`` checkpoints, with its steps and latest."""
    lines = []
    for root in sorted({p.parent for p in run_dir.glob("step-*")} | {p.parent for p in run_dir.glob("*/step-*")}):
        steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())
        if not steps:
            continue
        latest = root / "latest"
        named = ""
        if latest.is_symlink() or latest.is_file():
            target = os.readlink(latest) if latest.is_symlink() else latest.read_text().strip()
            named = f", latest = {Path(target).name}"
        shown = ", ".join(f"step-{s}" for s in steps[-4:])
        more = f" (+{len(steps) - 4} older)" if len(steps) > 4 else ""
        lines.append(f"{root}: {shown}{more}{named}")
    return lines


def _world_files(run_dir: Path) -> list[Path]:
    return sorted({*run_dir.glob(WORLDS_FILE), *run_dir.glob(f"*/{WORLDS_FILE}")})


def _worlds(run_dir: Path) -> list[str]:
    """One line per start of the run: its world, the step it resumed from and the steps lost before it."""
    lines = []
    for path in _world_files(run_dir):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                w = json.loads(line)
                mesh = " x ".join(f"{d}={s}" for d, s in w["mesh"].items())
                nodes = w.get("nodes", "?")
                text = f"{w['time']}  {w['world_size']} ranks ({mesh}, {nodes} node{'' if nodes == 1 else 's'})"
            except (ValueError, KeyError, AttributeError, TypeError):
                continue  # a line cut short by a kill
            step = w.get("resumed_from")
            text += ", from the start" if step is None else f", resumed from step {step}"
            if w.get("steps_lost") is not None:
                text += f", {w['steps_lost']} lost (the world before reached step {w.get('previous_reached')})"
            lines.append(text)
    return lines


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def report_text(run_dir: str | os.PathLike[str]) -> str:
    """The summary ``meshwise report`` prints for ``run_dir``."""
    run = Path(run_dir)
    records = _records(run)
    train = [r for r in records if r.get("tag", "train") == "train"]
    lines = [f"run        {run.resolve()}"]
    times = _series(records, "time")
    if times:
        start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(min(times)))
        lines.append(f"time       {start}, {_duration(max(times) - min(times))} logged ({len(records)} records)")
    steps = [int(s) for s in _series(train, "step")]
    epochs = _series(train, "epoch")
    if steps:
        lines.append(f"steps      {min(steps)} to {max(steps)}" + (f", epoch {int(max(epochs))}" if epochs else ""))
    loss = _series(train, "loss")
    if loss:
        lines.append(f"loss       first {_fmt(loss[0])}, last {_fmt(loss[-1])}, lowest {_fmt(min(loss))}")
    step_time = _series(train, "step_time_s")
    if step_time:
        p90 = sorted(step_time)[int(0.9 * (len(step_time) - 1))]
        rate = f"step {statistics.median(step_time) * 1e3:.1f} ms median (p90 {p90 * 1e3:.1f} ms)"
        for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
            if values := _series(train, key):
                rate += f", {statistics.median(values):.4g} {unit}"
        lines.append(f"speed      {rate}")
    if lr := _series(train, "lr"):
        lines.append(f"lr         {lr[0]:.3g} to {lr[-1]:.3g}")
    if tflops := _series(train, "tflops"):
        mfu = _series(train, "mfu")
        flops = _series(train, "flops_per_step")
        text = f"{statistics.median(tflops):.4g} TFLOP/s" + (f", {flops[-1]:.3g} FLOPs a step" if flops else "")
        text += f", MFU {statistics.median(mfu):.1%} (estimate)" if mfu else ", MFU: no peak FLOP/s known"
        lines.append(f"compute    {text}")
    ranks: dict[int, dict[str, Any]] = {}
    for r in records:
        if (m := _RANK_TAG.match(str(r.get("tag", "")))) is not None:
            ranks[int(m.group(1))] = r  # the last record of each rank
    if ranks:
        mem = " ".join(f"r{k}={_fmt(v.get('peak_mem_mb', math.nan))}" for k, v in sorted(ranks.items()))
        lines.append(f"peak MB    {mem}")
        if any("data_mb_read" in v for v in ranks.values()):
            read = " ".join(f"r{k}={_fmt(v.get('data_mb_read', math.nan))}" for k, v in sorted(ranks.items()))
            lines.append(f"read MB    {read}")
    elif mem := _series(train, "peak_mem_mb"):
        lines.append(f"peak MB    rank 0: {_fmt(max(mem))}")
    last_by_tag: dict[str, dict[str, Any]] = {}
    for r in records:
        tag = str(r.get("tag", "train"))
        if tag != "train" and not _RANK_TAG.match(tag):
            last_by_tag[tag] = r
    for tag, r in sorted(last_by_tag.items()):
        shown = ", ".join(
            f"{k}={_fmt(v)}"
            for k in r
            if k not in ("tag", "step", "epoch", "time") and (v := _number(r[k])) is not None
        )
        lines.append(f"final      {tag} at step {r.get('step')}: {shown}")
    checkpoints = _checkpoints(run)
    lines.extend(f"checkpoint {c}" for c in checkpoints)
    if not checkpoints:
        lines.append("checkpoint none under this folder")
    lines.extend(f"world      {w}" for w in _worlds(run))
    return "\n".join(lines)
