"""The front object of checkpoints: save, async save and load of a whole training state on every rank.

:class:`Checkpointer` runs the collectives around the on-disk protocol (``protocol``), what is saved
(``state``) and the checks before a load (``validation``): rank 0 decides, every rank hears its answer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshwise import dryrun
from meshwise.checkpoint.objects import (
    apply_dcp_state,
    check_options,
    classify,
    dcp_state,
    optimizer_owners,
    score_value,
)
from meshwise.checkpoint.protocol import OBJECTS_DIR, RNG_DIR, CheckpointFolder, entry_name
from meshwise.checkpoint.record import mesh_text, record, reshard_message
from meshwise.checkpoint.rng import read_rng, rederive_rng, set_rng_state
from meshwise.checkpoint.safe import SafeLoadPlanner, SafeReader
from meshwise.checkpoint.small_state import holds_tensors, load_object, small_files, warn_differences
from meshwise.checkpoint.validation import check_keys, find_and_read, locate_and_read
from meshwise.checkpoint.writer import (
    CommitWriter,
    RecordingPlanner,
    SavedPlans,
    StagingGate,
    failure_text,
    finish_stage,
    replay_save,
    stage,
    step_storages,
)
from meshwise.dryrun import note_checkpoint
from meshwise.errors import CheckpointError, MeshwiseError
from meshwise.topology import Topology, resolve

__all__ = ["CheckpointInfo", "Checkpointer"]

_log = logging.getLogger("meshwise.checkpoint")


@dataclass
class CheckpointInfo:
    """What :meth:`Checkpointer.load` restored, and how."""

    step: int
    path: str
    metadata: dict[str, Any]
    objects: list[str]
    resharded: bool  # saved at another mesh (dims or sizes): DCP resharded model and optimizer
    saved_mesh: dict[str, int]
    mesh: dict[str, int]
    rng: str  # "restored", "re-derived" or "not restored"
    message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Checkpointer:
    """Save and load a whole training state on every rank of a topology; see docs/checkpoint.md.

    ``root`` holds ``step-N/`` folders, a ``latest`` pointer and a marker file. ``keep_last`` keeps the
    N most recent checkpoints, ``keep_best`` the N best by ``score`` (a metric name looked up in the
    ``state.metrics`` of an ignite Engine passed to :meth:`save`, or a callable returning a float;
    ``mode="max"`` or ``"min"``); the newest and the best checkpoint are never deleted. With
    ``async_save=True`` files are written in a background thread (DCP async save on a dedicated gloo
    group); the checkpoint is renamed into place and ``latest`` moved by that thread once every rank
    finished, and the next :meth:`save`, :meth:`load`, :meth:`wait` or :meth:`close` waits for it. The copy of the
    saved optimizers' parameters and state is staged by that thread too, and their next ``step()`` waits for it
    (:meth:`wait_staged`); ``async_save="stage-first"`` copies everything before :meth:`save` returns.
    ``rng_seed`` seeds the RNG streams re-derived when a checkpoint is loaded at another mesh. Loads read the files as
    data and never run code from them; ``trust=True`` (here for every load, or per :meth:`load`) also loads what
    only full pickle can (a state holding objects of its own): docs/checkpoint.md, "Security". ``folder`` is
    the :class:`~meshwise.checkpoint.protocol.CheckpointFolder` of ``root``. Rank 0
    logs what each load restored to the ``meshwise.checkpoint`` logger, at INFO (DEBUG with ``verbose=False``).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        topology: Topology | None = None,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        score: str | Callable[[], float] | None = None,
        mode: str = "max",
        async_save: bool | str = False,
        rng_seed: int = 0,
        verbose: bool = True,
        trust: bool = False,
    ) -> None:
        topo = resolve(topology)
        check_options(keep_last, keep_best, score, mode, async_save)
        self.root = Path(root)
        self.topology = topo
        self._check_same_root()
        # the on-disk protocol of root (layout, commit, retention); public for tools that wait on its deletions
        self.folder = CheckpointFolder(self.root, keep_last=keep_last, keep_best=keep_best, mode=mode)
        self.score = score
        self.async_save = bool(async_save)
        self._stage_first = async_save == "stage-first"
        self._gate = StagingGate()  # holds the saved optimizers' next step() while their tensors are staged
        self.rng_seed = int(rng_seed)
        self.verbose = verbose
        self.trust = bool(trust)
        self._pending: Future | None = None
        self._pending_error: BaseException | None = None
        self._last_saved: int | None = None
        self._group = None
        self._worker: ThreadPoolExecutor | None = None
        self._buffers: dict[tuple, Any] = {}  # async staging buffers, kept from save to save
        self._plans: SavedPlans | None = None  # what the last full save planned: later saves replay it
        self._objects: dict[str, tuple[str, bytes]] = {}  # serialised plain values, reused while unchanged
        self._root_checked = False  # rank 0 accepted root once: later async saves prepare in the background
        if self.async_save and dist.is_initialized() and dryrun.active() is None:  # no gloo group on "fake"
            # DCP's background thread runs collectives; a group of its own keeps them apart from training's.
            # The timeout is explicit: a new group does not inherit it (docs/torch.md, "Timeouts and new groups").
            self._group = dist.new_group(backend="gloo", timeout=topo.timeout)

    def _check_same_root(self) -> None:
        # One checkpoint is written by every rank together: a per-rank path (a tempfile, a rank in the name)
        # would leave shards and commit markers in folders no rank could ever load from.
        if self.topology.world_size <= 1:
            return
        roots: list[Any] = [None] * self.topology.world_size
        dist.all_gather_object(roots, str(self.root.absolute()))
        if len(set(roots)) > 1:
            listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(roots))
            raise CheckpointError(
                f"the Checkpointer root differs between ranks ({listing}): pass the same path on every rank "
                "(on several nodes, a shared file system)"
            )

    @property
    def keep_last(self) -> int | None:
        return self.folder.keep_last

    @property
    def keep_best(self) -> int | None:
        return self.folder.keep_best

    @property
    def mode(self) -> str:
        return self.folder.mode

    @property
    def last_saved_step(self) -> int | None:
        """The step of this Checkpointer's last :meth:`save` or :meth:`load`; None before either."""
        return self._last_saved

    # ------------------------------------------------------------------ collectives

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 and give every rank its result; an error there is raised on every rank."""
        result: list[Any] = [None]
        planned = dryrun.active() is not None  # a dry run's fake group sends nothing: this rank answers for itself
        if self.topology.rank == 0 or planned:
            try:
                self._join()
                error = self.folder.take_error()
                if error is not None:
                    raise error
                result = [("ok", fn())]
            except MeshwiseError as exc:
                result = [("error", type(exc).__name__, str(exc))]
            except Exception as exc:  # noqa: BLE001 - must reach the other ranks or they hang
                result = [("error", "CheckpointError", f"{type(exc).__name__}: {exc}")]
        if self.topology.world_size > 1 and not planned:
            dist.broadcast_object_list(result, src=0)
        out = result[0]
        if out[0] == "error":
            raise CheckpointError(out[2])
        return out[1]

    def _agree(self, error: str | None, what: str) -> None:
        """Every rank reports its own error (or None); if any failed, every rank raises."""
        errors = [error]
        if self.topology.world_size > 1:
            errors = [None] * self.topology.world_size
            dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            text = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise CheckpointError(f"{what} failed on {len(failed)} rank(s): {text}")

    # ------------------------------------------------------------------ folder layout

    def step_path(self, step: int) -> Path:
        """The folder of the committed checkpoint of ``step``."""
        return self.folder.step_path(step)

    def latest_step(self) -> int | None:
        """Step of the checkpoint ``latest`` points at, or None when there is none yet (call on all ranks); None in
        a dry run, which reads no checkpoint folder, whatever ``root`` holds (docs/dryrun.md)."""
        if dryrun.active() is not None:
            return None
        self.wait()
        return self._on_rank0(self.folder.read_latest)

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints under ``root`` (read locally, no collective); none in a dry run."""
        return [] if dryrun.active() is not None else self.folder.steps()

    # ------------------------------------------------------------------ save

    def save(self, step: int, **objects: Any) -> Path:
        """Save ``objects`` as checkpoint ``step`` on every rank; returns the final folder ``root/step-N``.

        nn.Module and Optimizer objects go through DCP (each rank writes its shards); every other object's
        ``state_dict()`` is written by rank 0 (it must be the same on every rank: a warning names any that
        differ); each rank's RNG states are written too. With ``async_save`` the call returns once the state
        is staged in memory, and the folder appears when the background write completed on every rank.
        """
        self.wait()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        kinds = classify(objects)
        owners = optimizer_owners(objects, kinds)
        started = time.time()
        fresh = {n for n, k in kinds.items() if k == "optimizer" and not objects[n].state}
        use_dcp = any(k in ("module", "optimizer") and n not in fresh for n, k in kinds.items())
        error, score, small = None, None, {}
        try:  # reported at the commit, so that no rank is left waiting in a collective
            small = {n: objects[n].state_dict() for n, k in kinds.items() if k == "state"}
            score = score_value(self.score, objects) if self.topology.rank == 0 else None
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        meta = record(
            self.topology, step, started, kinds, owners, fresh, score, use_dcp, self._score_name, self.rng_seed
        )
        state = dcp_state(objects, kinds, owners, skip=fresh)
        optimizers = [objects[n] for n, k in kinds.items() if k == "optimizer"]
        self._write(step, state, small, meta, rng=True, error=error, optimizers=optimizers)
        self._last_saved = step
        return self.step_path(step)

    def save_states(self, name: str, states: Mapping[str, Any], info: Mapping[str, Any] | None = None) -> Path:
        """Save plain state dicts (as ignite's ``Checkpoint`` builds them) as the checkpoint folder ``root/name``.

        Each state dict holding a tensor goes through DCP (each rank writes its shards of DTensors; a plain
        tensor is written once); the others are rank 0's copy. No RNG states, no ``latest``, no retention: the
        caller keeps its own list (``folder.remove(name)``). ``info`` goes into the metadata record.
        """
        self.wait()
        entry_name(name)
        started = time.time()
        kinds = {n: ("tensors" if holds_tensors(sd) else "state") for n, sd in states.items()}
        tensors = {n: sd for n, sd in states.items() if kinds[n] == "tensors"}
        small = {n: sd for n, sd in states.items() if kinds[n] == "state"}
        meta = record(self.topology, name, started, kinds, {}, (), None, bool(tensors), None)
        meta["info"] = dict(info or {})
        self._write(name, tensors, small, meta, rng=False, error=None)
        return self.folder.entry_path(name)

    def _write(
        self,
        entry: int | str,
        state: dict[str, Any],
        small: dict[str, Any],
        meta: dict,
        *,
        rng: bool,
        error: Any,
        optimizers: Collection[torch.optim.Optimizer] = (),
    ) -> None:
        """Write ``state`` through DCP, ``small`` (rank 0) and the RNG states into ``entry``'s folder, atomically.

        The folder is prepared, the small files written and the checkpoint published inside DCP's own steps
        (:class:`~meshwise.checkpoint.writer.CommitWriter`): a save runs DCP's collectives and no others.
        """
        if note_checkpoint(self.root, entry, self.topology.rank, state, small):
            return  # a dry run records what this rank would write, and writes nothing (meshwise.dryrun)
        tmp = self.folder.tmp_path(entry)
        background = self.async_save and bool(state)
        prepare: Callable[[], None] | None = lambda: self._prepare(entry)  # noqa: E731
        if background and not self._root_checked:  # a refused root is refused by save() itself, not later
            self._on_rank0(prepare)
            prepare = None
        self._root_checked = True
        report, files = small_files(tmp, small, rng, error, self.topology, self.async_save)
        writer = CommitWriter(
            tmp,
            sync_files=background,  # a sync save leaves the fsync to rank 0's finalizer thread
            prepare=prepare,
            files=files,
            report=report,
            publish=lambda reports: self._publish(entry, tmp, meta, reports, defer=not background),
            check=self._check_last,
        )
        if background:
            self._start_async(entry, tmp, state, writer, optimizers)
        else:
            self._save_now(entry, tmp, state, writer)

    def _dcp_save(self, state: dict[str, Any], writer: CommitWriter, group: Any) -> None:
        """Replay the last full save's plans when no rank's layout changed, else a full ``dcp.save`` (recorded)."""
        import torch.distributed.checkpoint as dcp

        world = self.topology.world_size
        if self._plans is not None and replay_save(state, writer, self._plans, self._objects, group, world):
            return
        planner, self._plans = RecordingPlanner(self._objects), None
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
        self._plans = planner.planned

    def _prepare(self, entry: int | str) -> None:
        """Rank 0, inside DCP's planning: raise a deferred error of the last save, then make the empty folder.

        save() already waited for this rank's background work; the finalizer is joined again for a direct caller.
        """
        self._check_last()
        self.folder.prepare(entry, (OBJECTS_DIR, RNG_DIR))

    def _check_last(self) -> None:
        """Rank 0: raise the error rank 0's finalizer had with the last save (so every rank hears it)."""
        self.folder.join()
        error = self.folder.take_error()
        if error is not None:
            raise error

    def _publish(self, entry: int | str, tmp: Path, meta: dict[str, Any], reports: list[dict], *, defer: bool) -> None:
        """Rank 0, once every rank wrote its files: the record, the rename, then ``latest`` (maybe deferred)."""
        warn_differences(reports)
        self.folder.publish(entry, tmp, json.dumps(meta, indent=1) + "\n", defer=defer)

    @property
    def _score_name(self) -> str | None:
        return self.score if isinstance(self.score, str) else None

    def _save_now(self, step: int | str, tmp: Path, state: dict[str, Any], writer: CommitWriter) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            self._dcp_save(state, writer, None)
        except (Exception, dcp.CheckpointException) as exc:  # DCP's is a BaseException
            raise CheckpointError(
                f"saving checkpoint {step} into {tmp} failed: {failure_text(exc)}. 'latest' is untouched"
            ) from exc

    def _start_async(
        self, step: int | str, tmp: Path, state: dict[str, Any], writer: CommitWriter, optimizers: list
    ) -> None:
        # A copy: training may change the tensors once save() returns. What only the optimizers' step() changes
        # (their parameters and state) is copied by the worker, their next step() waiting for it (the gate).
        defer = step_storages(optimizers) if optimizers and not self._stage_first else ()
        try:
            staged, copies = stage(state, self._buffers, defer=defer)
        except Exception as exc:
            raise CheckpointError(f"async save of {tmp} failed staging: {exc}. 'latest' is untouched") from exc
        if self._worker is None:  # one thread for every save: none is started per save
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshwise-ckpt")
        if copies:
            self._gate.hold(optimizers)
        try:
            self._pending = self._worker.submit(self._write_async, step, tmp, staged, writer, copies)
        except BaseException:
            self._gate.release()
            raise

    def _write_async(
        self, step: int | str, tmp: Path, staged: dict[str, Any], writer: CommitWriter, copies: list
    ) -> None:
        try:
            finish_stage(copies)
        except Exception as exc:  # noqa: BLE001 - every rank still runs DCP's collectives, and the commit fails
            writer.fail(f"staging failed: {type(exc).__name__}: {exc}")
        finally:
            self._gate.release()
        try:  # DCP writes, syncs and (rank 0, in its finish step) publishes the folder
            self._dcp_save(staged, writer, self._group)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread at the next wait()
            self._pending_error = CheckpointError(
                f"async save of checkpoint {step} into {tmp} failed: {failure_text(exc)}. 'latest' is untouched"
            )

    # ------------------------------------------------------------------ waiting

    def _join(self) -> None:
        """Wait for this rank's background work of the previous save (async write, or rank 0's finalizer)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # _write_async keeps its error for wait()
        self.folder.join()

    def wait_staged(self) -> None:
        """Wait until a pending async save has copied the tensors it saves (its write may still run).

        The saved optimizers' ``step()`` waits for this by itself; call it before changing their parameters or
        state in any other way (an EMA update in place, ``load_state_dict``, a manual edit) right after a save.
        """
        self._gate.wait()

    def wait(self) -> None:
        """Wait for a pending async save to be written and committed; raises its error, if any.

        Rank 0's error of a deferred ``latest`` update is raised on every rank by the next save/load/close.
        """
        self._join()
        error, self._pending_error = self._pending_error, None
        if error is not None:
            if isinstance(error, MeshwiseError):
                raise error
            raise CheckpointError(f"async checkpoint failed: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Wait for a pending async save (and old folders being deleted); call before ``meshwise.shutdown()``."""
        self.wait()
        self._on_rank0(lambda: None)  # raises, on every rank, an error rank 0 had finishing the last save
        self.folder.join_deletions()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        self._gate.close()  # no step() of the saved optimizers is hooked any longer
        self._buffers.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()

    # ------------------------------------------------------------------ load

    def load(
        self, step: int | str = "latest", *, restore_rng: bool = True, trust: bool | None = None, **objects: Any
    ) -> CheckpointInfo:
        """Load checkpoint ``step`` (an int or ``"latest"``) into ``objects`` on every rank.

        Files and keys are checked before anything is loaded; a mismatch raises :class:`CheckpointError`
        naming the file. At the mesh it was saved at, each rank's RNG states are restored; at another mesh
        DCP reshards model and optimizer and the RNG streams are re-derived from ``rng_seed``, the step and
        the data rank (ranks holding the same samples share a stream). Rank 0 logs what was resharded.
        Objects other than modules and optimizers get their saved ``state_dict()`` through ``load_state_dict``.
        Nothing in the files runs: a file that only full pickle reads (an object's state holding objects of its own)
        raises a :class:`CheckpointError` naming it, unless ``trust=True`` (default: the constructor's ``trust``).
        A dry run reads nothing: the objects keep their state, and the info says so (docs/dryrun.md).
        """
        self.wait()
        kinds = classify(objects)
        if dryrun.active() is not None:
            return self._dry_load(step, kinds)
        owners = optimizer_owners(objects, kinds)
        trust = self.trust if trust is None else bool(trust)
        number, path_text, meta, states = self._on_rank0(lambda: find_and_read(self.folder, step, kinds, trust))
        path = Path(path_text)
        saved_mesh = dict(zip(meta["mesh"]["dims"], meta["mesh"]["sizes"]))
        mesh = dict(self.topology.sizes)
        same_mesh = saved_mesh == mesh and meta.get("world_size") == self.topology.world_size
        saved_rng = self._read_rng(path, trust) if restore_rng and same_mesh else None  # read before any load
        dcp_names = self._load_dcp(path, meta, objects, kinds, owners, trust)
        for name, kind in kinds.items():
            if kind == "state":
                load_object(name, objects[name], states[name][1], states[name][0])
        rng = "not restored"
        if saved_rng is not None:
            set_rng_state(saved_rng, self.topology.device)
            rng = "restored"
        elif restore_rng:  # RNG states cannot move to another mesh: each data rank's stream is re-derived
            rederive_rng(int(meta.get("rng_seed", self.rng_seed)), number, self.topology.data_rank)
            rng = "re-derived"
        if same_mesh:
            message = (
                f"meshwise checkpoint: loaded step-{number} from {self.root} at the mesh it was saved at "
                f"({mesh_text(mesh)})"
            )
        else:
            message = reshard_message(self.root, self.topology, number, meta, dcp_names, kinds, rng)
        if self.topology.rank == 0:
            _log.log(logging.INFO if self.verbose else logging.DEBUG, message)
        self._last_saved = number
        return CheckpointInfo(
            step=number,
            path=str(path),
            metadata=meta,
            objects=list(kinds),
            resharded=not same_mesh,
            saved_mesh=saved_mesh,
            mesh=mesh,
            rng=rng,
            message=message,
        )

    def _dry_load(self, step: int | str, kinds: Mapping[str, str]) -> CheckpointInfo:
        """What :meth:`load` answers in a dry run: nothing read from ``root``, every object as it was."""
        mesh, text = dict(self.topology.sizes), f"dry run: checkpoint {step!r} of {self.root} not read"
        dryrun.note_load(self.root, step, list(kinds))
        return CheckpointInfo(0, str(self.root), {}, list(kinds), False, mesh, mesh, "not restored", text)

    def _read_dcp(self, path: Path, state: dict[str, Any], trust: bool) -> None:
        """Check ``state``'s keys and global shapes against ``path`` and read its byte values as data (rank 0; each
        rank on a pipeline), then read it in place, resharded; nothing in the files runs unless ``trust``."""
        decoded: dict[bytes, Any] = {}  # byte values the check read: the load takes them from here
        if self.topology.size(self.topology.stage_dims) > 1:  # each stage holds its part of the model: each checks
            try:
                check_keys(path, state, allow_extra=True, trust=trust, decoded=decoded)
                self._agree(None, "checking the checkpoint's keys")
            except CheckpointError as exc:
                self._agree(str(exc), "checking the checkpoint's keys")
        else:
            self._on_rank0(lambda: check_keys(path, state, trust=trust, decoded=decoded))
        import torch.distributed.checkpoint as dcp

        reader, planner = SafeReader(path, trust), SafeLoadPlanner(path, trust, decoded)
        try:
            dcp.load(state, storage_reader=reader, planner=planner)
        except (Exception, dcp.CheckpointException) as exc:  # DCP's is a BaseException
            raise CheckpointError(f"reading {path} failed: {failure_text(exc)}") from exc

    def load_states(
        self, entry: int | str | os.PathLike, targets: Mapping[str, Any], *, trust: bool | None = None
    ) -> dict[str, Any]:
        """Read the state dicts named in ``targets`` from a checkpoint of :meth:`save_states` or :meth:`save`.

        ``entry``: a step, ``"latest"``, a name under ``root`` or a checkpoint folder's path. ``targets`` maps each
        name to a state dict to fill in place (its tensors read through DCP, resharded to the tensors' placements:
        pass the live objects' ``state_dict()``); a name saved without tensors gets rank 0's saved copy instead.
        Returns name → state dict. Everything is checked (rank 0) before anything is read. Call on all ranks.
        Nothing in the files runs; ``trust=True`` (default: the constructor's) also loads what only full pickle can.
        """
        self.wait()
        trust = self.trust if trust is None else bool(trust)
        path_text, meta, states = self._on_rank0(lambda: locate_and_read(self.folder, entry, list(targets), trust))
        path = Path(path_text)
        kinds = {n: meta["objects"][n]["kind"] for n in targets}
        out = {n: targets[n] for n in targets if kinds[n] != "state"}
        if out:
            self._read_dcp(path, out, trust)
        out.update({n: state for n, (_, state) in states.items()})
        return {n: out[n] for n in targets}

    def _load_dcp(
        self,
        path: Path,
        meta: Mapping[str, Any],
        objects: Mapping[str, Any],
        kinds: Mapping[str, str],
        owners: Mapping[str, str],
        trust: bool,
    ) -> list[str]:
        """Load the modules and optimizers through DCP (resharding them); returns their names."""
        saved_fresh = {n for n in kinds if kinds[n] == "optimizer" and meta["objects"][n].get("fresh")}
        names = [n for n, k in kinds.items() if k in ("module", "optimizer") and n not in saved_fresh]
        if names:
            was_empty = {n for n in names if kinds[n] == "optimizer" and not objects[n].state}
            state = dcp_state(objects, kinds, owners, skip=set(kinds) - set(names))
            try:
                self._read_dcp(path, state, trust)
            except CheckpointError:
                for n in was_empty:
                    objects[n].state.clear()  # get_optimizer_state_dict initialised it; leave it as it was
                raise
            apply_dcp_state(objects, kinds, owners, names, state)
        for n in saved_fresh:
            objects[n].state.clear()  # saved before its first step: it had no state
        return names

    def _read_rng(self, path: Path, trust: bool) -> dict[str, Any] | None:
        """This rank's saved RNG states (as data); if any rank cannot read its file, every rank raises."""
        state, error = None, None
        try:
            state = read_rng(path, self.topology.rank, trust)
        except MeshwiseError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001
            error = f"{path / RNG_DIR}: {type(exc).__name__}: {exc}"
        self._agree(error, "reading the RNG states")
        return state
