"""Refuse imports of another module's private names inside ``src/meshwise`` (run by ``make lint``).

import-linter checks the layers and the circles (pyproject.toml) but not names: this script reads every module
and fails on ``from meshwise.x import _name`` (or ``import meshwise.x._y``) in any other module, so that what two
modules share is a public name in the lower one (docs/layout.md, "Shared means public"). Other packages'
private names go through ``meshwise/compat.py``, which is the one module allowed to import them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

__all__ = ["private_imports"]


def private_imports(root: Path) -> list[str]:
    """``path:line: from module import _name`` for every private meshwise name imported across files."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("meshwise"):
                parts = node.module.split(".")
                names = [a.name for a in node.names]
                bad = [n for n in names if n.startswith("_") and not n.startswith("__")]
                bad += [node.module] if any(p.startswith("_") and not p.startswith("__") for p in parts) else []
            elif isinstance(node, ast.Import):
                bad = [
                    a.name
                    for a in node.names
                    if a.name.startswith("meshwise")
                    and any(p.startswith("_") and not p.startswith("__") for p in a.name.split("."))
                ]
            else:
                continue
            found += [f"{path}:{node.lineno}: imports the private {name}" for name in bad]
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "src/meshwise")
    found = private_imports(root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} private name(s) imported across files: make them public in the lower module")
        return 1
    print(f"no private meshwise name imported across files under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
