"""Which source each sample of a mixture comes from: weights over time, and the blending rule that follows them.

The rule is Megatron's (``build_blending_indices`` of its ``BlendedDataset``): sample ``x`` goes to the source
whose count lags its target the most, ``argmax_s  T_s(x + 1) - c_s`` (ties to the first source), where ``c_s``
is how many samples the source gave so far and ``T_s(x)`` the sum of its weight over the samples before ``x``
(``w_s * x`` for constant weights). Megatron takes the target before the sample, at ``max(x, 1)``; taken after
it, a Schedule's change of weights applies from its own first sample instead of one sample late, with the same
bound: every prefix of the order is within one sample of the declared proportions for every source.

``T`` has a closed form for constant and linearly changing weights, so the order continues exactly from a saved
``(x, counts)`` on any mesh, and a change of weights on resume starts a new target from the counts where the run
stopped (an *anchor*): each source goes on where it was.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshwise.data.sampler import MeshSampler
from meshwise.errors import DataError

__all__ = ["EXHAUSTED", "Blend", "MixtureSampler", "Schedule", "Weights"]

EXHAUSTED = ("repeat", "stop", "drop")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Mixture weights that change during the run: ``points`` ``[(at, {source: weight}), ...]``, ``at`` from 0 up.

    ``unit``: ``"samples"`` (consumed samples of the whole run) or ``"steps"`` (global steps, each
    ``global_batch_size`` samples). ``interpolate``: ``"constant"`` holds each point's weights until the next
    (the last holds to the end of the run); ``"linear"`` goes linearly from each point to the next and ends at the
    last point: a step that reaches past it is refused (add a point at or after the run's end). Each point's
    weights are normalised to sum 1; a source missing from a point has weight 0 there.
    """

    points: Sequence[tuple[int, Mapping[str, float]]]
    unit: str = "samples"
    interpolate: str = "constant"

    def check(self, names: Sequence[str]) -> None:
        """Refuse what would give no valid weights, naming the point."""
        if self.unit not in ("samples", "steps"):
            raise DataError(f"Schedule unit must be 'samples' or 'steps', got {self.unit!r}")
        if self.interpolate not in ("constant", "linear"):
            raise DataError(f"Schedule interpolate must be 'constant' or 'linear', got {self.interpolate!r}")
        points = list(self.points)
        if not points or int(points[0][0]) != 0:
            raise DataError("a Schedule's first point must be at 0: e.g. Schedule([(0, {'web': 0.7, 'code': 0.3})])")
        ats = [int(at) for at, _ in points]
        if any(b <= a for a, b in zip(ats, ats[1:])):
            raise DataError(f"a Schedule's points must be at increasing positions, got {ats}")
        if self.interpolate == "linear" and len(points) < 2:
            raise DataError("a linear Schedule needs two points at least (where it starts and where it ends)")
        for at, weights in points:
            check_weights(weights, names, f"the Schedule's point at {at}")


@dataclasses.dataclass(frozen=True)
class Blend:
    """What the sampler needs of a mixture: source names and lengths, weights, seed, exhaustion policy, epoch."""

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    weights: Mapping[str, float] | Schedule
    seed: int
    exhausted: str
    epoch_samples: int

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Where each source starts in the sources laid end to end."""
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

    def locate(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, row in that source) of end-to-end positions ``index``."""
        source = np.searchsorted(self.offsets, index, side="right") - 1
        return source, index - self.offsets[source]


SOURCE = "source"  # the field a mixture adds: which source a sample came from (an index into its names)


def tag_source(names: Sequence[str], s: int, sample: Any) -> dict[str, Any]:
    """A sample of source ``s`` with the field ``source``: its source must give dict samples without that field."""
    if not isinstance(sample, Mapping):
        raise DataError(
            f"mixture source {names[s]!r} gives {type(sample).__name__} samples: a mixture adds the field "
            f"{SOURCE!r}, so its sources must give dict samples"
        )
    if SOURCE in sample:
        raise DataError(f"samples of {names[s]!r} have a field {SOURCE!r}, the mixture's own: rename it")
    return {**sample, SOURCE: s}


def check_weights(weights: Mapping[str, float], names: Sequence[str], where: str) -> np.ndarray:
    """``weights`` as a vector over ``names``, normalised; a DataError for unknown names, negatives or zero sum."""
    if not isinstance(weights, Mapping):
        raise DataError(f"{where}: weights must be a mapping source name -> weight, got {type(weights).__name__}")
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise DataError(f"{where}: weights name {unknown}, which are not sources of the mixture {list(names)}")
    vector = np.array([float(weights.get(n, 0.0)) for n in names], dtype=np.float64)
    if not np.all(np.isfinite(vector)) or np.any(vector < 0):
        raise DataError(f"{where}: weights must be finite and >= 0, got {dict(zip(names, vector.tolist()))}")
    if vector.sum() <= 0:
        raise DataError(f"{where}: the weights sum to {vector.sum()}, not a positive number: give a source weight > 0")
    return vector / vector.sum()


class Weights:
    """The weights of every source at every sample of the run, and their cumulative sum ``W(x)`` in closed form.

    ``active`` limits them to the sources still in the mixture (``exhausted="drop"``): each point's weights are
    renormalised over the active sources, so the sum stays piecewise linear.
    """

    def __init__(
        self, names: Sequence[str], spec: Mapping[str, float] | Schedule, global_batch_size: int, active: np.ndarray
    ) -> None:
        self.names = list(names)
        schedule = spec if isinstance(spec, Schedule) else Schedule([(0, spec)])
        schedule.check(self.names)
        scale = global_batch_size if schedule.unit == "steps" else 1
        self.linear = schedule.interpolate == "linear"
        self.at = np.array([int(at) * scale for at, _ in schedule.points], dtype=np.int64)
        raw = np.stack([check_weights(w, self.names, f"point {at}") for at, w in schedule.points]) * active
        sums = raw.sum(axis=1, keepdims=True)
        self.empty = sums[:, 0] <= 0  # points where no active source has weight: the mixture has nothing to give
        self.w = np.divide(raw, sums, out=np.zeros_like(raw), where=sums > 0)
        self.end = int(self.at[-1]) if self.linear else None
        # W at each point: the sum of the weights over the samples before it
        self.cum = np.zeros_like(self.w)
        for k in range(1, len(self.at)):
            self.cum[k] = self.cum[k - 1] + self._piece(k - 1, self.at[k])
        self.fingerprint = hashlib.sha1(
            json.dumps([schedule.unit, schedule.interpolate, self.at.tolist(), self.w.round(15).tolist()]).encode()
        ).hexdigest()[:16]

    def _piece(self, k: int, x: Any) -> np.ndarray:
        """The sum of the weights over the samples ``[at[k], x)`` of piece ``k`` (``x`` an int or an int array)."""
        n = np.asarray(x, dtype=np.float64)[..., None] - self.at[k]
        if not self.linear or k + 1 >= len(self.at):
            return n * self.w[k]
        slope = (self.w[k + 1] - self.w[k]) / float(self.at[k + 1] - self.at[k])
        return n * self.w[k] + slope * (n * (n - 1) / 2)

    def cumulative(self, x: np.ndarray) -> np.ndarray:
        """``W(x)`` for each sample position of ``x`` (ints ``>= 0``): shape ``[len(x), sources]``."""
        k = np.searchsorted(self.at, x, side="right") - 1
        out = np.empty((len(x), len(self.names)), dtype=np.float64)
        for piece in np.unique(k):
            rows = k == piece
            out[rows] = self.cum[piece] + self._piece(int(piece), x[rows])
        return out

    def since(self, anchor: int, x: np.ndarray) -> np.ndarray:
        """The sum of the weights over the samples ``[anchor, x)`` for each ``x >= anchor``: targets from an anchor.

        Within the anchor's piece it is computed from the anchor itself, so constant weights give exactly
        ``(x - anchor) * w``, Megatron's target, at any run position (a difference of two large sums would round
        differently and break its ties otherwise)."""
        k = int(np.searchsorted(self.at, anchor, side="right") - 1)
        linear = self.linear and k + 1 < len(self.at)
        inside = x <= self.at[k + 1] if k + 1 < len(self.at) else np.ones(len(x), dtype=bool)
        everywhere = bool(inside.all())  # the common case: no mask to apply
        n = (x if everywhere else x[inside]) - anchor
        n = n.astype(np.float64)[:, None]
        part = n * self.w[k]
        if linear:
            slope = (self.w[k + 1] - self.w[k]) / float(self.at[k + 1] - self.at[k])
            part += slope * (n * float(anchor - self.at[k]) + n * (n - 1) / 2)
        if everywhere:
            return part
        out = np.empty((len(x), len(self.names)), dtype=np.float64)
        out[inside] = part
        out[~inside] = self.cumulative(x[~inside]) - self.cumulative(np.array([anchor], dtype=np.int64))[0]
        return out

    def check_reach(self, x: int) -> None:
        """Refuse a step that would reach sample ``x`` of the run past a linear Schedule's end (the order is planned
        past it as held there; no batch from there is handed out)."""
        if self.end is not None and x > self.end:
            raise DataError(
                f"the mixture's linear Schedule ends at sample {self.end}, and this step would reach sample {x}: add "
                "a point at or after the run's end (or use interpolate='constant', whose last weights hold)"
            )

    def at_sample(self, x: int) -> dict[str, float]:
        """The weights in force at sample ``x`` (for logs and the dry run)."""
        k = int(np.searchsorted(self.at, x, side="right") - 1)
        w = self.w[k]
        if self.linear and k + 1 < len(self.at):
            w = w + (self.w[k + 1] - w) * (x - self.at[k]) / float(self.at[k + 1] - self.at[k])
        return dict(zip(self.names, (round(float(v), 6) for v in w)))

    def empty_at(self, x: int) -> bool:
        k = int(np.searchsorted(self.at, x, side="right") - 1)
        return bool(self.empty[k]) and (not self.linear or k + 1 >= len(self.at) or bool(self.empty[k + 1]))


def blend(
    weights: Weights, start: int, anchor: int, anchor_counts: np.ndarray, counts: np.ndarray, n: int
) -> np.ndarray:
    """Which source each of the ``n`` samples from run position ``start`` comes from (Megatron's rule).

    The targets start from ``anchor`` (a run position) and ``anchor_counts``; ``counts`` are the counts at
    ``start``, updated in place. The rule only: exhaustion is the caller's.
    """
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    # each source's count since the anchor is compared with its target after the sample (Megatron: before it, at
    # max(x, 1)), so a Schedule's change applies from its own first sample
    targets = weights.since(anchor, np.arange(start + 1, start + n + 1, dtype=np.int64))
    since = (counts - anchor_counts).astype(np.float64)
    if n >= _COMPILED_FROM and _compiled() is not None:
        c, picks = since, np.empty(n, dtype=np.int64)
        _compiled()(targets, c, picks)
    else:  # plain Python runs fastest on lists; the same code, so the same order
        c, picks = since.tolist(), [0] * n
        _greedy(targets.tolist(), c, picks)
    counts[:] = np.array(c, dtype=np.int64) + anchor_counts
    return np.asarray(picks, dtype=np.int64)


def _greedy(targets: Any, c: Any, picks: Any) -> None:
    """Megatron's rule over ``len(picks)`` samples: ``picks[i]`` is the source whose count ``c`` (updated in place)
    lags row ``targets[i]`` the most, ties to the first. Lists in Python, arrays under numba: one code, one order."""
    sources = len(c)
    for i in range(len(picks)):
        t = targets[i]
        best, lag = 0, -math.inf
        for s in range(sources):
            d = t[s] - c[s]
            if d > lag:
                best, lag = s, d
        c[best] += 1.0
        picks[i] = best


# numba compiles the rule where it is installed (``pip install meshwise[fast]``): 44 ns a sample with its targets,
# against 1.8 us in Python (3 sources, measured). It is imported and compiled (~1 s) on the first order this long.
_COMPILED_FROM = 20_000
_JIT: list[Any] = []


def _compiled() -> Any:
    if not _JIT:
        try:
            import numba  # deliberately lazy: optional, and only long orders are worth its import and compile
        except ImportError:
            _JIT.append(None)
        else:
            _JIT.append(numba.njit(nogil=True, cache=True)(_greedy))  # cached beside this file: no compile next time
    return _JIT[0]


@dataclasses.dataclass
class _Rest:
    """The order from a cursor to its epoch's end: each sample's source and end-to-end row, and the anchors."""

    start: int  # the in-epoch position the order starts at
    sources: np.ndarray
    rows: np.ndarray
    samples: int  # samples left in the epoch (the order holds the full steps of them)
    events: list[tuple[int, np.ndarray, np.ndarray]]  # (run position, counts, active) where a source left


class MixtureSampler(MeshSampler):
    """The train order of a mixture: global batches of end-to-end rows, which source each from :func:`blend`.

    Built by a loader for a mixture made with :func:`meshwise.data.mix` in ``mode="train"``. Beyond
    :class:`MeshSampler`'s cursor (``epoch``, ``consumed``), it keeps ``total`` (samples of the run before the
    cursor: what a Schedule counts), ``counts`` (samples each source gave: in the run under ``"repeat"``, in the
    epoch otherwise) and the anchor its targets start from. ``state_dict()`` holds all of it, so the order goes
    on exactly on another mesh or global batch, and with other weights each source goes on where it was.
    """

    def __init__(self, blend_: Blend, global_batch_size: int, *, data_rank: int = 0, data_size: int = 1) -> None:
        total_length = sum(blend_.lengths)
        super().__init__(
            max(total_length, global_batch_size), global_batch_size, data_rank=data_rank, data_size=data_size,
            seed=blend_.seed,
        )  # fmt: skip
        self.dataset_length = total_length
        if blend_.exhausted == "repeat" and blend_.epoch_samples < global_batch_size:
            raise DataError(
                f"the mixture's epoch of {blend_.epoch_samples} samples is less than one global batch of "
                f"{global_batch_size}: give mix(..., epoch_samples=) at least {global_batch_size}"
            )
        self.blend = blend_
        self.lengths, self.offsets = np.array(blend_.lengths, dtype=np.int64), blend_.offsets
        self.spec = blend_.weights
        self.total = 0
        self.counts = np.zeros(len(self.lengths), dtype=np.int64)
        self.active = np.ones(len(self.lengths), dtype=bool)
        self._weights: tuple[tuple[bool, ...], Weights] | None = None
        self.anchor, self.anchor_counts = 0, self.counts.copy()
        self._rest: _Rest | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        if len(self) == 0:
            raise DataError(
                f"an epoch of this mixture (exhausted={blend_.exhausted!r}, source lengths "
                f"{dict(zip(blend_.names, blend_.lengths))}) is shorter than one global batch of "
                f"{global_batch_size}: use a smaller global batch, more data, or exhausted='repeat'"
            )

    # ---- the order
    def weights(self) -> Weights:
        """The weights in force at the cursor (over the sources still active)."""
        key = tuple(self.active.tolist())
        if self._weights is None or self._weights[0] != key:  # built again only when a source leaves or returns
            active = self.active.astype(np.float64)
            self._weights = (key, Weights(self.blend.names, self.spec, self.global_batch_size, active))
        return self._weights[1]

    def _order_from_cursor(self) -> _Rest:
        if self._rest is not None:
            return self._rest
        b, counts, active = self.global_batch_size, self.counts.copy(), self.active.copy()
        at, anchor, anchor_counts = self.total, self.anchor, self.anchor_counts.copy()
        events: list[tuple[int, np.ndarray, np.ndarray]] = []
        if self.blend.exhausted == "repeat":
            samples = self.blend.epoch_samples - self.consumed
            picks = blend(self.weights(), at, anchor, anchor_counts, counts, samples // b * b)
        else:
            pieces, samples = [], 0
            while True:
                left = int((self.lengths - counts)[active].sum())
                if left <= 0:
                    break
                weights = Weights(self.blend.names, self.spec, b, active.astype(np.float64))
                self._refuse_empty(weights, at)
                before = counts.copy()
                picks = blend(weights, at, anchor, anchor_counts, counts, left)
                drawn = before[picks] + _rank_within(picks, len(counts))  # each pick's count before it
                over = np.flatnonzero(drawn >= self.lengths[picks])
                if self.blend.exhausted == "stop":
                    cut = int(over[0]) if len(over) else len(picks)
                    pieces.append(picks[:cut])
                    samples += cut
                    break
                done = np.flatnonzero(drawn == self.lengths[picks] - 1)  # a source's last sample
                cut = int(done[0]) + 1
                pieces.append(picks[:cut])
                samples, at = samples + cut, at + cut
                counts = before + np.bincount(picks[:cut], minlength=len(counts))
                active = active & (counts < self.lengths)
                anchor, anchor_counts = at, counts.copy()
                events.append((at, counts.copy(), active.copy()))
            picks = np.concatenate(pieces)[: samples // b * b] if pieces else np.zeros(0, dtype=np.int64)
        self._rest = _Rest(self.consumed, picks, self._rows(picks), samples, events)
        return self._rest

    def _refuse_empty(self, weights: Weights, at: int) -> None:
        if weights.empty_at(at) or any(weights.empty[int(np.searchsorted(weights.at, at, side="right")) :]):
            left = [n for n, a in zip(self.blend.names, self.active) if a]
            raise DataError(
                f"under exhausted='drop' an epoch draws every sample of every source once, but from sample {at} the "
                f"sources left {left} have weight 0 in the Schedule: give them a weight > 0 there"
            )

    def _rows(self, picks: np.ndarray) -> np.ndarray:
        """End-to-end rows of ``picks`` (from the cursor's counts): each source's k-th sample, by its own shuffle."""
        k = self.counts[picks] + _rank_within(picks, len(self.lengths))
        rows = np.empty(len(picks), dtype=np.int64)
        for s in np.unique(picks):
            at = picks == s
            length = int(self.lengths[s])
            ks = k[at]
            epochs = ks // length if self.blend.exhausted == "repeat" else np.full(len(ks), self.epoch)
            out = np.empty(len(ks), dtype=np.int64)
            for e in np.unique(epochs):
                sel = epochs == e
                out[sel] = self._perm(int(s), int(e))[ks[sel] % length]
            rows[at] = self.offsets[s] + out
        return rows

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.lengths):
                self._perms.clear()
            salt = zlib.crc32(self.blend.names[source].encode())
            self._perms[key] = np.random.default_rng([self.seed, salt, epoch]).permutation(int(self.lengths[source]))
        return self._perms[key]

    def global_batch(self, start: int, epoch: int | None = None) -> np.ndarray:
        """The end-to-end rows of the global batch at in-epoch position ``start`` (the cursor or after it)."""
        rest = self._order_from_cursor()
        if (epoch is not None and epoch != self.epoch) or start < rest.start:
            raise DataError("a mixture's order is known from the cursor on only (it depends on the counts so far)")
        return rest.rows[start - rest.start : start - rest.start + self.global_batch_size]

    def __len__(self) -> int:
        """Steps in this epoch (under ``"stop"``, until the first source runs out)."""
        if self.blend.exhausted == "repeat":
            return self.blend.epoch_samples // self.global_batch_size
        return self.consumed // self.global_batch_size + self._steps_from(self.consumed)

    def _steps_from(self, consumed: int) -> int:
        if self.blend.exhausted == "repeat":
            return (self.blend.epoch_samples - consumed) // self.global_batch_size
        rest = self._order_from_cursor()
        return (rest.start + rest.samples - consumed) // self.global_batch_size

    def advance(self) -> None:
        """Move the cursor one global batch: the counts, the run position and (``drop``) the sources left.

        A linear Schedule's weights are planned past its last point as held there, but a batch past it is
        refused here, before it is handed out (the plan of an epoch may run past a Schedule that the run does
        not outlive)."""
        rest, b = self._order_from_cursor(), self.global_batch_size
        self.weights().check_reach(self.total + b)
        i = self.consumed - rest.start
        self.counts += np.bincount(rest.sources[i : i + b], minlength=len(self.counts))
        self.consumed += b
        self.total += b
        for at, counts, active in rest.events:
            if at <= self.total:
                self.anchor, self.anchor_counts, self.active = at, counts.copy(), active.copy()
        if self.remaining_steps == 0:
            self._new_epoch(self.epoch + 1)

    def _new_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed, self._rest = epoch, 0, None
        if self.blend.exhausted != "repeat":  # every source starts its next epoch
            self.counts[:] = 0
            self.active[:] = True
            self.anchor, self.anchor_counts = self.total, self.counts.copy()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch keeps its cursor (so a resume is not undone)."""
        if int(epoch) != self.epoch:
            self._new_epoch(int(epoch))

    def realised(self) -> dict[str, int]:
        """Samples each source gave (in the run under ``"repeat"``, in this epoch otherwise)."""
        return dict(zip(self.blend.names, self.counts.tolist()))

    # ---- state
    def state_dict(self) -> dict[str, Any]:
        """The cursor, each source's count and the anchor: the same on every rank, independent of the mesh."""
        names = self.blend.names
        return {
            **super().state_dict(),
            "kind": "mixture",
            "sources": dict(zip(names, self.lengths.tolist())),
            "exhausted": self.blend.exhausted,
            "total": self.total,
            "counts": self.realised(),
            "active": [n for n, a in zip(names, self.active) if a],
            "anchor": {"at": self.anchor, "counts": dict(zip(names, self.anchor_counts.tolist()))},
            "weights": self.weights().fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a saved mixture position, also at another mesh or global batch; other weights go on from it."""
        if state.get("kind") != "mixture":
            raise DataError(
                "this state_dict is not a mixture's position (a loader of one source saved it): resume with the "
                "dataset that saved it, or start the mixture over without load_state_dict"
            )
        self._check_sources(state)
        if state["exhausted"] != self.blend.exhausted:
            raise DataError(
                f"the saved mixture ran with exhausted={state['exhausted']!r}, this one has "
                f"{self.blend.exhausted!r}: give mix(..., exhausted={state['exhausted']!r})"
            )
        names = self.blend.names
        self.epoch, self.consumed = int(state["epoch"]), int(state["samples_consumed"])
        self.total = int(state["total"])
        self.counts = np.array([int(state["counts"][n]) for n in names], dtype=np.int64)
        self.active = np.array([n in state["active"] for n in names])
        self.anchor = int(state["anchor"]["at"])
        self.anchor_counts = np.array([int(state["anchor"]["counts"][n]) for n in names], dtype=np.int64)
        self._rest = None
        if self.weights().fingerprint != state["weights"]:  # new weights: new targets from where each source is
            self.anchor, self.anchor_counts = self.total, self.counts.copy()
        if self.remaining_steps == 0 and self.consumed:
            self._new_epoch(self.epoch + 1)

    def _check_sources(self, state: Mapping[str, Any]) -> None:
        saved, now = dict(state["sources"]), dict(zip(self.blend.names, self.lengths.tolist()))
        added, removed = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
        if added or removed:
            raise DataError(
                f"the saved mixture position has sources {sorted(saved)}, this mixture {sorted(now)} (added: "
                f"{added}, removed: {removed}): resume with the same sources (a renamed source counts as removed "
                "and added), then change the weights; to start new sources, start the mixture over without "
                "load_state_dict"
            )
        changed = {n: (saved[n], now[n]) for n in now if saved[n] != now[n]}
        if changed:
            raise DataError(
                f"mixture sources changed length since the position was saved (saved, now): {changed}: resume with "
                "the same data, or start the mixture over without load_state_dict"
            )


def _rank_within(picks: np.ndarray, sources: int) -> np.ndarray:
    """For each pick, how many earlier picks chose the same source."""
    out = np.empty(len(picks), dtype=np.int64)
    for s in range(sources):
        at = np.flatnonzero(picks == s)
        out[at] = np.arange(len(at))
    return out
