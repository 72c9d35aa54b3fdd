"""Render a run's loss and metric curves from ``RUN_DIR/metrics.jsonl`` to a PNG (``meshwise plot RUN_DIR``), noisy
per-step curves smoothed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from meshwise.errors import MeshwiseError

__all__ = ["METRICS_FILE", "panels", "plot_run", "read_metrics", "smoothed"]

METRICS_FILE = "metrics.jsonl"
_RESERVED = {"tag", "step", "epoch", "time"}


def read_metrics(run_dir: str | os.PathLike[str]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{metric: {tag: [(step, value), ...]}}`` from the run's JSON-lines log."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MeshwiseError(
            f"no {METRICS_FILE} in {run_dir}: attach meshwise.engine.RunLogger(run_dir) to the trainer to write it"
        )
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise MeshwiseError(f"{path}:{number} is not JSON: fix or remove that line") from None
            tag, step = str(record.get("tag", "train")), int(record.get("step", number))
            for key, value in record.items():
                if key in _RESERVED:
                    continue
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    continue
                curves.setdefault(key, {}).setdefault(tag, []).append((step, value))
    if not curves:
        raise MeshwiseError(f"{path} holds no numbers to plot: log a loss or a metric first")
    return curves


def smoothed(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average with ``weight`` on the past (0 = none), debiased so
    that the first points are not pulled towards zero."""
    if not 0 <= weight < 1:
        raise MeshwiseError(f"smoothing weight {weight!r} must be in [0, 1): 0 draws the raw values, 0.9 smooths a lot")
    out, last, norm = [], 0.0, 0.0
    for value in values:
        last = last * weight + (1 - weight) * value
        norm = norm * weight + (1 - weight)
        out.append(last / norm)
    return out


def panels(curves: dict[str, dict[str, list[tuple[int, float]]]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{panel: {line: points}}``: a metric's per-source values (``"mse/web"``, the evaluator's ``sources=``;
    ``"mix/web"``, the realised mixture) share the panel of ``"mse"`` (``"mix"``), one line per tag and source."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for key, tags in curves.items():
        panel, _, source = key.partition("/")
        for tag, points in tags.items():
            out.setdefault(panel, {})[f"{tag} {source}" if source else tag] = points
    return out


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *, smooth: float = 0.6) -> str:
    """Draw one panel per metric (loss first), one line per tag (train, val, rank0, ...) and, for per-source
    values (:func:`panels`), per source; returns the PNG's path.

    A line of 30 points or more is drawn faint as measured and bold smoothed (:func:`smoothed` with weight
    ``smooth``; 0 turns it off). The default path is ``RUN_DIR/curves.png``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = panels(read_metrics(run_dir))
    names = sorted(curves, key=lambda k: (k != "loss", k))
    cols = min(len(names), 3)
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for tag, points in sorted(curves[name].items()):
            points.sort()
            xs, ys = zip(*points)
            if smooth and len(xs) >= 30:
                (line,) = ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
                ax.plot(xs, smoothed(list(ys), smooth), color=line.get_color(), label=tag)
            else:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=tag)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle(Path(run_dir).resolve().name)
    fig.tight_layout()
    target = Path(out) if out is not None else Path(run_dir) / "curves.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return str(target)
