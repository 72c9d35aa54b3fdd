"""DCP plumbing of meshwise's saves: the file writer carrying the commit (a save costs DCP's own collectives and
no others), a plan cache per checkpointer, and the staging copy of an async save (with the gate that holds the
optimizer steps back while it runs).

Rank 0 prepares ``step-N.tmp/`` between DCP's gather of the plans and their scatter (so no rank writes before it
exists, and nothing is written into a refused root); each rank writes its small files beside its shards and sends
its report with its write results; rank 0 checks the reports, writes DCP's ``.metadata`` and publishes the folder
in DCP's finish step, whose outcome DCP broadcasts to every rank.

Each rank's shard file is written as DCP's ``FileSystemWriter`` lays it out, byte for byte, but without the zip CRC32
that ``torch.load`` never checks and without a ``torch.save`` per tensor (:func:`write_shard`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import threading
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from meshwise import compat
from meshwise.checkpoint.small_state import write_files
from meshwise.errors import CheckpointError, MeshwiseError

__all__ = [
    "REPORT",
    "CachingPlanner",
    "CommitWriter",
    "RecordingPlanner",
    "SavedPlans",
    "failure_text",
    "replay_save",
    "stage",
    "without_crc32",
    "write_shard",
]

REPORT = "__meshwise_report__"  # the write result that carries a rank's report; never reaches .metadata


_CRC_LOCK = threading.Lock()
_crc_users = 0  # writers inside without_crc32 now, in any thread
_crc_saved = True  # the option as it was before the first of them


@contextlib.contextmanager
def without_crc32() -> Iterator[None]:
    """``torch.save`` without the zip CRC32 of each record while the block runs (torch's public
    ``set_crc32_options``), restored when the last such block of any thread ends.

    ``torch.load`` (and so DCP's reader) never checks that CRC: computing it is a second pass over every byte, about
    as long as writing them into the page cache. The option is process-wide: another thread's ``torch.save`` during
    a checkpoint's shard write also skips it (its file loads the same; only zip tools would flag it).
    """
    global _crc_users, _crc_saved
    with _CRC_LOCK:
        if _crc_users == 0:
            _crc_saved = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _CRC_LOCK:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(_crc_saved)


SHARD_SUFFIX = compat.DCP_SHARD_SUFFIX

# The frame of a tensor's torch.save archive (the bytes before and after its storage's bytes) by the tensor's
# layout. Without the CRC32 (without_crc32) an archive is these bytes around the raw storage, whatever the values:
# each frame is proven so when made (two different contents, the same frame), and shared by every checkpointer.
_FRAMES: dict[tuple, tuple[bytes, bytes] | None] = {}


def _layout(tensor: torch.Tensor) -> tuple:
    size = tensor.untyped_storage().nbytes()
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), size)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s whole storage, as a uint8 tensor over the same memory (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def _archive(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def _make_frame(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The (head, tail) of ``tensor``'s archive, checked with two contents of its layout; None when the archive is
    not head + storage bytes + tail (then each save of such a tensor is a plain ``torch.save``)."""
    nbytes = tensor.untyped_storage().nbytes()
    probes = []
    for fill in (0xA5, 0x5A):
        raw = torch.full((nbytes,), fill, dtype=torch.uint8)
        probe = torch.empty(0, dtype=tensor.dtype)
        probe.set_(raw.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
        probes.append((_archive(probe), bytes(raw.numpy())))
    (first, raw_a), (second, raw_b) = probes
    at = first.find(raw_a)
    if at < 0 or len(first) != len(second) or second[at : at + nbytes] != raw_b:
        return None
    head, tail = first[:at], first[at + nbytes :]
    if second[:at] != head or second[at + nbytes :] != tail:
        return None
    return head, tail


def _framed(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout != torch.strided
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.__dict__  # attributes that torch.save pickles with the tensor
    ):
        return None  # its archive holds more than its layout and bytes: written with its own torch.save
    key = _layout(tensor)
    if key not in _FRAMES:
        if len(_FRAMES) > 4096:  # layouts of models no longer saved
            _FRAMES.clear()
        _FRAMES[key] = _make_frame(tensor)
    return _FRAMES[key]


def write_shard(writer: FileSystemWriter, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
    """Write this rank's items of ``plan`` into its one shard file, as DCP's ``FileSystemWriter`` lays it out (its
    byte items, then its tensors, each tensor a ``torch.save`` archive at its offset, without CRC32), and return the
    write results DCP's ``finish`` records.

    Each tensor is written as its archive's frame around its storage's bytes (:func:`_make_frame`): no ``torch.save``
    per tensor, three writes; the bytes are those ``torch.save`` writes. A writer with other options than meshwise's
    (several files or threads, stream extensions, safetensors), or a plan holding tensors on a device (a sync save
    on GPU), goes through DCP's own ``write_data``, still without CRC32.
    """
    default = (
        writer.single_file_per_rank
        and writer.thread_count == 1
        and not compat.dcp_stream_extensions(writer)
        and writer.serialization_format == SerializationFormat.TORCH_SAVE
    )
    tensors = {i.index: planner.resolve_data(i) for i in plan.items if i.type != WriteItemType.BYTE_IO}
    if not default or any(t.device.type != "cpu" for t in tensors.values()):
        # device tensors: DCP's writer overlaps their copies to the host with the writes
        with without_crc32():
            return list(FileSystemWriter.write_data(writer, plan, planner).wait())
    name = f"{compat.dcp_shard_prefix(plan)}0{SHARD_SUFFIX}"
    items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
    items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
    results = []
    with without_crc32(), open(Path(writer.path) / name, "wb") as stream:
        for item in items:
            offset = stream.tell()
            if item.type == WriteItemType.BYTE_IO:
                stream.write(planner.resolve_data(item).getbuffer())
            else:
                data = tensors[item.index]
                tensor = data.detach()  # as DCP's loader: a view of a larger storage is written alone
                if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                    tensor = tensor.clone()
                frame = _framed(tensor)
                if frame is None:
                    stream.write(_archive(tensor))
                else:
                    stream.write(frame[0])
                    stream.write(_raw(tensor).numpy())
                    stream.write(frame[1])
            length = stream.tell() - offset
            info = compat.dcp_storage_info(name, offset, length)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        if writer.sync_files:
            stream.flush()
            os.fsync(stream.fileno())
    return results


class CommitWriter(FileSystemWriter):
    """A ``FileSystemWriter`` into ``tmp`` that runs meshwise's protocol inside DCP's steps (see the module doc).

    ``prepare`` (rank 0, or None when already done) makes the folder; ``files`` are this rank's small files (path →
    object for ``torch.save``); ``report`` is this rank's ``{"error", "digests"}``; ``publish(reports)`` (rank 0)
    commits once every rank's files are written. ``check`` (rank 0) raises an error left by the last save; a
    replayed save (:func:`replay_save`) calls it and :meth:`make_folder` instead of ``prepare``.
    """

    def __init__(
        self,
        tmp: Path,
        *,
        sync_files: bool,
        prepare: Callable[[], None] | None,
        files: dict[Path, Any],
        report: dict[str, Any],
        publish: Callable[[list[dict[str, Any]]], None],
        check: Callable[[], None],
    ) -> None:
        super().__init__(str(tmp), sync_files=sync_files)
        self.tmp = tmp
        self._prepare, self._files, self._report, self._publish = prepare, files, report, publish
        self.check = check

    def make_folder(self) -> None:
        """Every rank, in a replayed save: the folder and its subfolders (the root was accepted by a full save)."""
        for sub in {p.parent for p in self._files} | {self.tmp}:
            sub.mkdir(parents=True, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # no mkdir here: the folder is rank 0's to make, once it has accepted the root

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._prepare is not None:
            self._prepare()
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        report = dict(self._report)
        if report["error"] is None:
            report["error"] = write_files(self._files, fsync=self.sync_files)  # an async save publishes at once
        results = write_shard(self, plan, planner)
        results.append(WriteResult(index=MetadataIndex(REPORT), size_in_bytes=0, storage_data=report))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        reports = [
            next((w.storage_data for w in ws if w.index.fqn == REPORT), {"error": "no report"}) for ws in results
        ]
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep.get("error")]
        if failed:
            text = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise CheckpointError(f"writing {self.tmp} failed on {len(failed)} rank(s): {text}")
        super().finish(metadata, [[w for w in ws if w.index.fqn != REPORT] for ws in results])
        self._publish(reports)

    def fail(self, error: str) -> None:
        """Report ``error`` at the commit (so that every rank raises it and nothing is published)."""
        self._report["error"] = self._report["error"] or error


def failure_text(exc: BaseException) -> str:
    """The text of a failed DCP save: each failing rank's own error (DCP wraps them with their tracebacks)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(exc).__name__}: {exc}"
    texts = {}
    for rank, wrapped in sorted(failures.items()):
        error = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        texts[rank] = str(error) if isinstance(error, MeshwiseError) else f"{type(error).__name__}: {error}"
    if len(set(texts.values())) == 1 and len(texts) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"rank {r}: {t}" for r, t in texts.items())


@dataclass
class SavedPlans:
    """What the last full DCP save of one checkpointer planned: this rank's local and final plan, the global
    metadata (rank 0). A save whose local plans all equal ``local`` can replay them without planning."""

    local: SavePlan | None = None
    final: SavePlan | None = None
    metadata: Metadata | None = None


_PLAIN = (int, float, bool, str, bytes, type(None))


def _plain_key(value: Any, depth: int = 0) -> str | None:
    """An exact text of ``value`` when it is made only of plain Python values (numbers, strings, None, and tuples
    or lists of them; exact types, not subclasses such as numpy's float64), whose ``repr`` tells types and values
    apart; None for anything else (never cached)."""
    if type(value) in _PLAIN:
        return repr(value)
    if type(value) in (tuple, list) and depth < 4:
        parts = [_plain_key(v, depth + 1) for v in value]
        if None not in parts:
            return f"{type(value).__name__}({', '.join(parts)})"  # type: ignore[arg-type]
    return None


class CachingPlanner(DefaultSavePlanner):
    """DCP's default save planner that keeps the serialised bytes of plain-valued objects from one save to the next.

    DCP writes each non-tensor value with its own ``torch.save`` (a zip archive of ~0.2 ms); an optimizer's
    hyperparameters, flattened per parameter, are ~12 such values per parameter and do not change between saves.
    ``objects`` (fqn → (exact text, bytes)) belongs to one checkpointer; the bytes are those ``torch.save`` wrote,
    so the checkpoint is the one DCP would write.
    """

    def __init__(self, objects: dict[str, tuple[str, bytes]]) -> None:
        super().__init__()
        self.objects = objects

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's own name
        key = _plain_key(object) if write_item.type == WriteItemType.BYTE_IO else None
        if key is None:
            return super().transform_object(write_item, object)
        fqn = write_item.index.fqn
        kept = self.objects.get(fqn)
        if kept is not None and kept[0] == key:
            return io.BytesIO(kept[1])
        data = super().transform_object(write_item, object)
        self.objects[fqn] = (key, data.getvalue())
        return data


# What one more item costs a rank beside its bytes, counted as 64 KiB of writing: its lookup, its writes (a tensor's
# frame, a value's kept bytes) and its write result in the gather. It was one torch.save (~0.1-0.3 ms) before
# write_shard; the balance is kept as it was, so that saved plans do not change.
ITEM_COST = 64 * 1024


def balance_replicated(plans: list[SavePlan]) -> list[SavePlan]:
    """Give each item that several ranks hold (replicated tensors, optimizer hyperparameters) to one of them, the
    least loaded (bytes plus :data:`ITEM_COST` an item) once every rank's own shards are counted; largest first.

    DCP's own deduplication counts as it goes, in rank order: the first ranks' shards are counted before the last
    rank's, so every replicated item lands on the last rank, which then writes ~100 more items than the others
    and makes every rank wait for it.
    """
    holders: dict[MetadataIndex, list[int]] = {}
    sizes: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            sizes[item.index] = (item.tensor_storage_size() or 0) + ITEM_COST
    load = [0] * len(plans)
    for index, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += sizes[index]
    keep: dict[MetadataIndex, int] = {}
    for index in sorted((i for i, r in holders.items() if len(r) > 1), key=lambda i: -sizes[i]):
        rank = min(holders[index], key=lambda r: (load[r], r))
        keep[index], load[rank] = rank, load[rank] + sizes[index]
    return [
        dataclasses.replace(plan, items=[i for i in plan.items if keep.get(i.index, rank) == rank])
        for rank, plan in enumerate(plans)
    ]


class RecordingPlanner(CachingPlanner):
    """The caching planner, with replicated items balanced across ranks, keeping what it planned in ``planned``
    (a :class:`SavedPlans`)."""

    def __init__(self, objects: dict[str, tuple[str, bytes]]) -> None:
        super().__init__(objects)
        self.planned = SavedPlans()

    def create_local_plan(self) -> SavePlan:
        self.planned.local = super().create_local_plan()
        return self.planned.local

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, self.planned.metadata = super().create_global_plan(balance_replicated(all_plans))
        return plans, self.planned.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.planned.final = super().finish_plan(new_plan)
        return self.planned.final


def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, MeshwiseError) else f"{type(exc).__name__}: {exc}"


def replay_save(
    state: dict[str, Any],
    writer: CommitWriter,
    plans: SavedPlans,
    objects: dict[str, tuple[str, bytes]],
    group: Any,
    world: int,
) -> bool:
    """Save ``state`` with the plans of the last full save, if no rank's layout changed: False when one did (nothing
    is committed; run a full ``dcp.save``, which plans again). ``objects``: the checkpointer's kept serialised
    values (:class:`CachingPlanner`). Raises :class:`CheckpointError` on every rank.

    Each rank writes with its cached final plan, then one gather brings every rank's write results and report to
    rank 0, which writes ``.metadata`` (the cached global metadata with this save's storage data) and publishes,
    and one broadcast of a code tells every rank the outcome: one gather and one broadcast instead of DCP's two
    gathers, its scatter and its broadcast of pickled objects.
    """
    coordinator = world == 1 or dist.get_rank(group) == 0
    planner = CachingPlanner(objects)
    try:
        planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=coordinator)
        if planner.create_local_plan() != plans.local:
            payload: tuple = ("changed",)
        else:
            if coordinator:
                writer.check()
            writer.make_folder()
            writer.set_up_storage_writer(coordinator, rank=dist.get_rank(group) if world > 1 else 0)
            payload = ("ok", writer.write_data(planner.finish_plan(plans.final), planner).wait())
    except Exception as exc:  # noqa: BLE001 - reaches rank 0 with the others' results
        payload = ("error", _error_text(exc))
    gathered: list[Any] | None = [None] * world if coordinator else None
    if world > 1:
        dist.gather_object(payload, gathered, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
    else:
        gathered = [payload]
    code, text = 0, ""
    if coordinator:
        errors = [f"rank {r}: {p[1]}" for r, p in enumerate(gathered) if p[0] == "error"]
        if errors:
            code, text = 2, "; ".join(errors)
        elif any(p[0] == "changed" for p in gathered):
            code = 1
        else:
            try:
                writer.finish(plans.metadata, [p[1] for p in gathered])
            except Exception as exc:  # noqa: BLE001
                code, text = 2, _error_text(exc)
    if world > 1:
        box = torch.tensor([code])
        dist.broadcast(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        code = int(box.item())
        if code == 2:  # only a failure pays for its text
            words = [text]
            dist.broadcast_object_list(words, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            text = words[0]
    if code == 2:
        raise CheckpointError(text)
    return code == 0


# what stage() defers (storage keys) and the (buffer, tensor) pairs it deferred; None: copy everything now
_Later = tuple[Collection[tuple[str, int]], list[tuple[torch.Tensor, torch.Tensor]]] | None


def _into(tensor: torch.Tensor, buffers: dict[tuple, Any], key: tuple, later: _Later) -> torch.Tensor:
    buf = buffers.get(key)
    if not isinstance(buf, torch.Tensor) or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
        buf = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    _copy(buf, tensor, later)
    return buf


def _copy(buf: torch.Tensor, tensor: torch.Tensor, later: _Later) -> None:
    if later is not None and storage_key(tensor) in later[0]:
        later[1].append((buf, tensor))  # only optimizer.step() changes it: copied in the background
    else:
        buf.copy_(tensor)


def _same_layout(a: DTensor, b: Any) -> bool:
    return (
        isinstance(b, DTensor)
        and a.device_mesh is b.device_mesh
        and a.placements == b.placements
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """What identifies the memory of a tensor (a DTensor's local shard): its device and storage address."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return str(local.device), local.untyped_storage().data_ptr()


@torch.no_grad()
def stage(
    state: Any, buffers: dict[tuple, Any], key: tuple = (), *, defer: Collection[tuple[str, int]] = ()
) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A copy of a DCP state dict for a background save: each tensor copied into ``buffers``, kept from one save to
    the next (a DTensor's staged copy too, while its mesh and placements stay), so that staging is a copy and not an
    allocation; other values are deep-copied.

    A tensor whose memory is in ``defer`` (:func:`storage_key`) gets its buffer but is not copied: it is in the
    returned list of ``(buffer, tensor)`` pairs, for :func:`finish_stage` to copy later (in the background).
    """
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    later = (defer, copies) if defer else None
    return _stage(state, buffers, key, later), copies  # no_grad entered once, not once per value


@torch.no_grad()
def finish_stage(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy the tensors :func:`stage` deferred into their buffers."""
    for buf, tensor in copies:
        buf.copy_(tensor)


def _stage(state: Any, buffers: dict[tuple, Any], key: tuple, later: _Later) -> Any:
    if isinstance(state, DTensor):
        staged = buffers.get(key)
        if not _same_layout(state, staged):
            local = torch.empty(state.to_local().shape, dtype=state.dtype, device="cpu")
            staged = buffers[key] = DTensor.from_local(
                local, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
            )
        _copy(staged.to_local(), state.to_local(), later)
        return staged
    if isinstance(state, torch.Tensor):
        return _into(state, buffers, key, later)
    if isinstance(state, Mapping):
        return {k: _stage(v, buffers, (*key, k), later) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_stage(v, buffers, (*key, i), later) for i, v in enumerate(state))
    return copy.deepcopy(state)


@torch.no_grad()  # DTensor.to_local() under grad mode runs an autograd Function: ~100x slower
def step_storages(optimizers: Collection[torch.optim.Optimizer]) -> set[tuple[str, int]]:
    """The memory (:func:`storage_key`) of the parameters and state tensors of ``optimizers``: what only their
    ``step()`` changes in a training loop."""
    keys: set[tuple[str, int]] = set()
    for opt in optimizers:
        tensors = [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        keys.update(storage_key(t) for t in tensors)
    return keys


class StagingGate:
    """Holds each optimizer's ``step()`` (a step pre-hook) while a background staging copy of its tensors runs."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()
        self._hooks: dict[int, tuple[weakref.ref, Any]] = {}  # id(optimizer) -> (its weakref, the hook's handle)

    def hold(self, optimizers: Collection[torch.optim.Optimizer]) -> None:
        """Make the next ``step()`` of each of ``optimizers`` wait until :meth:`release` (hooked once each)."""
        self._done.clear()
        for opt in optimizers:
            known = self._hooks.get(id(opt))
            if known is None or known[0]() is not opt:
                self._hooks[id(opt)] = (weakref.ref(opt), opt.register_step_pre_hook(self._before_step))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._done.wait()

    def release(self) -> None:
        self._done.set()

    def wait(self) -> None:
        """Return once no staging copy is running."""
        self._done.wait()

    def close(self) -> None:
        """Release and remove every hook."""
        self._done.set()
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
