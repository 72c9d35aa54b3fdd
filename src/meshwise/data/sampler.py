"""The global-batch sampler: one sample order per (seed, epoch), a global cursor, each data rank its slice.

Pure arithmetic over ``(data_rank, data_size)``: it needs no process group, so every rank's view can be
simulated in one process. The cursor counts *samples consumed* of the global order, so its state resumes on
a mesh with another data-parallel size (or another global batch) and continues the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from meshwise.errors import DataError
from meshwise.topology import Topology, resolve

__all__ = ["MODES", "MeshSampler"]

MODES = ("train", "eval")


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
