"""DCP's file writer carrying meshwise's commit, so that a save costs DCP's own collectives and no others.

Rank 0 prepares ``step-N.tmp/`` between DCP's gather of the plans and their scatter (so no rank writes before it
exists, and nothing is written into a refused root); each rank writes its small files beside its shards and sends
its report with its write results; rank 0 checks the reports, writes DCP's ``.metadata`` and publishes the folder
in DCP's finish step, whose outcome DCP broadcasts to every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from meshwise.checkpoint.state import write_files
from meshwise.errors import CheckpointError, MeshwiseError

__all__ = ["REPORT", "CommitWriter", "failure_text"]

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
