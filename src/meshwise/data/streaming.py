"""The loader of streaming sources: a torch ``IterableDataset`` or a ``datasets.IterableDataset``, read in order.

Samples are divided by *data rank* (ranks across replica, split and stage dims read the same samples):

* a ``datasets.IterableDataset`` goes through ``datasets.distributed.split_dataset_by_node`` with
  ``rank=topo.data_rank, world_size=topo.data_size``; its ``num_shards`` must be a multiple of the data size, so
  that every rank reads whole shard files of its own (else each rank would read the whole stream to keep one
  sample in k: a DataError asks for more shard files instead);
* a plain torch ``IterableDataset`` is read whole by every rank, which keeps every ``data_size``-th sample
  starting at ``data_rank`` (the stream must give the same order on every rank).

With ``num_workers > 0`` the rank's share is read in DataLoader worker processes, one sample an item:

* a ``datasets.IterableDataset`` through torchdata's ``StatefulDataLoader``, which gives each worker whole shard
  files of the rank's share (``datasets``' own worker split) and whose ``state_dict`` holds every worker's
  position;
* a plain torch ``IterableDataset`` through a torch ``DataLoader``: worker ``w`` of ``W`` keeps the share's
  samples ``j`` with ``(j - start) % W == w`` and the DataLoader takes one item from each worker in turn, so the
  samples come in exactly the order of ``num_workers=0`` and the position stays one count (any worker count
  resumes it).

``parts=`` cuts the collated batch along the split dims (e.g. ``Shard(0, balanced=True)`` on the token axis for
context parallel) with the map-style loader's cutting, that is the array road's part arithmetic
(``resolve_part``): the default collate pads a balanced axis to a multiple of ``2k``, and the batch gets
``positions``.

Every step each rank fills ``global_batch_size // data_size`` rows and the batch ranks agree, with one small
all-reduce over the batch dims, on whether to go on: in train mode the epoch ends for all when any rank's share
runs out (its partial batch is dropped); in eval mode a rank whose share ran out yields padded rows
(``valid=False``, ``index=-1``) until every rank is done, so each sample is seen once and no rank hangs.

``state_dict()`` is the position of every data rank (gathered over the batch dims, so it is the same on every
rank and a checkpoint written by rank 0 holds them all), the data size and a fingerprint of the source. A
``datasets.IterableDataset`` resumes through its own ``load_state_dict``; a plain torch ``IterableDataset``
resumes by reading and dropping the samples it had consumed (the cost of a resume is re-reading them).
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshwise import compat
from meshwise.data.collate import as_fields, pad_collate
from meshwise.data.options import LoaderOptions, OptionsLoader
from meshwise.data.parts import FieldPart, as_parts
from meshwise.data.reading import SampleReader, blank_padding, check_specs, positions_of
from meshwise.data.sampler import SUPERSEDED
from meshwise.data.stream_mixture import StreamMixture
from meshwise.errors import DataError
from meshwise.topology import Topology, resolve

__all__ = ["MeshStreamLoader", "is_streaming"]

MODES = ("train", "eval")

# The open stream of each loader (the iterator, and the StatefulDataLoader of a HF share read in workers), held
# here rather than on the loader, and its workers stopped when it is dropped. A loader in a reference cycle (an
# ignite engine holds it; a traceback holds the frame that read it) is freed by the cycle collector, which runs
# the weakref callbacks of everything it frees before any `__del__`: torch's worker queues would close first, and
# the DataLoader iterator's `__del__` would then wait 5 s per worker for workers that never got the stop message.
# Held here, the stream is outside the loader's garbage; the loader's finalizer (and `_close`) stops its workers
# while their queues still work.
_OPEN: dict[int, tuple[Iterator[Any], Any]] = {}
_KEYS = itertools.count()


def is_streaming(dataset: Any) -> bool:
    """Whether ``dataset`` is read in order: a torch ``IterableDataset`` or a ``datasets.IterableDataset``."""
    names = {c.__name__ for c in type(dataset).__mro__}
    return isinstance(dataset, torch.utils.data.IterableDataset) or "IterableDataset" in names


def _is_hf(dataset: Any) -> bool:
    return any(c.__module__.startswith("datasets.") and c.__name__ == "IterableDataset" for c in type(dataset).__mro__)


class _TorchShare(torch.utils.data.IterableDataset):
    """Data rank ``rank``'s share of a torch stream from share position ``start`` (split over DataLoader workers).

    Worker ``w`` of ``W`` yields the share's samples ``j >= start`` with ``(j - start) % W == w``; the DataLoader
    asks the workers in turn, one sample each, so the samples arrive in share order. Every worker reads the whole
    stream (a torch stream has no shards to hand out): the workers take what the stream computes per sample
    (decoding, tokenising), not the read itself; the collate runs in the main process.
    """

    def __init__(self, source: Any, rank: int, size: int, start: int, origin: int = 0) -> None:
        self.source, self.rank, self.size, self.start, self.origin = source, rank, size, start, origin

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        seen = 0
        for i, sample in enumerate(self.source):
            if i < self.origin or (i - self.origin) % self.size != self.rank:
                continue
            if seen >= self.start and (seen - self.start) % workers == worker:
                yield sample
            seen += 1
        if seen < self.start:
            raise DataError(_past_end(self.start, self.rank, seen))


def _identity(x: Any) -> Any:
    return x


def _past_end(skip: int, rank: int, seen: int) -> str:
    return (
        f"the saved position ({skip} samples consumed on data rank {rank}) is past the end of this stream's "
        f"share ({seen} samples): the source changed since the save; resume with the same source, or start "
        "over with set_epoch()"
    )


def _fingerprint(dataset: Any, hf: bool, seed: int) -> str:
    """What a saved position belongs to: the class, the shard count and file list (HF), and the user's seed."""
    parts = [f"{type(dataset).__module__}.{type(dataset).__qualname__}", f"seed={seed}"]
    if hf:
        parts.append(f"shards={dataset.num_shards}")
        kwargs = compat.iterable_source_kwargs(dataset)
        files = kwargs.get("original_files") or kwargs.get("base_files")
        if files:  # the same count of other files must not resume into the wrong ones
            parts.append("files=" + "|".join(map(str, files)))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def _drop(key: int) -> None:
    """Forget a loader's open stream and stop its worker processes (see ``_OPEN``)."""
    live, _ = _OPEN.pop(key, (None, None))
    compat.stop_loader_workers(live)


class MeshStreamLoader(OptionsLoader):
    """Dict batches of a streaming source for this rank: collated fields ``[B_local, ...]``, ``valid``, ``index``.

    Built by :func:`meshwise.data.mesh_dataloader` for a torch ``IterableDataset`` or a
    ``datasets.IterableDataset``. ``index`` is the sample's position in this data rank's share of the stream
    (``-1`` on padded rows). ``seed`` is folded into the fingerprint: give another seed for another stream of
    the same class. ``num_workers > 0`` reads the share in worker processes (``prefetch_factor`` and
    ``multiprocessing_context``, default ``"fork"``, pass through); the position stays exact at every step.
    """

    def _build(self, dataset: Any, topology: Topology | None, options: LoaderOptions) -> None:
        """Built from :class:`LoaderOptions` (:class:`~meshwise.data.options.OptionsLoader`); ``read`` must be
        ``"each"`` and ``stage_fields`` is refused."""
        global_batch_size, mode, seed = options.global_batch_size, options.mode, options.seed
        if mode not in MODES:
            raise DataError(f"mode must be one of {MODES}, got {mode!r}")
        options.check_workers()
        if options.read != "each":
            raise DataError(
                f"read={options.read!r} is not supported for streams: every rank of a replica group reads its share "
                "of the stream itself (a stream has no random access to hand rows out by); use read='each'"
            )
        if options.stage_fields is not None:
            raise DataError("streaming sources take no ['stage_fields']: drop them")
        if not options.drop_last and mode == "train":
            raise DataError(
                "drop_last=False in train mode is not supported for streams: a stream's end differs per rank; use "
                "mode='eval' to see every sample once (padded rows have valid=False)"
            )
        topology = resolve(topology)
        size = topology.data_size
        if global_batch_size <= 0 or global_batch_size % size:
            raise DataError(
                f"global_batch_size={global_batch_size} must be a positive multiple of the data size {size}"
            )
        self.hf = _is_hf(dataset)
        if self.hf and dataset.num_shards % size:
            raise DataError(
                f"the stream has {dataset.num_shards} shard(s) for {size} data ranks: split_dataset_by_node would "
                "make every rank read the whole stream and keep 1 sample in "
                f"{size}; write a multiple of {size} shard files (e.g. {size * max(1, -(-dataset.num_shards // size))}"
                ") so each rank reads its own files"
            )
        self.dataset, self.topology, self.mode, self.seed = dataset, topology, mode, seed
        self.local_batch_size = global_batch_size // size
        self.global_batch_size = global_batch_size
        self.collate_fn = pad_collate if options.collate_fn is None else options.collate_fn
        # parts: the map-style loader's cut of a collated batch (resolve_part's arithmetic), checked here once
        self.specs = as_parts(options.parts, topology)
        split = {d: (topology.coordinate(d), topology.size(d)) for d in topology.split_dims}
        check_specs(self.specs, split, topology.layout.dims_text())
        self._cutter = SampleReader(None, options.collate_fn, self.specs, split, topology.layout.dims_text())
        self.parts: dict[str, FieldPart] = {}  # the parts of the last batch handed out (shapes vary per batch)
        self.options = options
        self.num_workers, self.prefetch_factor = options.num_workers, options.prefetch_factor
        self.multiprocessing_context = options.worker_context()  # as for arrays: fork starts a worker in ms
        self.fingerprint = _fingerprint(dataset, self.hf, seed)
        # a mixture of streams (meshwise.data.mix): its position is the mixture's, the same on every data size
        self._mixture = dataset if isinstance(dataset, StreamMixture) else None
        if self._mixture is not None:
            self._mixture.bind(global_batch_size)
        self._origin = 0  # where in the stream this pass's division by data rank starts (moved by a resize)
        self.epoch = 0
        self._consumed = 0  # samples of this rank's share handed out this epoch
        self._hf_state: dict[str, Any] | None = None  # the HF stream's own state at the last batch handed out
        # The open stream of this pass is in _OPEN (see `_live`); the newest iterator owns it; the filler pads a
        # batch whose rows ran out (eval).
        self._key = next(_KEYS)
        weakref.finalize(self, _drop, self._key)
        self._owner: object = None
        self._filler: Any = None
        self._ds = self._split()

    def _split(self) -> Any:
        if self._mixture is not None and self.mode == "eval":
            return self._mixture.eval_stream()  # every source once, source after source
        if not self.hf:
            return self.dataset
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(self.dataset, rank=self.topology.data_rank, world_size=self.topology.data_size)
        ds.set_epoch(self.epoch)
        return ds

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from the start of the stream (a HF stream reshuffles by its epoch if shuffled)."""
        if self._mixture is not None:  # the samples of the pass left behind count in the run (a Schedule's)
            self._mixture.next_pass(epoch, self._pass_samples())
        self.epoch, self._consumed, self._hf_state, self._origin = epoch, 0, None, 0
        self._close()
        self._ds = self._split()

    def _close(self) -> None:
        """Drop the open stream (its workers stop); an iterator still holding it ends, the next opens anew."""
        _drop(self._key)
        self._filler = None

    @property
    def _live(self) -> Iterator[Any] | None:
        """The open stream of this pass, which sits exactly at the position (None: the next iterator opens one)."""
        return _OPEN.get(self._key, (None, None))[0]

    @property
    def _workers(self) -> Any:
        """The StatefulDataLoader reading a HF share in workers, this pass (None otherwise)."""
        return _OPEN.get(self._key, (None, None))[1]

    # ------------------------------------------------------------------ state

    def _position(self) -> Any:
        # "workers": a HF share read in workers saves the StatefulDataLoader's state, which only that many resume
        return {"consumed": self._consumed, "hf": self._hf_state, "workers": self.num_workers if self.hf else 0}

    def _pass_samples(self) -> int:
        """Samples of the stream this pass handed out over all data ranks (train: every rank the same count)."""
        return self._origin + self._consumed * self.topology.data_size

    def state_dict(self) -> dict[str, Any]:
        """Every data rank's stream position (a collective over the batch dims: call it on every rank)."""
        size = self.topology.data_size
        mine = (self.topology.data_rank, self._position())
        if size > 1:
            gathered: list[Any] = [None] * size
            dist.all_gather_object(gathered, mine, group=self.topology.group(self.topology.batch_dims))
        else:
            gathered = [mine]
        positions = [p for _, p in sorted(gathered, key=lambda x: x[0])]
        state = {
            "kind": "stream",
            "epoch": self.epoch,
            "data_size": size,
            "fingerprint": self.fingerprint,
            "positions": positions,
            "origin": self._origin,
        }
        if self._mixture is not None and self.mode == "train":
            state["mixture"] = self._mixture.position(self._pass_samples())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved positions (the same source; another data size where that is exact: docs/data.md)."""
        if state.get("kind") != "stream":
            raise DataError(
                "this state_dict is not a streaming loader's (a map-style or array loader saved it): resume with "
                "the loader type and source that saved it"
            )
        if state["fingerprint"] != self.fingerprint:
            raise DataError(
                "the saved stream position belongs to another source (class, shard count, file list or seed "
                "differ): resume with the same files and seed= that saved it, or start over with set_epoch()"
            )
        if state.get("mixture") is not None and self._mixture is not None:
            self.set_epoch(int(state["epoch"]))
            self._mixture.seek(state["mixture"])  # the pass goes on from the mixture's position, on any data size
            return
        if state["data_size"] != self.topology.data_size:
            self.set_epoch(int(state["epoch"]))
            self._origin = self._resized_origin(state)
            return
        mine = state["positions"][self.topology.data_rank]
        saved = int(mine.get("workers", 0))
        if self.hf and mine.get("hf") is not None and saved != self.num_workers:
            raise DataError(
                f"the stream position was saved with num_workers={saved}, this loader has num_workers="
                f"{self.num_workers}: a datasets stream read in workers saves each worker's own position; resume "
                f"with num_workers={saved}, or start over with set_epoch()"
            )
        self.set_epoch(int(state["epoch"]))
        # the position is the saved one at once (a state_dict() before the next batch returns it unchanged)
        self._consumed, self._hf_state = int(mine["consumed"]), mine.get("hf")
        self._origin = int(state.get("origin", 0))

    def _resized_origin(self, state: Mapping[str, Any]) -> int:
        """Where the division starts after a resume at another data size: past every sample handed out so far.

        Data rank ``r`` of ``D`` kept the samples ``origin + r + m * D``; with the same count ``c`` on every rank
        (train mode) they are exactly the first ``origin + c * D`` samples of the stream, so the new ranks divide
        the rest from there: each sample once. A datasets stream (whole shard files per rank, positioned by its
        own state) and unequal counts (an eval pass, where shares end apart) cannot be redistributed exactly."""
        saved, now = int(state["data_size"]), self.topology.data_size
        refuse = (
            f"the stream position was saved at data size {saved}, this mesh has data size {now}: resume at data "
            f"size {saved} (the batch dims' product), or start the epoch over with set_epoch()"
        )
        if self.hf:
            raise DataError(
                f"{refuse}. A datasets stream gives each data rank whole shard files and keeps its position in its "
                "own state, which holds no position per shard file to hand to other ranks"
            )
        consumed = {int(p["consumed"]) for p in state["positions"]}
        if len(consumed) != 1:
            raise DataError(
                f"{refuse}. The data ranks had handed out different counts {sorted(consumed)} (an evaluation pass "
                "near its end), so the samples read so far are not a prefix of the stream"
            )
        return int(state.get("origin", 0)) + consumed.pop() * saved

    # ------------------------------------------------------------------ reading

    def _open(self) -> tuple[Iterator[Any], Any]:
        """This rank's share of the stream from the position: the pass's start, or just after the last batch.

        Returns the iterator and the StatefulDataLoader of a HF share read in workers (else None), which
        ``_OPEN`` holds. The iterator holds no reference to the loader, so a loader dropped mid-pass is freed at
        once, its workers with it (in a cycle, the collector could free it inside a later loader's forked worker).
        """
        if self.hf:
            source = self._ds if self.num_workers == 0 else self._worker_loader(self._ds)
            if self._hf_state is not None:
                try:
                    source.load_state_dict(self._hf_state)
                except Exception as exc:  # the HF state is a nested dict; a mismatch shows up as any error
                    raise DataError(
                        f"the saved stream position does not fit this source ({type(exc).__name__}: {exc}): resume "
                        "with the same files that saved it, or start over with set_epoch()"
                    ) from exc
            return iter(source), (source if self.num_workers else None)
        # Every rank reads the whole stream and keeps every size-th sample from its data rank; a position inside
        # the pass replays (reads and drops) the samples consumed before it.
        share = _TorchShare(self._ds, self.topology.data_rank, self.topology.data_size, self._consumed, self._origin)
        return iter(self._worker_loader(share) if self.num_workers else share), None

    def _worker_loader(self, share: Any) -> Any:
        """The share read in ``num_workers`` processes, one sample an item (a StatefulDataLoader for a HF share)."""
        options = dict(
            batch_size=None,
            collate_fn=_identity,  # samples as the stream gives them (no numpy -> tensor conversion on the way)
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self.multiprocessing_context,
        )
        if not self.hf:
            return torch.utils.data.DataLoader(share, **options)
        from torchdata.stateful_dataloader import StatefulDataLoader

        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
            warnings.filterwarnings("ignore", message=".*set_vital", category=UserWarning)
            return StatefulDataLoader(share, **options)

    def _agree(self, value: int, op: Any) -> int:
        """The batch ranks' min (train) or max (eval) of ``value``: one small all-reduce a step."""
        if self.topology.data_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.topology.group(self.topology.batch_dims))
        return int(t.item())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Batches from the position on: a new iterator continues the pass where the last batch left it.

        The pass's stream stays open between iterators (with workers, their prefetched samples too), so a
        ``break`` and a new ``for`` loop, or ignite's ``run()`` called again, get exactly the next samples. The
        newest iterator owns the stream: an older one asked for another batch raises a ``DataError``, and one
        whose position was reset (``set_epoch``, ``load_state_dict``) ends.
        """
        token = self._owner = object()
        return self._batches(token)

    def _batches(self, token: object) -> Iterator[dict[str, Any]]:
        if self._live is None:
            _OPEN[self._key] = self._open()
        live = self._live
        while True:
            if self._owner is not token:
                raise DataError(SUPERSEDED.format(loader="MeshStreamLoader"))
            if self._live is not live:  # set_epoch or load_state_dict moved the position: the next iter() has it
                return
            try:
                batch = self._next_batch(live)
            except GeneratorExit:
                raise
            except BaseException:
                # A batch failed half-read: drop the stream, so the next iter() reopens it at the position (the
                # samples read for this batch are read again; none of them was handed out).
                if self._live is live:
                    self._close()
                raise
            if batch is None:  # the pass is over: the next iter() reads the stream again from its start
                if self._mixture is not None:
                    self._mixture.next_pass(self.epoch, self._pass_samples())
                self._consumed, self._hf_state, self._origin = 0, None, 0
                self._close()
                self._ds = self._split()
                return
            yield batch

    def _next_batch(self, stream: Iterator[Any]) -> dict[str, Any] | None:
        """The next batch of the pass, the position moved past it; ``None`` when the batch ranks agree it is over."""
        b = self.local_batch_size
        if self._mixture is not None and self.mode == "train":  # a linear Schedule's end: on every rank at once
            self._mixture.check_step(self._pass_samples() + self.global_batch_size)
        samples: list[Any] = []
        while len(samples) < b:
            try:
                samples.append(next(stream))
            except StopIteration:  # an exhausted generator keeps raising it: a later call pads (eval) or stops
                break
        if self.mode == "train":
            if self._agree(int(len(samples) == b), dist.ReduceOp.MIN) == 0:
                return None
        elif self._agree(len(samples), dist.ReduceOp.MAX) == 0:
            return None
        valid = len(samples)
        if samples:
            self._filler = samples[0]
        if self._filler is None:
            raise DataError(
                "this data rank's share of the stream is empty while others have samples: give the stream at "
                "least one sample per data rank (more shard files, or a longer stream)"
            )
        # Padded rows repeat a real sample so the collate sees full-size shapes; they are blanked below.
        batch = self.collate_fn(samples + [self._filler] * (b - valid))
        batch = as_fields(batch) if not isinstance(batch, dict) else batch
        if valid < b:
            blank_padding(batch, valid, b)
        if self.specs:  # this rank's part of each field named in parts, and the positions of balanced ones
            batch, self.parts = self._cutter.cut(batch)
            positions = positions_of(self.parts, batch)
            if positions is not None:
                batch["positions"] = positions.expand(b, -1)
        index = torch.full((b,), -1, dtype=torch.int64)
        index[:valid] = torch.arange(self._consumed, self._consumed + valid)
        batch["valid"] = index >= 0
        batch["index"] = index
        self._consumed += valid
        if self.hf:  # the position after exactly the samples handed out (workers: each worker's)
            self._hf_state = (self._ds if self._workers is None else self._workers).state_dict()
        return batch

    def __repr__(self) -> str:
        return (
            f"MeshStreamLoader({type(self.dataset).__name__}, global batch {self.global_batch_size}, "
            f"local {self.local_batch_size}, mode {self.mode!r}, data rank {self.topology.data_rank}/"
            f"{self.topology.data_size})"
        )
