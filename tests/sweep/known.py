"""The sweep's open failures: (model type, mode) -> the diagnosis. Each is a family that trains differently from
one process (or fails with something other than a MeshwiseError) on that mesh today; `make test-sweep` reports
them, passes while they still fail, and fails on any failure not listed here or on a listed one that no longer
fails (remove it then), so the list only shrinks. docs/hf-sweep.md's table shows them as FAIL."""

from __future__ import annotations

KNOWN: dict[tuple[str, str], str] = {}
