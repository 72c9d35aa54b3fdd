"""Checkpoints for any mesh: model and optimizer through torch DCP, plus any ``state_dict()`` object and RNG states.

``protocol`` is the on-disk layout and commit, ``validation`` the checks before a load, ``state`` what is saved,
``checkpointer`` the :class:`Checkpointer` that runs them on every rank; see docs/checkpoint.md.
"""

from __future__ import annotations

from meshwise.checkpoint.checkpointer import Checkpointer, CheckpointInfo

__all__ = ["CheckpointInfo", "Checkpointer"]
