"""Names a package loads on first use (PEP 562): the package's ``__getattr__``, built from a table, keeps its import
cheap (``import meshwise`` for the launcher; no torchmetrics for a rank that only trains)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, names: Mapping[str, str], submodules: Iterable[str] = ()) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names`` maps a name to the module that defines it, and each of
    ``submodules`` is imported when asked for."""
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        if name in subs:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
