"""Checkpoints for any mesh: model and optimizer through torch DCP, plus any ``state_dict()`` object and RNG states.

``protocol`` is the on-disk layout and commit, ``validation`` the checks before a load, ``objects``, ``rng``,
``small_state`` and ``record`` what is saved, ``checkpointer`` the :class:`Checkpointer` that runs them on every
rank, ``ignite_saver`` ignite's ``Checkpoint`` on the mesh (:class:`MeshSaver`, :func:`check_ignite_checkpoints`),
``consolidated`` one model read whole in one process, ``export`` one plain ``state_dict`` file from any checkpoint;
``load_hf``/``export_hf`` (Hugging Face folders: config.json + safetensors) live in :mod:`meshwise.hf.folder` and
load from here on first use; see docs/checkpoint.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from meshwise.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from meshwise.checkpoint.export import export
from meshwise.checkpoint.ignite_saver import MeshSaver, check_ignite_checkpoints

__all__ = ["CheckpointInfo", "Checkpointer", "MeshSaver", "check_ignite_checkpoints", "export", "export_hf", "load_hf"]

# The Hugging Face integration sits above the checkpoint layer: its two names load it on first use.
_LAZY = {"export_hf": "meshwise.hf.folder", "load_hf": "meshwise.hf.folder"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshwise.checkpoint' has no attribute {name!r}")
