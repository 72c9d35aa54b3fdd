"""The meshwise release: one constant that any layer (the checkpoint's metadata and its checks) reads without
importing the package root, which would load the layers above it."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
