"""Checkpoints for any mesh: model and optimizer through torch DCP, plus any ``state_dict()`` object and RNG states.

``protocol`` is the on-disk layout and commit, ``validation`` the checks before a load, ``state`` what is saved,
``checkpointer`` the :class:`Checkpointer` that runs them on every rank, ``ignite_saver`` ignite's ``Checkpoint``
on the mesh (:class:`MeshSaver`, :func:`check_ignite_checkpoints`), ``export`` one plain ``state_dict`` file from
any checkpoint, ``hf_folder`` a Hugging Face folder (config.json + safetensors); see docs/checkpoint.md.
"""

from __future__ import annotations

from meshwise.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from meshwise.checkpoint.export import export
from meshwise.checkpoint.hf_folder import export_hf, load_hf
from meshwise.checkpoint.ignite_saver import MeshSaver, check_ignite_checkpoints

__all__ = ["CheckpointInfo", "Checkpointer", "MeshSaver", "check_ignite_checkpoints", "export", "export_hf", "load_hf"]
