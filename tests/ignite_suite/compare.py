"""Compare ignite's own test-suite run plainly and with meshwise's adoption (two JUnit XML reports).

Prints every test whose outcome differs and exits 1 when a difference is not one of meshwise's documented
refusals (``REFUSALS``: test ids whose failure under adoption is a ``MetricError`` meshwise raises on purpose,
listed in docs/ignite.md). Usage: ``python compare.py plain.xml meshwise.xml``.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter

# test id -> why meshwise refuses it (docs/ignite.md, "ignite's own test-suite under adoption")
REFUSALS: dict[str, str] = {}

_RANK = {"passed": 0, "skipped": 1, "failed": 2}


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """{test id: (worst outcome over the processes that ran it, first message)} of a JUnit XML report."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "")[:300]
        if name not in out or _RANK[outcome] > _RANK[out[name][0]]:
            out[name] = (outcome, message)
    return out


def main(plain_path: str, mesh_path: str) -> int:
    plain, mesh = outcomes(plain_path), outcomes(mesh_path)
    print("plain ignite:", dict(Counter(o for o, _ in plain.values())))
    print("with meshwise:", dict(Counter(o for o, _ in mesh.values())))
    bad = 0
    for name in sorted(set(plain) | set(mesh)):
        p, m = plain.get(name, ("absent", "")), mesh.get(name, ("absent", ""))
        if p[0] == m[0]:
            continue
        why = REFUSALS.get(name)
        documented = why is not None and m[0] == "failed" and "MetricError" in m[1]
        bad += not documented
        label = f"refused: {why}" if documented else "DIFFERENT"
        print(f"{label}: {name}: plain {p[0]}, with meshwise {m[0]} {m[1]}")
    print(f"{bad} undocumented difference(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
