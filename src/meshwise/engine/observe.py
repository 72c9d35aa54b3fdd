"""What a run is doing, measured cheaply on every rank: learning rate, step time, samples/s and tokens/s, peak
memory, bytes read, and an MFU estimate from torch's FLOP counter on one step (``engine.state.observed``)."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import resource
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events

from meshwise import compat
from meshwise.debug import guarded
from meshwise.errors import MeshwiseError
from meshwise.topology import Topology, resolve

__all__ = ["PEAK_FLOPS", "PEAK_FLOPS_VARIABLE", "Observer", "observe", "observer_of", "peak_flops_of", "rank_stats"]

PEAK_FLOPS_VARIABLE = "MESHWISE_PEAK_FLOPS"

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s per device), matched on the CUDA device name.
# MFU against them is an estimate: fp32 models and other clocks reach other peaks; give peak_flops= to be exact.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
    "V100": 125e12,
}

_RANKS_WAIT_S = 10.0  # how long rank 0 waits for the other ranks' numbers at an epoch's end
_SMOOTHING = 0.1  # weight of the newest step in the progress bar's rates (an exponential moving average)
_ATTR = "_meshwise_observer"


def peak_flops_of(device: torch.device, given: float | None = None) -> float | None:
    """The peak FLOP/s that MFU divides by: ``given``, else ``$MESHWISE_PEAK_FLOPS``, else the table's figure for
    this CUDA device (:data:`PEAK_FLOPS`), else None (CPUs have no default: MFU is then not reported)."""
    if given is not None:
        return float(given)
    env = os.environ.get(PEAK_FLOPS_VARIABLE)
    if env:
        try:
            return float(env)
        except ValueError:
            raise MeshwiseError(f"{PEAK_FLOPS_VARIABLE}={env!r} is not a number of FLOP/s, e.g. 989e12") from None
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_FLOPS.items():
            if key in name:
                return value
    return None


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _rows_and_tokens(batch: Any, input_key: str) -> tuple[int, int]:
    """This rank's valid rows and, where the input is integer token ids (2-D), their tokens; (0, 0) if unknown."""
    if isinstance(batch, Mapping):
        valid = batch.get("valid")
        first = batch.get("input_ids", batch.get(input_key))
        if not isinstance(first, torch.Tensor):
            first = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim), None)
    else:
        valid = None
        items = batch if isinstance(batch, (list, tuple)) else [batch]
        first = next((v for v in items if isinstance(v, torch.Tensor) and v.ndim), None)
    if not isinstance(first, torch.Tensor) or first.ndim == 0:
        return 0, 0
    rows = int(valid.sum()) if isinstance(valid, torch.Tensor) else int(first.shape[0])
    tokens = 0
    if first.ndim == 2 and not first.is_floating_point() and first.dtype != torch.bool:
        tokens = rows * int(first.shape[1])
    return rows, tokens


class Observer:
    """Measures each iteration of an engine on this rank; :func:`observe` attaches one (``create_trainer`` does).

    After every iteration ``values`` (also ``engine.state.observed``) holds, with no collective: ``lr`` (the
    optimizer's first group; ``lr_g<i>`` for other groups whose rate differs), ``step_time_s`` (from the end
    of the previous iteration: data loading and handlers included), ``samples_per_s`` and, for integer 2-D
    inputs, ``tokens_per_s`` (this rank's valid rows × the batch dims' size, tokens × batch and split dims'
    sizes: the whole run's rate), ``peak_mem_mb`` (CUDA max allocated, else the process's peak RSS) and
    ``data_mb_read`` (the loader's ``bytes_read``, this rank); from a mixture (``meshwise.data.mix``),
    ``mix/<source>``, the share of the samples each source gave (in the run, or this epoch where sources
    restart each epoch). ``smoothed`` holds the rates averaged over
    recent steps, for a progress bar. With ``collectives`` (attach it on every rank then), at each epoch's end
    and the run's, :func:`rank_stats` fills ``ranks`` on global rank 0: every rank's peak memory and data read,
    through the rendezvous store (no collective).

    MFU: with ``count_flops`` the first iteration runs under ``torch.utils.flop_counter.FlopCounterMode``
    (it trains as usual; its time is left out of the rates) and one world all-reduce adds the counts:
    ``flops_per_step`` is that sum divided by the replica dims' size (the counter sees a tensor-parallel
    matmul at its DTensor's global shape, the same on every replica rank). Then each step adds ``tflops``
    (model TFLOP/s of the whole run) and, where a peak is known (:func:`peak_flops_of`), ``mfu`` =
    FLOP/s / (world size × peak): an estimate, since the counter counts matmuls, convolutions and attention
    only and a step's FLOPs may vary. Not on a mesh with pipeline stages: the counter's module tracker breaks
    the backward of torch's pipeline schedules there, so no ``tflops``/``mfu``.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        count_flops: bool = True,
        peak_flops: float | None = None,
        input_key: str = "input",
        collectives: bool = True,
    ) -> None:
        self.topology = resolve(topology)
        self.optimizer = optimizer
        self.collectives = bool(collectives)
        topo = self.topology
        # FlopCounterMode's module tracker breaks the backward of torch's pipeline schedules: no count with stages
        self.count_flops = bool(count_flops) and self.collectives and topo.size(topo.stage_dims) == 1
        self.peak_flops = peak_flops_of(topo.device, peak_flops)
        self.input_key = input_key
        self.sample_scale = topo.size(topo.batch_dims)
        self.token_scale = topo.size(topo.metric_dims)
        self.values: dict[str, float] = {}
        self.smoothed: dict[str, float] = {}
        self.flops_per_step: float | None = None
        self.ranks: list[dict[str, float]] = []  # every rank's peak memory and data read, at the last epoch end
        self.ranks_step: int | None = None
        self._last = math.nan
        self._counter: Any = None

    def attach(self, engine: Engine) -> Observer:
        engine.add_event_handler(Events.STARTED, self._started)
        if self.count_flops and self.flops_per_step is None:
            engine.add_event_handler(Events.ITERATION_STARTED(once=1), self._count_start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._completed)
        if self.collectives:
            engine.add_event_handler(Events.EPOCH_COMPLETED, self._gather)
            engine.add_event_handler(Events.COMPLETED, self._gather)
        engine.state.observed = self.values
        setattr(engine, _ATTR, self)
        return self

    def _started(self, engine: Engine) -> None:
        self._drop_counter()  # a user's EXCEPTION_RAISED handler that re-raised before ours could leave it entered
        engine.state.observed = self.values
        self._last = time.perf_counter()

    def _gather(self, engine: Engine) -> None:
        if self.ranks_step != engine.state.iteration and "peak_mem_mb" in self.values:
            self.ranks, self.ranks_step = rank_stats(self, engine.state.iteration), engine.state.iteration

    def _count_start(self, engine: Engine) -> None:
        if self.flops_per_step is not None:  # a later run of the same engine: counted already
            return
        from torch.utils.flop_counter import FlopCounterMode

        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        if not engine.has_event_handler(self._on_exception, Events.EXCEPTION_RAISED):
            engine.add_event_handler(Events.EXCEPTION_RAISED, self._on_exception)

    def _on_exception(self, engine: Engine, error: BaseException) -> None:
        """A step that raised under the counter: leave the counter (a torch mode that would go on counting every
        later op of the process), then let the error go on as ignite would: ignite re-raises only when no
        EXCEPTION_RAISED handler is registered, so this one re-raises when it is the only one."""
        self._drop_counter()
        handlers = [h for event, h, _, _ in compat.event_handlers(engine) if event == Events.EXCEPTION_RAISED]
        if all(h == self._on_exception for h in handlers):
            raise error

    def _drop_counter(self, *_: Any) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _count_end(self) -> None:
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        topo = self.topology
        total = torch.tensor([float(counter.get_total_flops())], dtype=torch.float64, device=topo.device)
        if topo.world_size > 1:
            with guarded(topo, topo.dims, "FLOP count"):
                dist.all_reduce(total)
        self.flops_per_step = float(total.item()) / topo.size(topo.replica_dims)
        self.values["flops_per_step"] = self.flops_per_step

    def _completed(self, engine: Engine) -> None:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        values = self.values
        counted = self._counter is not None
        if counted:
            self._count_end()
        if self.optimizer is not None:
            groups = self.optimizer.param_groups
            first = float(groups[0]["lr"])
            values["lr"] = first
            for i, group in enumerate(groups[1:], 1):
                if float(group["lr"]) != first:
                    values[f"lr_g{i}"] = float(group["lr"])
        device = self.topology.device
        values["peak_mem_mb"] = _peak_memory_mb(device)
        read = getattr(engine.state.dataloader, "bytes_read", None)
        if isinstance(read, (int, float)):
            values["data_mb_read"] = read / 2**20
        realised = getattr(getattr(engine.state.dataloader, "sampler", None), "realised", None)
        if realised is not None:  # a mixture (meshwise.data.mix): the share each source gave so far
            counts = realised()
            total = sum(counts.values()) or 1
            values.update({f"mix/{name}": n / total for name, n in counts.items()})
        if counted or not elapsed > 0:
            return  # the counted step runs slower under the counter: not a rate
        values["step_time_s"] = elapsed
        rows, tokens = _rows_and_tokens(engine.state.batch, self.input_key)
        rates = {"samples_per_s": rows * self.sample_scale / elapsed}
        if tokens:
            rates["tokens_per_s"] = tokens * self.token_scale / elapsed
        if self.flops_per_step is not None:
            rates["tflops"] = self.flops_per_step / elapsed / 1e12
            if self.peak_flops:
                rates["mfu"] = self.flops_per_step / elapsed / (self.topology.world_size * self.peak_flops)
        values.update(rates)
        for key, value in rates.items():
            old = self.smoothed.get(key)
            self.smoothed[key] = value if old is None else old + _SMOOTHING * (value - old)


def observe(
    engine: Engine,
    topology: Topology | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    count_flops: bool = True,
    peak_flops: float | None = None,
    collectives: bool = True,
) -> Observer:
    """The engine's :class:`Observer`, attached now if it has none (a second call returns the first one).
    Call it on every rank, or with ``collectives=False`` (no FLOP count, no per-rank gather) on some."""
    found = getattr(engine, _ATTR, None)
    if isinstance(found, Observer):
        if optimizer is not None and found.optimizer is None:
            found.optimizer = optimizer
        return found
    found = Observer(
        topology, optimizer=optimizer, count_flops=count_flops, peak_flops=peak_flops, collectives=collectives
    )
    return found.attach(engine)


def observer_of(engine: Engine) -> Observer | None:
    """The engine's :class:`Observer`, or None."""
    found = getattr(engine, _ATTR, None)
    return found if isinstance(found, Observer) else None


def rank_stats(observer: Observer, step: int = 0, wait_s: float = _RANKS_WAIT_S) -> list[dict[str, float]]:
    """Every rank's peak memory and data read at ``step``, by global rank (every rank calls; the others get []).

    Through the rendezvous store, not a collective: each rank posts its two numbers and global rank 0 waits up
    to ``wait_s`` for the others, so a rank that left the loop early meets no extra collective (the watchdog
    names it as usual) and a rank that never posts is left out of the list's values (NaN)."""
    topo = observer.topology
    mine = [observer.values.get("peak_mem_mb", math.nan), observer.values.get("data_mb_read", math.nan)]
    rows = [mine]
    if topo.world_size > 1:
        if topo.backend == "fake":  # a dry run: its store keeps nothing (torch 2.13 raises, 2.14 returns b"")
            return []
        key = f"meshwise/observe/{step}/{{}}"
        store = compat.default_store()
        store.set(key.format(topo.rank), json.dumps(mine))
        if topo.rank != 0:
            return []
        keys = [key.format(r) for r in range(topo.world_size)]
        try:  # every rank posted: one round trip for all
            store.wait(keys, datetime.timedelta(seconds=wait_s))
            values: list[bytes | None] = list(store.multi_get(keys))
        except (RuntimeError, dist.DistError):  # some did not in time: left out
            values = [store.get(k) if store.check([k]) else None for k in keys]
        rows = [json.loads(v) if v is not None else [math.nan, math.nan] for v in values]
        with contextlib.suppress(RuntimeError, dist.DistError):  # read once: the store does not keep every epoch's
            for k in keys:
                store.delete_key(k)
    out = []
    for mem, read in rows:
        entry = {"peak_mem_mb": mem}
        if not math.isnan(read):
            entry["data_mb_read"] = read
        out.append(entry)
    return out
