"""Weighted mixtures of sources: :func:`mix` joins named sources into one dataset that the loaders draw from.

A mixture is read like any source of its kind: array sources (``ArrayDataset``, a mapping of arrays, packed rows)
make an :class:`ArrayMixture`, read field by field and part by part; map-style sources (a torch ``Dataset``, a
``datasets.Dataset``) make a :class:`SampleMixture`, read sample by sample. Either adds the field ``source``
(which source a row came from, an index into ``names``). The row indices a loader sees are positions in the
sources laid end to end (``offsets``). Which source each sample of a run comes from, and each source's own epochs
and shuffles, are the sampler's (:class:`meshwise.data.blend.MixtureSampler`); in ``mode="eval"`` a loader reads
every sample of every source once, source after source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from meshwise.data.blend import EXHAUSTED, SOURCE, Blend, MixtureSampler, Schedule, check_weights, tag_source
from meshwise.data.mapped import check_map_style
from meshwise.data.sources import ArrayDataset, Source, torch_dtype
from meshwise.data.stream_mixture import StreamMixture
from meshwise.data.streaming import is_streaming
from meshwise.errors import DataError

__all__ = ["ArrayMixture", "SampleMixture", "mix"]


class _Concat(Source):
    """One field of every array source, end to end: a read of rows goes to the sources that hold them."""

    kind = "mixture"

    def __init__(self, parts: Sequence[Source], blend: Blend) -> None:
        self.parts, self.blend = list(parts), blend
        first = self.parts[0]
        self.shape, self.dtype = (sum(blend.lengths), *first.shape[1:]), first.dtype
        chunks = getattr(first, "chunks", None)
        self.chunks = chunks if all(getattr(p, "chunks", None) == chunks for p in self.parts) else None

    def read(self, idx: np.ndarray, region: tuple[slice, ...], out: Any) -> int:
        source, rows = self.blend.locate(idx)
        total = 0
        for s in np.flatnonzero(np.bincount(source, minlength=len(self.parts))):
            at = np.flatnonzero(source == s)
            part = self.parts[int(s)]
            if len(at) == len(idx):  # every row from one source: its read fills ``out`` directly
                return part.read(rows, region, out)
            total += part.read_into(rows[at], region, out, at if isinstance(out, np.ndarray) else torch.from_numpy(at))
        return total


class _SourceIds(Source):
    """The ``source`` field: which source each end-to-end row belongs to, computed, not read (0 bytes)."""

    kind = "mixture"
    dtype = np.dtype(np.int64)

    def __init__(self, blend: Blend) -> None:
        self.blend, self.shape = blend, (sum(blend.lengths),)

    def read(self, idx: np.ndarray, region: tuple[slice, ...], out: Any) -> int:
        out[...] = (
            self.blend.locate(idx)[0] if isinstance(out, np.ndarray) else torch.from_numpy(self.blend.locate(idx)[0])
        )
        return 0


class ArrayMixture(ArrayDataset):
    """Array sources with the same fields, end to end, plus the ``source`` field (built by :func:`mix`)."""

    def __init__(self, sources: Mapping[str, ArrayDataset], blend: Blend) -> None:
        first = next(iter(sources.values()))
        for name, ds in sources.items():
            if ds.names != first.names:
                raise DataError(
                    f"mixture source {name!r} has fields {list(ds.names)}, another has {list(first.names)}: every "
                    "source must have the same fields (select or rename fields before mixing)"
                )
            for field in ds.names:
                a, b = ds.sources[field], first.sources[field]
                if a.shape[1:] != b.shape[1:] or torch_dtype(a.dtype) != torch_dtype(b.dtype):
                    raise DataError(
                        f"field {field!r} of mixture source {name!r} is {a.shape[1:]} {a.dtype}, another source's "
                        f"is {b.shape[1:]} {b.dtype}: a batch joins rows of every source, so each field needs one "
                        "sample shape and dtype"
                    )
        if SOURCE in first.names:
            raise DataError(f"the field name {SOURCE!r} is the mixture's own (which source a row is from): rename it")
        fields: dict[str, Source] = {f: _Concat([ds.sources[f] for ds in sources.values()], blend) for f in first.names}
        fields[SOURCE] = _SourceIds(blend)
        super().__init__(fields)
        self.blend = blend

    def train_sampler(self, global_batch_size: int, data_rank: int, data_size: int) -> MixtureSampler:
        """The sampler a loader uses in ``mode="train"``: the blend of the sources (the loader's hook)."""
        return MixtureSampler(self.blend, global_batch_size, data_rank=data_rank, data_size=data_size)


class SampleMixture:
    """Map-style sources, end to end: item ``i`` is the sample of the source that holds it, plus ``source``."""

    def __init__(self, sources: Mapping[str, Any], blend: Blend) -> None:
        self.sources, self.blend = list(sources.values()), blend

    def train_sampler(self, global_batch_size: int, data_rank: int, data_size: int) -> MixtureSampler:
        """The sampler a loader uses in ``mode="train"``: the blend of the sources (the loader's hook)."""
        return MixtureSampler(self.blend, global_batch_size, data_rank=data_rank, data_size=data_size)

    def __len__(self) -> int:
        return sum(self.blend.lengths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        source, row = self.blend.locate(np.array([index], dtype=np.int64))
        s = int(source[0])
        return tag_source(self.blend.names, s, self.sources[s][int(row[0])])


def mix(
    sources: Mapping[str, Any],
    weights: Mapping[str, float] | Schedule,
    *,
    seed: int = 0,
    exhausted: str = "repeat",
    epoch_samples: int | None = None,
) -> ArrayMixture | SampleMixture | StreamMixture:
    """A dataset that draws from named ``sources`` at ``weights``: pass it to :func:`mesh_dataloader`.

    ``weights`` maps source names to weights (normalised to sum 1), or is a :class:`Schedule` of weights that
    change over the run. Which source the n-th sample of the run comes from depends only on n, the weights and
    the counts so far (Megatron's blending rule: every prefix within one sample of the declared proportions);
    each source is shuffled by its own epochs, seeded by ``seed`` and its name. ``exhausted`` says what a source
    that runs out does: ``"repeat"`` (its next epoch, reshuffled; an epoch of the mixture is ``epoch_samples``
    samples, by default all sources' lengths summed), ``"stop"`` (the mixture's epoch ends; every source then
    starts its next epoch) or ``"drop"`` (it leaves the mixture, the others' weights are renormalised; the
    epoch ends when every sample of every source was drawn once). Sources are all arrays (an ``ArrayDataset``, a
    mapping of arrays, packed rows), all map-style datasets, or all streams (a torch or ``datasets``
    ``IterableDataset``: a :class:`~meshwise.data.stream_mixture.StreamMixture`, which resumes on any data size;
    ``"stop"`` or ``"repeat"`` with ``epoch_samples``, each pass reads every source from its start); every batch
    gets the field ``source``.
    """
    if not isinstance(sources, Mapping) or not sources:
        raise DataError("mix() takes a non-empty mapping source name -> dataset, e.g. mix({'web': a, 'code': b}, ...)")
    names = tuple(str(n) for n in sources)
    if exhausted not in EXHAUSTED:
        raise DataError(f"exhausted must be one of {EXHAUSTED}, got {exhausted!r}")
    if epoch_samples is not None and (isinstance(epoch_samples, bool) or int(epoch_samples) < 1):
        raise DataError(f"epoch_samples must be a positive int, got {epoch_samples!r}")
    if epoch_samples is not None and exhausted != "repeat":
        raise DataError(f"epoch_samples= is for exhausted='repeat'; under {exhausted!r} the sources' lengths set it")
    streams = [n for n, ds in sources.items() if is_streaming(ds)]
    if streams and len(streams) != len(sources):
        raise DataError(
            f"mixture sources {streams} are streams and {sorted(set(sources) - set(streams))} are not: give every "
            "source as the same kind (a stream mixture reads its sources in order; map-style ones are read by "
            "index): wrap the others as IterableDatasets, or load the streams map-style"
        )
    if streams:  # a stream's passes differ in length anyway: 'stop' with a Schedule is fine there
        _check_weights(weights, names)
        return StreamMixture(sources, weights, seed=int(seed), exhausted=exhausted, epoch_samples=epoch_samples)
    arrays = {n: ds for n, ds in sources.items() if isinstance(ds, (ArrayDataset, Mapping))}
    if arrays and len(arrays) != len(sources):
        raise DataError(
            f"mixture sources {sorted(arrays)} are arrays and {sorted(set(sources) - set(arrays))} are map-style "
            "datasets: give every source as the same kind (wrap the arrays in a map-style Dataset, or convert the "
            "others with datasets' to_numpy/ArrayDataset)"
        )
    if arrays:
        sources = {n: ds if isinstance(ds, ArrayDataset) else ArrayDataset(ds) for n, ds in sources.items()}
    else:
        for ds in sources.values():
            check_map_style(ds)
    lengths = tuple(len(ds) for ds in sources.values())
    empty = [n for n, length in zip(names, lengths) if length < 1]
    if empty:
        raise DataError(f"mixture sources {empty} have no samples: drop them from the mixture")
    _check_weights(weights, names)
    if exhausted == "stop" and isinstance(weights, Schedule) and len(weights.points) > 1:
        raise DataError(
            "exhausted='stop' with a Schedule gives epochs of different lengths (each ends when a source runs "
            "out, which depends on the weights), and an ignite run has one epoch_length: use 'repeat' or 'drop'"
        )
    blend = Blend(names, lengths, weights, int(seed), exhausted, int(epoch_samples or sum(lengths)))
    return ArrayMixture(sources, blend) if arrays else SampleMixture(sources, blend)


def _check_weights(weights: Mapping[str, float] | Schedule, names: Sequence[str]) -> None:
    if isinstance(weights, Schedule):
        weights.check(names)
    else:
        check_weights(weights, names, "mix()")
