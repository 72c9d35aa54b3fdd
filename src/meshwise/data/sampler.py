"""The global-batch sampler: one sample order per (seed, epoch), a global cursor, each data rank its slice.

Pure arithmetic over ``(data_rank, data_size)``: it needs no process group, so every rank's view can be
simulated in one process. The cursor counts *samples consumed* of the global order, so its state resumes on
a mesh with another data-parallel size (or another global batch) and continues the same order.
:class:`CursorLoader` is what the array and map-style loaders share on top of it: the cursor methods, the
replica read strategy and the worker options.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from meshwise.data.options import LoaderOptions
from meshwise.data.parts import as_dtensor
from meshwise.dryrun import active
from meshwise.errors import DataError
from meshwise.topology import Topology, resolve

__all__ = ["MODES", "READS", "SUPERSEDED", "CursorLoader", "MeshSampler"]

MODES = ("train", "eval")
READS = ("each", "broadcast", "scatter")
# What an iterator says when asked for a batch after a newer iter() of its loader took over the position.
SUPERSEDED = (
    "this iterator over a {loader} was superseded: a newer iter() of the same loader continues from the position, "
    "so this one would hand out batches that the newer one hands out too (or skip them); iterate the newest "
    "iterator only (a `for` loop or ignite's run() takes a new one each time, which is fine)"
)


class MeshSampler:
    """Global batches of ``global_batch_size`` sample indices; data rank ``r`` takes rows ``[r*B, (r+1)*B)``.

    ``mode="train"``: a permutation per ``(seed, epoch)``; the last partial global batch is dropped
    (``drop_last=True``) or padded with index ``-1``. ``mode="eval"``: samples in order, every sample exactly
    once; the last global batch is padded with ``-1``, so every data rank runs the same number of steps.
    Iterating yields this rank's local indices ``[B]`` (``-1`` = padding) and advances the cursor as each
    batch is handed out; after the last batch of an epoch the cursor moves to the start of the next epoch.
    """

    def __init__(
        self,
        dataset_length: int,
        global_batch_size: int,
        *,
        data_rank: int = 0,
        data_size: int = 1,
        mode: str = "train",
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if mode not in MODES:
            raise DataError(f"mode must be one of {MODES}, got {mode!r}")
        for name, value in (("dataset_length", dataset_length), ("global_batch_size", global_batch_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise DataError(f"{name} must be an int, got {value!r}")
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if not 0 <= data_rank < data_size:
            raise DataError(f"data_rank {data_rank} is outside data_size {data_size}")
        if global_batch_size % data_size:
            raise DataError(
                f"global batch {global_batch_size} is not divisible by the data size {data_size} (product of the "
                f"mesh's batch dims): use a multiple of {data_size}, "
                f"e.g. {max(1, global_batch_size // data_size) * data_size}"
            )
        if dataset_length < 1:
            raise DataError("the dataset is empty: give at least one sample")
        self.drop_last = bool(drop_last) and mode == "train"
        if self.drop_last and dataset_length < global_batch_size:
            raise DataError(
                f"the train dataset has {dataset_length} samples, fewer than one global batch of {global_batch_size}, "
                "so drop_last=True leaves no step: use a smaller global batch, more data, or drop_last=False (padding)"
            )
        self.dataset_length = int(dataset_length)
        self.global_batch_size = int(global_batch_size)
        self.data_rank, self.data_size = int(data_rank), int(data_size)
        self.local_batch_size = self.global_batch_size // self.data_size
        self.mode, self.seed = mode, int(seed)
        self.epoch = 0
        self.consumed = 0  # samples of the current epoch's global order already handed out
        self._order_cache: tuple[tuple[int, int], np.ndarray] | None = None

    @classmethod
    def from_topology(
        cls, topology: Topology | None, dataset_length: int, global_batch_size: int, **kwargs: Any
    ) -> MeshSampler:
        """A sampler for this rank: ``data_rank``/``data_size`` come from the topology's batch dims."""
        topology = resolve(topology)
        return cls(
            dataset_length, global_batch_size, data_rank=topology.data_rank, data_size=topology.data_size, **kwargs
        )

    # ---- order
    def order(self, epoch: int | None = None) -> np.ndarray:
        """The global sample order of ``epoch`` (the current one by default), the same on every rank."""
        epoch = self.epoch if epoch is None else epoch
        key = (self.seed, epoch)
        if self._order_cache is None or self._order_cache[0] != key:
            if self.mode == "eval":
                order = np.arange(self.dataset_length, dtype=np.int64)
            else:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_length).astype(np.int64)
            self._order_cache = (key, order)
        return self._order_cache[1]

    def _steps_from(self, consumed: int) -> int:
        left = self.dataset_length - consumed
        return left // self.global_batch_size if self.drop_last else math.ceil(left / self.global_batch_size)

    def __len__(self) -> int:
        """Steps in a full epoch (the same on every data rank)."""
        return self._steps_from(0)

    @property
    def remaining_steps(self) -> int:
        """Steps left in the current epoch from the cursor."""
        return self._steps_from(self.consumed)

    def global_batch(self, start: int, epoch: int | None = None) -> np.ndarray:
        """The ``global_batch_size`` indices starting at position ``start`` of the order, ``-1``-padded."""
        ids = self.order(epoch)[start : start + self.global_batch_size]
        if len(ids) < self.global_batch_size:
            ids = np.concatenate([ids, np.full(self.global_batch_size - len(ids), -1, dtype=np.int64)])
        return ids

    def local_batch(self, start: int, epoch: int | None = None) -> np.ndarray:
        """This data rank's rows of the global batch at ``start``."""
        b = self.local_batch_size
        return self.global_batch(start, epoch)[self.data_rank * b : (self.data_rank + 1) * b]

    def plan(self) -> list[np.ndarray]:
        """This rank's local batches for the rest of the current epoch (the cursor does not move)."""
        starts = range(
            self.consumed, self.consumed + self.remaining_steps * self.global_batch_size, self.global_batch_size
        )
        return [self.local_batch(s) for s in starts]

    def advance(self) -> None:
        """Move the cursor one global batch; past the last step of the epoch, go to the next epoch's start."""
        self.consumed += self.global_batch_size
        if self.remaining_steps == 0:
            self.consumed = 0
            if self.mode == "train":
                self.epoch += 1

    def __iter__(self) -> Iterator[np.ndarray]:
        for local in self.plan():
            self.advance()
            yield local

    # ---- state
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch keeps its cursor (so a resume is not undone)."""
        if int(epoch) != self.epoch:
            self.epoch, self.consumed = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        """The global cursor: identical on every rank, independent of the mesh."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "samples_consumed": self.consumed,
            "dataset_length": self.dataset_length,
            "global_batch_size": self.global_batch_size,
            "mode": self.mode,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a saved cursor, also at another data-parallel size or global batch (same dataset and mode)."""
        missing = {"epoch", "seed", "samples_consumed", "dataset_length"} - set(state)
        if missing:
            raise DataError(f"sampler state lacks {sorted(missing)}: pass a state_dict() of a meshwise loader/sampler")
        if int(state["dataset_length"]) != self.dataset_length:
            raise DataError(
                f"the saved data cursor is for a dataset of {state['dataset_length']} samples, this one has "
                f"{self.dataset_length}: resume with the same dataset (or start a fresh epoch without load_state_dict)"
            )
        if state.get("mode", self.mode) != self.mode:
            raise DataError(f"the saved data cursor is for mode {state['mode']!r}, this loader is {self.mode!r}")
        consumed = int(state["samples_consumed"])
        if not 0 <= consumed <= self.dataset_length:
            raise DataError(f"saved samples_consumed {consumed} is outside the dataset of {self.dataset_length}")
        self.epoch, self.seed, self.consumed = int(state["epoch"]), int(state["seed"]), consumed
        if self.remaining_steps == 0 and consumed:
            self.consumed = 0
            if self.mode == "train":
                self.epoch += 1


def _identity(x: Any) -> Any:
    return x


class CursorLoader:
    """The part of a loader that rides on a :class:`MeshSampler`, written once for arrays and map-style sources.

    It holds ``sampler`` (the global cursor), ``topology``, the read strategy of the replica group (``read``,
    ``planned_read``, ``replica_size``, ``replica_rank``) and the worker options; subclasses read the batches.
    """

    dataset: Any
    sampler: MeshSampler
    topology: Topology
    parts: dict[str, Any]

    def _setup(self, topology: Topology | None, dataset_length: int, options: LoaderOptions) -> Topology:
        """Check the options, build the sampler and the read plan; returns the resolved topology."""
        if options.read not in READS:
            raise DataError(f"read must be one of {READS}, got {options.read!r}")
        options.check_workers()
        topology = resolve(topology)
        self.topology, self.options = topology, options
        mixture = getattr(getattr(self, "dataset", None), "train_sampler", None)  # meshwise.data.mix()
        if mixture is not None and options.mode == "train":
            if options.seed not in (0, self.dataset.blend.seed):
                raise DataError(
                    f"seed={options.seed} was given to the loader and seed={self.dataset.blend.seed} to mix(): a "
                    "mixture's order is seeded by mix(seed=); drop the loader's seed="
                )
            self.sampler = mixture(options.global_batch_size, topology.data_rank, topology.data_size)
        else:
            self.sampler = MeshSampler.from_topology(
                topology,
                dataset_length,
                options.global_batch_size,
                mode=options.mode,
                seed=options.seed,
                drop_last=options.drop_last,
            )
        replica = topology.replica_dims
        self.replica_size = topology.size(replica) if replica else 1
        self.replica_rank = topology.coordinate(replica) if replica else 0
        self.planned_read = options.read if self.replica_size > 1 else "each"
        # a dry run has no peers to hand the shared batch over: each replica reads it (meshwise.dryrun)
        self.read = self.planned_read if active() is None else "each"
        self._replica_ranks = topology.group_ranks(replica) if self.replica_size > 1 else [topology.rank]
        self.num_workers, self.prefetch_factor = options.num_workers, options.prefetch_factor
        self.multiprocessing_context = options.worker_context()
        self.bytes_read = 0
        return topology

    # ---- sizes and state
    @property
    def local_batch_size(self) -> int:
        """Samples a step on this rank: ``global_batch_size // topology.data_size``."""
        return self.sampler.local_batch_size

    def __len__(self) -> int:
        """Steps in a full epoch (the same on every rank)."""
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (the current epoch keeps its cursor)."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The global cursor (identical on every rank, JSON-friendly)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a saved cursor, also at another data-parallel size or global batch."""
        self.sampler.load_state_dict(state)

    def as_dtensor(self, tensor: torch.Tensor, name: str) -> Any:
        """Field ``name`` of a batch as a DTensor over the split dims (halo stripped; no communication)."""
        if name not in self.parts:
            raise DataError(f"no part of field {name!r} is known yet; the parts are of {sorted(self.parts)}")
        return as_dtensor(tensor, self.parts[name], self.topology)

    # ---- reading
    def __iter__(self) -> Iterator[Any]:
        """Batches from the cursor on: a new iterator continues where the last batch handed out left it.

        The newest iterator owns the cursor: an older one asked for another batch raises a ``DataError``, and
        one whose cursor was moved under it (``set_epoch``, ``load_state_dict``) ends.
        """
        token = self._owner = object()
        return self._batches(token)

    def _batches(self, token: object) -> Iterator[Any]:
        raise NotImplementedError

    def _hand_out(self, batch: dict[str, Any], local: np.ndarray, nbytes: int) -> tuple[int, int]:
        """Mark ``batch``'s valid rows and sample indices (``local``, -1 on padding), count the ``nbytes`` read for
        it and move the cursor past it; returns the new cursor. The cursor counts batches handed out, not batches
        prefetched."""
        batch["valid"] = torch.from_numpy(local >= 0)
        batch["index"] = torch.from_numpy(local.copy())
        self.bytes_read += nbytes
        self.sampler.advance()
        return self._cursor()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.dataset)} samples, global batch {self.sampler.global_batch_size}, "
            f"local {self.local_batch_size}, mode {self.sampler.mode!r}, read {self.read!r}, {len(self)} steps)"
        )

    def _cursor(self) -> tuple[int, int]:
        return self.sampler.epoch, self.sampler.consumed

    def _may_hand_out(self, token: object, cursor: tuple[int, int]) -> bool:
        """Whether iterator ``token``, which left the cursor at ``cursor``, may hand out its next planned batch."""
        if getattr(self, "_owner", None) is not token:
            raise DataError(SUPERSEDED.format(loader=type(self).__name__))
        return self._cursor() == cursor  # else set_epoch/load_state_dict moved it: the next iter() starts there

    def _scatter_rows(self) -> int:
        """Rows each replica rank reads under ``read="scatter"``: ``ceil(B / k)``."""
        return -(-self.local_batch_size // self.replica_size)

    def _in_workers(self, reader: Any, items: Iterable[Any]) -> Iterator[Any]:
        """``reader[item]`` for each item, read in ``num_workers`` DataLoader workers (one item a batch)."""
        yield from torch.utils.data.DataLoader(
            reader,
            batch_size=None,
            sampler=list(items),
            num_workers=self.num_workers,
            collate_fn=_identity,
            prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self.multiprocessing_context,
        )
