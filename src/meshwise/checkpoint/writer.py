"""DCP plumbing of meshwise's saves: the file writer carrying the commit (a save costs DCP's own collectives and
no others), a plan cache per checkpointer, and the staging copy of an async save.

Rank 0 prepares ``step-N.tmp/`` between DCP's gather of the plans and their scatter (so no rank writes before it
exists, and nothing is written into a refused root); each rank writes its small files beside its shards and sends
its report with its write results; rank 0 checks the reports, writes DCP's ``.metadata`` and publishes the folder
in DCP's finish step, whose outcome DCP broadcasts to every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from meshwise.checkpoint.state import write_files
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
]

REPORT = "__meshwise_report__"  # the write result that carries a rank's report; never reaches .metadata


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
            report["error"] = write_files(self._files)
        results = list(super().write_data(plan, planner).wait())
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


# What one more item costs a rank's writer beside its bytes: each is its own torch.save (~0.1-0.3 ms), about the
# time the page cache takes to absorb 64 KiB.
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


def _into(tensor: torch.Tensor, buffers: dict[tuple, Any], key: tuple) -> torch.Tensor:
    buf = buffers.get(key)
    if not isinstance(buf, torch.Tensor) or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
        buf = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    buf.copy_(tensor)
    return buf


def _same_layout(a: DTensor, b: Any) -> bool:
    return (
        isinstance(b, DTensor)
        and a.device_mesh is b.device_mesh
        and a.placements == b.placements
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


@torch.no_grad()
def stage(state: Any, buffers: dict[tuple, Any], key: tuple = ()) -> Any:
    """A copy of a DCP state dict for a background save: each tensor copied into ``buffers``, kept from one save to
    the next (a DTensor's staged copy too, while its mesh and placements stay), so that staging is a copy and not an
    allocation; other values are deep-copied."""
    if isinstance(state, DTensor):
        staged = buffers.get(key)
        if not _same_layout(state, staged):
            local = torch.empty(state.to_local().shape, dtype=state.dtype, device="cpu")
            staged = buffers[key] = DTensor.from_local(
                local, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
            )
        staged.to_local().copy_(state.to_local())
        return staged
    if isinstance(state, torch.Tensor):
        return _into(state, buffers, key)
    if isinstance(state, Mapping):
        return {k: stage(v, buffers, (*key, k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(stage(v, buffers, (*key, i)) for i, v in enumerate(state))
    return copy.deepcopy(state)
