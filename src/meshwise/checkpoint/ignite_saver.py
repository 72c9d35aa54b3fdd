"""ignite's ``Checkpoint`` on the mesh: :class:`MeshSaver`, its save handler, writes meshwise's sharded, atomic,
reshardable checkpoints; :func:`check_ignite_checkpoints` stops ignite's ``DiskSaver`` from saving one rank's shards.

ignite keeps its habits (``n_saved``, ``score_function``, ``filename_prefix``, ``load_objects``); meshwise's
:class:`~meshwise.checkpoint.Checkpointer` does the writing and reading (``save_states``/``load_states``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from ignite.handlers.checkpoint import BaseSaveHandler
from torch import nn

from meshwise import compat
from meshwise.checkpoint.checkpointer import Checkpointer
from meshwise.checkpoint.objects import classify, optimizer_owners
from meshwise.checkpoint.protocol import META
from meshwise.errors import CheckpointError
from meshwise.topology import Topology, resolve

__all__ = ["MeshSaver", "check_ignite_checkpoints"]

SINGLE = "checkpoint"  # the name a lone object's state dict is kept under (ignite hands it over unwrapped)


class MeshSaver(BaseSaveHandler):
    """A save handler for ignite's ``Checkpoint``: each save is a meshwise checkpoint folder ``dirname/<filename>``.

    ``Checkpoint(to_save, MeshSaver(dirname, topo), n_saved=2, score_function=..., ...)``, attached as usual, on
    every rank. Every rank writes its shards (DCP); state without tensors (engine, scheduler) is rank 0's copy; the
    folder appears whole or not at all. ``remove`` (ignite's ``n_saved``) deletes a folder atomically. Resume with
    ``Checkpoint.load_objects(to_load, saver.load(filename, to_load))`` at any mesh. ``async_save=True`` writes in
    the background as :class:`Checkpointer` does (call :meth:`close` at the end). Loads never run code from the
    files; ``trust=True`` (here, or per :meth:`load`) also loads state only full pickle reads. See
    docs/checkpoint.md.
    """

    def __init__(
        self,
        dirname: str | os.PathLike,
        topology: Topology | None = None,
        *,
        async_save: bool = False,
        verbose: bool = True,
        trust: bool = False,
    ) -> None:
        self.dirname = Path(dirname)
        self.checkpointer = Checkpointer(dirname, topology, async_save=async_save, verbose=verbose, trust=trust)

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        """Save what ignite's ``Checkpoint`` built (the objects' state dicts) as the folder ``dirname/filename``."""
        single = not _is_mapping_of_objects(checkpoint, metadata)
        states = {SINGLE: checkpoint} if single else dict(checkpoint)
        info = {"ignite": {**{k: _plain(v) for k, v in (metadata or {}).items()}, "single": single}}
        self.checkpointer.save_states(filename, states, info)

    def remove(self, filename: str) -> None:
        """Delete the folder ``dirname/filename`` (ignite's ``n_saved``); a pending async save is waited for."""
        self.checkpointer.wait()
        if self.checkpointer.topology.rank == 0:
            self.checkpointer.folder.remove(filename)

    def load(self, filename: str | os.PathLike | None, to_load: Mapping[str, Any], *, trust: bool | None = None) -> Any:
        """The checkpoint ``filename`` as ignite's ``Checkpoint.load_objects(to_load, checkpoint=...)`` wants it.

        ``filename``: ignite's name (``handler.last_checkpoint``), a folder's path, or None for the newest folder
        under ``dirname``. Tensors are read through DCP into the objects' own state dicts, resharded to the current
        mesh (an optimizer without state first gets its state initialised, as DCP needs); ``load_objects`` then
        applies the rest. Call on every rank; raises :class:`CheckpointError` naming the problem before anything is
        read. ``trust``: as :meth:`Checkpointer.load_states` (default: this saver's).
        """
        entry = self._newest() if filename is None else filename
        if isinstance(entry, str) and ("/" in entry or os.sep in entry):
            entry = Path(entry)
        saved = self._peek(entry)
        single = bool(saved.get("info", {}).get("ignite", {}).get("single"))
        if single and len(to_load) != 1:
            raise CheckpointError(
                f"{entry} holds one object's state (ignite saved a single object): pass to_load with one object"
            )
        names = {SINGLE: next(iter(to_load))} if single else {n: n for n in to_load}
        kinds = {n: saved.get("objects", {}).get(n, {}).get("kind") for n in names}
        targets = {n: _target(to_load, names[n], kinds[n]) for n in names}
        states = self.checkpointer.load_states(entry, targets, trust=trust)
        return states[SINGLE] if single else states

    def _newest(self) -> str:
        """The folder under ``dirname`` saved last (by the time in its record)."""
        found = []
        if self.dirname.is_dir():
            for entry in self.dirname.iterdir():
                if entry.is_symlink():
                    continue  # never a folder of a save: not a candidate
                try:
                    found.append((json.loads((entry / META).read_text())["unix_time"], entry.name))
                except (OSError, ValueError, KeyError):
                    continue
        if not found:
            raise CheckpointError(f"no checkpoint under {self.dirname}: nothing was saved there yet")
        return max(found)[1]

    def _peek(self, entry: str | Path) -> dict[str, Any]:
        """The metadata record, read locally (best effort: ``load_states`` checks it properly on rank 0)."""
        path = entry if isinstance(entry, Path) else self.dirname / entry
        try:
            return json.loads((path / META).read_text())
        except (OSError, ValueError):
            return {}

    def wait(self) -> None:
        """Wait for a pending async save (and raise its error)."""
        self.checkpointer.wait()

    def close(self) -> None:
        """Wait for pending saves and deletions; call before ``meshwise.shutdown()``."""
        self.checkpointer.close()


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _is_mapping_of_objects(checkpoint: Mapping, metadata: Mapping | None) -> bool:
    """ignite names a save of several objects "checkpoint" and hands one object's state dict over unwrapped."""
    basename = str((metadata or {}).get("basename", "checkpoint"))
    several = basename == "checkpoint" or basename.endswith("_checkpoint")
    return several and all(isinstance(v, Mapping) for v in checkpoint.values())


def _unwrap(obj: Any) -> Any:
    if isinstance(obj, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return obj.module
    return obj


def _target(to_load: Mapping[str, Any], name: str, kind: str | None) -> Any:
    """The state dict DCP reads ``name`` into: the live object's own (its placements decide the resharding)."""
    obj = _unwrap(to_load[name])
    if kind != "tensors":
        return None  # rank 0's saved copy is read instead (or the name is missing: load_states says so)
    if isinstance(obj, torch.optim.Optimizer) and not obj.state:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        objects = {n: _unwrap(o) for n, o in to_load.items()}
        owners = optimizer_owners(objects, classify(objects))
        get_optimizer_state_dict(objects[owners[name]], obj)  # initialises the state DCP reads into
    return obj.state_dict()


# --------------------------------------------------------------------------- refusing ignite's DiskSaver


def _checkpoint_of(handler: Any) -> Any:
    """The ignite ``Checkpoint`` behind an attached handler (filtered events wrap it), or None."""
    from ignite.handlers.checkpoint import Checkpoint

    for _ in range(8):
        if isinstance(handler, Checkpoint):
            return handler
        if isinstance(getattr(handler, "__self__", None), Checkpoint):
            return handler.__self__
        if isinstance(handler, functools.partial):
            handler = handler.func
        elif hasattr(handler, "__wrapped__"):
            handler = handler.__wrapped__
        else:
            return None
    return None


def _why_not_one_file(obj: Any, topo: Topology | None) -> str | None:
    """Why one rank's ``state_dict()`` of ``obj`` is not the whole state, or None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    obj = _unwrap(obj)
    if isinstance(obj, nn.Module):
        if any(isinstance(m, FSDPModule) for m in obj.modules()):
            return "FSDP2 shards its parameters over the data-parallel ranks"
        if any(isinstance(t, DTensor) for t in (*obj.parameters(), *obj.buffers())):
            return "its parameters are DTensors, each rank holds its own shard"
        stages = [d for d in (topo.stage_dims if topo else ()) if topo.sizes[d] > 1]
        if stages:
            return f"pipeline dim(s) {stages}: each stage's ranks hold other layers"
    if isinstance(obj, torch.optim.Optimizer):
        if any(isinstance(p, DTensor) for g in obj.param_groups for p in g["params"]):
            return "its state is sharded like its DTensor parameters"
    return None


def check_ignite_checkpoints(engine: Any, topology: Topology | None = None) -> None:
    """Raise :class:`CheckpointError` if ``engine`` has an ignite ``Checkpoint``/``ModelCheckpoint`` attached whose
    save handler is not :class:`MeshSaver` and whose objects hold sharded state (DTensor, FSDP2, pipeline stages).

    ignite's ``DiskSaver`` writes rank 0's ``state_dict()``: for such state that is one shard, and a resume would
    hand every rank rank 0's shard. Call it on every rank before the run saves anything (e.g. at ``STARTED``).
    """
    from ignite.handlers.checkpoint import ModelCheckpoint

    try:
        topo = resolve(topology)
    except Exception:  # noqa: BLE001 - no topology: the structural checks still apply
        topo = None
    for event, handler, args, _ in compat.event_handlers(engine):
        ckpt = _checkpoint_of(handler)
        if ckpt is None or isinstance(ckpt.save_handler, MeshSaver):
            continue
        objects = dict(ckpt.to_save or {})
        if isinstance(ckpt, ModelCheckpoint):
            objects.update(next((a for a in args if isinstance(a, Mapping)), {}))
        reasons = {n: r for n, o in objects.items() if (r := _why_not_one_file(o, topo))}
        if reasons:
            listing = "; ".join(f"{n}: {r}" for n, r in reasons.items())
            raise CheckpointError(
                f"ignite's {type(ckpt).__name__} on {event} with {type(ckpt.save_handler).__name__} would save "
                f"only rank 0's state_dict(), which is not the whole state ({listing}); a resume would give "
                "every rank rank 0's shard. Use meshwise's save handler: Checkpoint(to_save, "
                "meshwise.checkpoint.MeshSaver(dirname, topo), n_saved=..., score_function=...), and "
                "Checkpoint.load_objects(to_load, saver.load(filename, to_load)) to resume (docs/checkpoint.md)"
            )
