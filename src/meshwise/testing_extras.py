"""Imported once by :func:`meshwise.testing.process_context`'s forkserver: the optional extras' heavy first imports
(``datasets``, ``transformers``' model base, PhysicsNeMo; about 0.9 s each on a 2-core machine), so that the ranks
forked from it do not each pay them. Each is skipped on any error: the forkserver itself skips only an
``ImportError``, and any other error of a broken install would stop it and every launch with it."""

from __future__ import annotations

import contextlib
import importlib

EXTRAS = ("datasets", "transformers.modeling_utils", "physicsnemo")

for _name in EXTRAS:
    with contextlib.suppress(Exception):
        importlib.import_module(_name)
