"""Weighted mixtures of streams: :class:`StreamMixture` blends named streams into one stream that the stream loader
divides by data rank.

Which source the n-th sample of a pass comes from is :func:`~meshwise.data.blend.blend`'s rule, as for map-style
mixtures; source ``s``'s k-th sample is the k-th its stream gives. The position of a pass is therefore the
mixture's run position and each source's count, not a per-rank position: the loader saves it
(:meth:`StreamMixture.position`) and a resume continues every source where it was (:meth:`StreamMixture.seek`) on
any data size, with the same or other weights. Each source is read from its start and the samples it had given
are read again and dropped (a stream has no random access), and every rank reads every source whole, keeping the
samples of its data rank, as for a plain torch stream.

A pass reads each source once from its start (a ``datasets`` stream gets ``set_epoch`` of the pass, so a shuffled
one reshuffles): under ``exhausted="stop"`` the pass ends when the first source runs out; under ``"repeat"`` a
source that runs out starts again and a pass is ``epoch_samples`` samples. ``"drop"`` needs each source's length
before its end, which a stream does not have: refused. In ``mode="eval"`` the loader reads every source once,
source after source (:meth:`StreamMixture.eval_stream`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from meshwise.data.blend import Schedule, Weights, blend, tag_source
from meshwise.errors import DataError

__all__ = ["StreamMixture"]

_CHUNK = 4096  # samples of the order computed at once while a pass is read
_END = object()  # what next() gives for a source that ran out


class StreamMixture(torch.utils.data.IterableDataset):
    """Named streams drawn at weights (built by :func:`meshwise.data.mix` for stream sources).

    State of the pass: ``total`` (samples of the run before the pass's position: what a Schedule counts),
    ``counts`` (samples each source gave in this pass) and the anchor the targets start from. The loader moves it
    with :meth:`seek`, :meth:`next_pass` and reads it with :meth:`position`.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | Schedule,
        *,
        seed: int,
        exhausted: str,
        epoch_samples: int | None,
    ) -> None:
        if exhausted == "drop":
            raise DataError(
                "exhausted='drop' is not supported for streams: dropping a source re-weights the others from the "
                "sample where it ran out, and a stream's length is known only at its end (the ranks could not "
                "agree on the order before it); use 'stop' or 'repeat', or give the sources map-style"
            )
        if exhausted == "repeat" and epoch_samples is None:
            raise DataError(
                "a stream mixture under exhausted='repeat' never runs out: give mix(..., epoch_samples=) the "
                "samples of one pass (or use exhausted='stop', whose pass ends when the first source does)"
            )
        self.names = tuple(sources)
        self.sources = list(sources.values())
        self.spec, self.seed, self.exhausted = weights, seed, exhausted
        self.epoch_samples = epoch_samples
        self.global_batch_size = 1  # a Schedule in steps counts global batches: set by the loader (bind)
        self.epoch = 0
        self.total, self.counts = 0, np.zeros(len(self.names), dtype=np.int64)
        self.anchor, self.anchor_counts = 0, self.counts.copy()
        self._at: tuple[int, np.ndarray] = (0, self.counts.copy())  # the last position() asked, to go on from
        self._weights: Weights | None = None

    # ---- the order
    def bind(self, global_batch_size: int) -> None:
        """The loader's global batch (a Schedule in ``"steps"`` counts them)."""
        self.global_batch_size = int(global_batch_size)
        self._weights = None
        self.weights()  # a Schedule that does not fit the sources is refused when the loader is built

    def weights(self) -> Weights:
        """The weights over the run (built once a global batch size: they are asked for every step)."""
        if self._weights is None:
            self._weights = Weights(self.names, self.spec, self.global_batch_size, np.ones(len(self.names)))
        return self._weights

    def _order(self, start: int, counts: np.ndarray) -> Iterator[int]:
        """Which source each sample of the pass comes from, from pass sample ``start`` with ``counts``."""
        weights, counts = self.weights(), counts.copy()
        for at in itertools.count(start, _CHUNK):  # planned past a linear Schedule's end as held there (check_step)
            yield from blend(weights, self.total + at, self.anchor, self.anchor_counts, counts, _CHUNK).tolist()

    def check_step(self, samples: int) -> None:
        """Refuse a step that would reach past a linear Schedule's end (``samples``: of this pass after the step)."""
        self.weights().check_reach(self.total + samples)

    def position(self, samples: int) -> dict[str, Any]:
        """The mixture's position after ``samples`` samples of this pass (what the loader saves)."""
        at, counts = self._at
        if samples < at:
            at, counts = 0, self.counts.copy()
        if samples > at:
            counts = counts.copy()
            blend(self.weights(), self.total + at, self.anchor, self.anchor_counts, counts, samples - at)
        self._at = (samples, counts)
        names = self.names
        return {
            "sources": list(names),
            "exhausted": self.exhausted,
            "epoch": self.epoch,
            "total": self.total + samples,
            "counts": dict(zip(names, counts.tolist())),
            "anchor": {"at": self.anchor, "counts": dict(zip(names, self.anchor_counts.tolist()))},
            "weights": self.weights().fingerprint,
        }

    def seek(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved :meth:`position` (any data size); other weights start new targets from it."""
        saved, now = list(state["sources"]), list(self.names)
        if sorted(saved) != sorted(now):
            added, removed = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
            raise DataError(
                f"the saved stream mixture position has sources {sorted(saved)}, this mixture {sorted(now)} "
                f"(added: {added}, removed: {removed}): resume with the same sources (a renamed source counts as "
                "removed and added), then change the weights; to start new sources, start over without "
                "load_state_dict"
            )
        if state["exhausted"] != self.exhausted:
            raise DataError(
                f"the saved stream mixture ran with exhausted={state['exhausted']!r}, this one has "
                f"{self.exhausted!r}: give mix(..., exhausted={state['exhausted']!r})"
            )
        self.epoch, self.total = int(state["epoch"]), int(state["total"])
        self.counts = np.array([int(state["counts"][n]) for n in self.names], dtype=np.int64)
        self.anchor = int(state["anchor"]["at"])
        self.anchor_counts = np.array([int(state["anchor"]["counts"][n]) for n in self.names], dtype=np.int64)
        if self.weights().fingerprint != state["weights"]:  # new weights: new targets from where each source is
            self.anchor, self.anchor_counts = self.total, self.counts.copy()
        self._at = (0, self.counts.copy())

    def next_pass(self, epoch: int, samples: int) -> None:
        """Start pass ``epoch`` after ``samples`` samples of this one: every source from its start."""
        self.epoch, self.total = int(epoch), self.total + int(samples)
        self.counts = np.zeros(len(self.names), dtype=np.int64)
        self.anchor, self.anchor_counts = self.total, self.counts.copy()
        self._at = (0, self.counts.copy())

    # ---- reading
    def _open(self, s: int) -> Iterator[Any]:
        source = self.sources[s]
        if hasattr(source, "set_epoch"):
            source.set_epoch(self.epoch)  # a shuffled datasets stream reshuffles by the pass
        return iter(source)

    def _sample(self, s: int, sample: Any) -> dict[str, Any]:
        return tag_source(self.names, s, sample)

    def _skip(self, s: int, n: int) -> Iterator[Any]:
        """Source ``s`` opened and moved past its first ``n`` samples (under ``"repeat"``, across its restarts)."""
        it, seen = self._open(s), 0
        for _ in range(n):
            try:
                next(it)
            except StopIteration:
                if self.exhausted != "repeat" or seen == 0:
                    raise DataError(self._past_end(s, n, seen)) from None
                it = self._open(s)
                next(it)
            seen += 1
        return it

    def _past_end(self, s: int, n: int, seen: int) -> str:
        return (
            f"the saved position has {n} samples of mixture source {self.names[s]!r}, and the stream gave "
            f"{seen}: the source changed since the save; resume with the same source, or start over"
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        iters = [self._skip(s, int(n)) for s, n in enumerate(self.counts)]
        limit = None if self.exhausted != "repeat" else self.epoch_samples - int(self.counts.sum())
        for i, s in enumerate(self._order(0, self.counts)):
            if limit is not None and i >= limit:
                return
            sample = next(iters[s], _END)
            if sample is _END:  # the source ran out
                if self.exhausted == "stop":
                    return
                iters[s] = self._open(s)
                sample = next(iters[s], _END)
                if sample is _END:
                    raise DataError(f"mixture source {self.names[s]!r} gave no sample: drop it from the mixture")
            yield self._sample(s, sample)

    def eval_stream(self) -> torch.utils.data.IterableDataset:
        """Every sample of every source once, source after source (what a loader in ``mode="eval"`` reads)."""
        return _Chained(self)


class _Chained(torch.utils.data.IterableDataset):
    def __init__(self, mixture: StreamMixture) -> None:
        self.mixture = mixture

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in range(len(self.mixture.sources)):
            for sample in self.mixture._open(s):
                yield self.mixture._sample(s, sample)
