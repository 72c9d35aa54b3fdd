"""DCP plumbing of meshwise's saves: the file writer carrying the commit (a save costs DCP's own collectives and
no others), a plan cache per checkpointer, and the staging copy of an async save.

Rank 0 prepares ``step-N.tmp/`` between DCP's gather of the plans and their scatter (so no rank writes before it
exists, and nothing is written into a refused root); each rank writes its small files beside its shards and sends
its report with its write results; rank 0 checks the reports, writes DCP's ``.metadata`` and publishes the folder
in DCP's finish step, whose outcome DCP broadcasts to every rank.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from meshwise.checkpoint.state import write_files
from meshwise.errors import CheckpointError, MeshwiseError

__all__ = ["REPORT", "CommitWriter", "cached_planner", "drop_plans", "failure_text", "plan_key", "stage"]

REPORT = "__meshwise_report__"  # the write result that carries a rank's report; never reaches .metadata


class CommitWriter(FileSystemWriter):
    """A ``FileSystemWriter`` into ``tmp`` that runs meshwise's protocol inside DCP's steps (see the module doc).

    ``prepare`` (rank 0, or None when already done) makes the folder; ``files`` are this rank's small files (path →
    object for ``torch.save``); ``report`` is this rank's ``{"error", "digests"}``; ``publish(reports)`` (rank 0)
    commits once every rank's files are written.
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
    ) -> None:
        super().__init__(str(tmp), sync_files=sync_files)
        self.tmp = tmp
        self._prepare, self._files, self._report, self._publish = prepare, files, report, publish

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


_keys = itertools.count()
_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


def plan_key() -> str:
    """A key of DCP's plan cache of one's own (DCP's default key is the planner's class name, shared by all)."""
    return f"meshwise-checkpointer-{next(_keys)}"


def cached_planner(key: str) -> DefaultSavePlanner:
    """DCP's default save planner with plan caching under ``key``: a save of the same layout as the last one skips
    planning (DCP compares each rank's plan with its cached one and only sends what changed)."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = key  # a cache per checkpointer: never a plan of another mesh or process group
    return planner


def drop_plans(key: str) -> None:
    """Forget the plans cached under ``key`` (DCP keeps them in class attributes of ``SavePlanner``)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in _CACHES:
        getattr(SavePlanner, name, {}).pop(key, None)


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
