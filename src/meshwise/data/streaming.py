"""The loader of streaming sources: a torch ``IterableDataset`` or a ``datasets.IterableDataset``, read in order.

Samples are divided by *data rank* (ranks across replica, split and stage dims read the same samples):

* a ``datasets.IterableDataset`` goes through ``datasets.distributed.split_dataset_by_node`` with
  ``rank=topo.data_rank, world_size=topo.data_size``; its ``num_shards`` must be a multiple of the data size, so
  that every rank reads whole shard files of its own (else each rank would read the whole stream to keep one
  sample in k: a DataError asks for more shard files instead);
* a plain torch ``IterableDataset`` is read whole by every rank, which keeps every ``data_size``-th sample
  starting at ``data_rank`` (the stream must give the same order on every rank).

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
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshwise.data.collate import as_fields, pad_collate
from meshwise.data.mapped import _blank
from meshwise.errors import DataError
from meshwise.topology import Topology, resolve

__all__ = ["MeshStreamLoader", "is_streaming"]

MODES = ("train", "eval")


def is_streaming(dataset: Any) -> bool:
    """Whether ``dataset`` is read in order: a torch ``IterableDataset`` or a ``datasets.IterableDataset``."""
    names = {c.__name__ for c in type(dataset).__mro__}
    return isinstance(dataset, torch.utils.data.IterableDataset) or "IterableDataset" in names


def _is_hf(dataset: Any) -> bool:
    return any(c.__module__.startswith("datasets.") and c.__name__ == "IterableDataset" for c in type(dataset).__mro__)


def _fingerprint(dataset: Any, hf: bool, seed: int) -> str:
    """What a saved position belongs to: the class, the shard count and file list (HF), and the user's seed."""
    parts = [f"{type(dataset).__module__}.{type(dataset).__qualname__}", f"seed={seed}"]
    if hf:
        parts.append(f"shards={dataset.num_shards}")
        kwargs = getattr(getattr(dataset, "_ex_iterable", None), "kwargs", None) or {}
        files = kwargs.get("original_files") or kwargs.get("base_files")
        if files:  # the same count of other files must not resume into the wrong ones
            parts.append("files=" + "|".join(map(str, files)))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


class MeshStreamLoader:
    """Dict batches of a streaming source for this rank: collated fields ``[B_local, ...]``, ``valid``, ``index``.

    Built by :func:`meshwise.data.mesh_dataloader` for a torch ``IterableDataset`` or a
    ``datasets.IterableDataset``. ``index`` is the sample's position in this data rank's share of the stream
    (``-1`` on padded rows). ``seed`` is folded into the fingerprint: give another seed for another stream of
    the same class. Only ``num_workers=0`` (the stream position must be exact at every step).
    """

    def __init__(
        self,
        dataset: Any,
        topology: Topology | None = None,
        *,
        global_batch_size: int,
        mode: str = "train",
        seed: int = 0,
        drop_last: bool = True,
        parts: Any = None,
        read: str = "each",
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise DataError(f"mode must be one of {MODES}, got {mode!r}")
        if num_workers != 0:
            raise DataError(
                f"num_workers={num_workers} is not supported for streaming sources yet (the saved stream position "
                "must be exact at every step): use num_workers=0, or shard the source into more files and "
                "pre-process it offline"
            )
        if read != "each" or parts is not None:
            raise DataError(
                "read= and parts= need fixed-shape array fields; streaming samples are read whole by every rank of "
                "a replica group: use read='each' and no parts"
            )
        if kwargs:
            raise DataError(f"streaming sources take no {sorted(kwargs)}: drop them (num_workers=0 only)")
        if not drop_last and mode == "train":
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
        self.collate_fn = pad_collate if collate_fn is None else collate_fn
        self.fingerprint = _fingerprint(dataset, self.hf, seed)
        self.epoch = 0
        self._consumed = 0  # samples of this rank's share handed out this epoch
        self._hf_state: dict[str, Any] | None = None  # the HF stream's own state at the last batch handed out
        self._resume: Any = None  # this rank's saved position, applied at the next __iter__
        self._ds = self._split()

    def _split(self) -> Any:
        if not self.hf:
            return self.dataset
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(self.dataset, rank=self.topology.data_rank, world_size=self.topology.data_size)
        ds.set_epoch(self.epoch)
        return ds

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from the start of the stream (a HF stream reshuffles by its epoch if shuffled)."""
        self.epoch, self._consumed, self._hf_state, self._resume = epoch, 0, None, None
        self._ds = self._split()

    # ------------------------------------------------------------------ state

    def _position(self) -> Any:
        return {"consumed": self._consumed, "hf": self._hf_state}

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
        return {
            "kind": "stream",
            "epoch": self.epoch,
            "data_size": size,
            "fingerprint": self.fingerprint,
            "positions": positions,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved positions; the same data size and source are required (never a silent skip)."""
        if state.get("kind") != "stream":
            raise DataError(
                "this state_dict is not a streaming loader's (a map-style or array loader saved it): resume with "
                "the loader type and source that saved it"
            )
        if state["data_size"] != self.topology.data_size:
            raise DataError(
                f"the stream position was saved at data size {state['data_size']}, this mesh has data size "
                f"{self.topology.data_size}: a stream's per-rank positions cannot be redistributed; resume at "
                f"data size {state['data_size']} (the batch dims' product), or start the epoch over with set_epoch()"
            )
        if state["fingerprint"] != self.fingerprint:
            raise DataError(
                "the saved stream position belongs to another source (class, shard count, file list or seed "
                "differ): resume with the same files and seed= that saved it, or start over with set_epoch()"
            )
        self.set_epoch(int(state["epoch"]))
        self._resume = state["positions"][self.topology.data_rank]

    # ------------------------------------------------------------------ reading

    def _stream(self) -> Iterator[Any]:
        """This rank's share of the stream, from the resume position when there is one."""
        resume, self._resume = self._resume, None
        skip = 0
        if resume is not None:
            self._consumed = int(resume["consumed"])
            if self.hf and resume["hf"] is not None:
                try:
                    self._ds.load_state_dict(resume["hf"])
                except Exception as exc:  # the HF state is a nested dict; a mismatch shows up as any error
                    raise DataError(
                        f"the saved stream position does not fit this source ({type(exc).__name__}: {exc}): resume "
                        "with the same files that saved it, or start over with set_epoch()"
                    ) from exc
            elif not self.hf:
                skip = self._consumed
        if self.hf:
            yield from self._ds
            return
        rank, size = self.topology.data_rank, self.topology.data_size
        # Every rank reads the whole stream and keeps every size-th sample from its data rank; a resume replays
        # (reads and drops) the samples consumed before.
        seen = 0
        for i, sample in enumerate(self._ds):
            if i % size != rank:
                continue
            seen += 1
            if seen > skip:
                yield sample
        if seen < skip:
            raise DataError(
                f"the saved position ({skip} samples consumed on data rank {rank}) is past the end of this stream's "
                f"share ({seen} samples): the source changed since the save; resume with the same source, or start "
                "over with set_epoch()"
            )

    def _agree(self, value: int, op: Any) -> int:
        """The batch ranks' min (train) or max (eval) of ``value``: one small all-reduce a step."""
        if self.topology.data_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.topology.group(self.topology.batch_dims))
        return int(t.item())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        b = self.local_batch_size
        stream = self._stream()
        filler: Any = None
        done = False
        while True:
            samples: list[Any] = []
            while not done and len(samples) < b:
                try:
                    samples.append(next(stream))
                except StopIteration:
                    done = True
            if self.mode == "train":
                if self._agree(int(len(samples) == b), dist.ReduceOp.MIN) == 0:
                    break
            elif self._agree(len(samples), dist.ReduceOp.MAX) == 0:
                break
            valid = len(samples)
            if samples:
                filler = samples[0]
            if filler is None:
                raise DataError(
                    "this data rank's share of the stream is empty while others have samples: give the stream at "
                    "least one sample per data rank (more shard files, or a longer stream)"
                )
            # Padded rows repeat a real sample so the collate sees full-size shapes; they are blanked below.
            batch = self.collate_fn(samples + [filler] * (b - valid))
            batch = as_fields(batch) if not isinstance(batch, dict) else batch
            if valid < b:
                _blank(batch, valid, b)
            index = torch.full((b,), -1, dtype=torch.int64)
            index[:valid] = torch.arange(self._consumed, self._consumed + valid)
            batch["valid"] = index >= 0
            batch["index"] = index
            self._consumed += valid
            if self.hf:
                self._hf_state = self._ds.state_dict()  # the position after exactly the samples handed out
            yield batch
        # The epoch is over: the next __iter__ reads the stream again from its start.
        self._consumed, self._hf_state = 0, None
        self._ds = self._split()

    def __repr__(self) -> str:
        return (
            f"MeshStreamLoader({type(self.dataset).__name__}, global batch {self.global_batch_size}, "
            f"local {self.local_batch_size}, mode {self.mode!r}, data rank {self.topology.data_rank}/"
            f"{self.topology.data_size})"
        )
