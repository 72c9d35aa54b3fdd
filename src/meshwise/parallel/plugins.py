"""Registries of the objects integrations plug into this layer (attention routers, stage cutters), so that it
never imports them."""

from __future__ import annotations

import importlib
import sys
from typing import Generic, Protocol, TypeVar

from torch import nn


class _Claims(Protocol):
    def claims(self, model: nn.Module) -> bool: ...


T = TypeVar("T", bound=_Claims)


class Registry(Generic[T]):
    """Registered objects, asked in order of registration which one claims a model."""

    def __init__(self) -> None:
        self.items: list[T] = []

    def add(self, item: T) -> None:
        if item not in self.items:
            self.items.append(item)

    def claimant(self, model: nn.Module) -> T | None:
        """The first registered object that claims ``model``, or None."""
        if "transformers" in sys.modules:  # the model may be a transformers model: load that integration's objects
            importlib.import_module("meshwise.hf")
        return next((item for item in self.items if item.claims(model)), None)
