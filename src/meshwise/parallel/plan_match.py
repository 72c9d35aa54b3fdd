"""How a ``parallelize_module`` plan key (``blocks.*.attn.q``) selects submodules: atom by atom, each atom a
``fnmatch`` pattern. Shared by the tensor-parallel plan checks, FSDP unit names and pipeline stage plans.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

__all__ = ["module_matches", "name_matches"]


def module_matches(model: nn.Module, key: str) -> bool:
    """Whether a ``parallelize_module`` plan key resolves to a module (its matching is atom by atom)."""
    if key == "":
        return True
    atoms = key.split(".")
    for name, _ in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) == len(atoms) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms)):
            return True
    return False


def name_matches(name: str, pattern: str) -> bool:
    """Whether the module name ``name`` is one that plan key ``pattern`` selects."""
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms))
