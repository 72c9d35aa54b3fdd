"""Checkpoints for any mesh: model and optimizer through torch DCP, plus trainer, data cursor and RNG states.

Each save is written to ``step-N.tmp/`` and renamed to ``step-N/`` only after every rank finished, then ``latest``
moves; a load validates the files and the keys before touching anything and reshards through DCP.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from meshwise.errors import CheckpointError, MeshwiseError
from meshwise.topology import Topology, current

FORMAT = "meshwise-checkpoint"
FORMAT_VERSION = 1
MARKER = "meshwise-checkpoints.json"  # marks a folder as a checkpoint root
META = "meshwise.json"  # the metadata record of one checkpoint, written last
LATEST = "latest"
DCP_META = ".metadata"
OBJECTS_DIR = "objects"
RNG_DIR = "rng"

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-\d+(\.[A-Za-z0-9_-]+)?\.tmp$")

__all__ = ["Checkpointer", "CheckpointInfo"]


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


# --------------------------------------------------------------------------- small helpers


def _mesh_text(dims: Mapping[str, int]) -> str:
    return " x ".join(f"{d}={s}" for d, s in dims.items()) or "-"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, text: str, fsync: bool = True) -> None:
    """Write a small file so that readers see either the old or the new content, never a torn one."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


def _write_small(files: Mapping[Path, Any]) -> str | None:
    """Write the small per-rank files; the error as text (reported at the commit), or None."""
    try:
        for path, value in files.items():
            torch.save(value, path)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def _digest(state: Any) -> str | None:
    try:
        return hashlib.sha1(pickle.dumps(state, protocol=4)).hexdigest()
    except Exception:  # noqa: BLE001 - an unpicklable state is simply not checked
        return None


def _derived_seed(base: int, step: int, stream: int) -> int:
    digest = hashlib.sha256(f"meshwise-rng/{base}/{step}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _kind(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "state"
    return ""


def _reshard(model: nn.Module) -> None:
    """FSDP2 leaves the root's parameters unsharded after a forward without backward (an evaluation): the
    state dict must see the sharded ones."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _tensor_shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor):  # DTensor included: its shape is the global one
        return tuple(value.shape)
    return None


# --------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Save and load a whole training state on every rank of a topology; see docs/checkpoint.md.

    ``root`` holds ``step-N/`` folders, a ``latest`` pointer and a marker file. ``keep_last`` keeps the
    N most recent checkpoints, ``keep_best`` the N best by ``score`` (a metric name looked up in the
    ``state.metrics`` of an ignite Engine passed to :meth:`save`, or a callable returning a float;
    ``mode="max"`` or ``"min"``); the newest and the best checkpoint are never deleted. With
    ``async_save=True`` files are written in a background thread (DCP async save on a dedicated gloo
    group); the checkpoint is renamed into place and ``latest`` moved by that thread once every rank
    finished, and the next :meth:`save`, :meth:`load`, :meth:`wait` or :meth:`close` waits for it.
    ``rng_seed`` seeds the RNG streams re-derived when a checkpoint is loaded at another mesh.
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
        async_save: bool = False,
        rng_seed: int = 0,
        verbose: bool = True,
    ) -> None:
        topo = topology if topology is not None else current()
        if topo is None:
            raise CheckpointError("Checkpointer needs a topology: call meshwise.init() first or pass topology=")
        for name, value in (("keep_last", keep_last), ("keep_best", keep_best)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CheckpointError(f"{name} must be a positive int or None, got {value!r}")
        if keep_best is not None and score is None:
            raise CheckpointError("keep_best needs score=: a metric name (engine.state.metrics key) or a callable")
        if score is not None and not (isinstance(score, str) or callable(score)):
            raise CheckpointError(f"score must be a metric name or a callable returning a float, got {score!r}")
        if mode not in ("max", "min"):
            raise CheckpointError(f"mode must be 'max' (higher score is better) or 'min', got {mode!r}")
        self.root = Path(root)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # One checkpoint is written by every rank together: a per-rank path (a tempfile, a rank in the name)
            # would leave shards and commit markers in folders no rank could ever load from.
            roots: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(roots, str(self.root.absolute()))
            if len(set(roots)) > 1:
                listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(roots))
                raise CheckpointError(
                    f"the Checkpointer root differs between ranks ({listing}): pass the same path on every rank "
                    "(on several nodes, a shared file system)"
                )
        self.topology = topo
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.score = score
        self.mode = mode
        self.async_save = bool(async_save)
        self.rng_seed = int(rng_seed)
        self.verbose = verbose
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._pending_step: int | None = None
        self._last_saved: int | None = None
        self._group = None
        self._reapers: list[threading.Thread] = []
        self._finalizer: threading.Thread | None = None
        self._stager: Any = None
        self._finalize_error: BaseException | None = None
        self._trash_count = 0
        if self.async_save and dist.is_initialized():
            # DCP's background thread runs collectives; a group of its own keeps them apart from training's.
            self._group = dist.new_group(backend="gloo", timeout=topo.timeout)

    # ------------------------------------------------------------------ collectives

    @property
    def _world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 and give every rank its result; an error there is raised on every rank."""
        result: list[Any] = [None]
        if self._rank == 0:
            try:
                self._join()
                error, self._finalize_error = self._finalize_error, None
                if error is not None:
                    raise error
                result = [("ok", fn())]
            except MeshwiseError as exc:
                result = [("error", type(exc).__name__, str(exc))]
            except Exception as exc:  # noqa: BLE001 - must reach the other ranks or they hang
                result = [("error", "CheckpointError", f"{type(exc).__name__}: {exc}")]
        if self._world > 1:
            dist.broadcast_object_list(result, src=0)
        out = result[0]
        if out[0] == "error":
            raise CheckpointError(out[2])
        return out[1]

    def _agree(self, error: str | None, what: str) -> None:
        """Every rank reports its own error (or None); if any failed, every rank raises."""
        errors = [error]
        if self._world > 1:
            errors = [None] * self._world
            dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            text = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise CheckpointError(f"{what} failed on {len(failed)} rank(s): {text}")

    # ------------------------------------------------------------------ folder layout

    def step_path(self, step: int) -> Path:
        """The folder of the committed checkpoint of ``step``."""
        return self.root / f"step-{int(step)}"

    def _committed(self) -> dict[int, Path]:
        out = {}
        if self.root.is_dir():
            for entry in self.root.iterdir():
                m = _STEP_DIR.match(entry.name)
                if m and entry.is_dir() and (entry / META).is_file():
                    out[int(m.group(1))] = entry
        return dict(sorted(out.items()))

    def _check_root(self, for_save: bool) -> bool:
        """True when ``root`` is a checkpoint folder; False when it is missing or empty; raises otherwise."""
        root = self.root
        if not root.exists():
            return False
        if not root.is_dir():
            raise CheckpointError(f"checkpoint root {root} is a file, not a folder: pass a folder path")
        if (root / MARKER).is_file():
            return True
        entries = [e.name for e in root.iterdir()]
        if not entries:
            return False
        shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
        action = (
            "choose an empty or new folder for checkpoints" if for_save else "pass the folder a Checkpointer saved to"
        )
        raise CheckpointError(
            f"{root} is not a checkpoint folder: it has no {MARKER} and holds other files ({shown}); {action}. "
            "Nothing was written or deleted"
        )

    def _read_latest(self) -> int | None:
        if not self._check_root(for_save=False):
            return None
        path = self.root / LATEST
        if not path.is_file():
            return None
        text = path.read_text().strip()
        m = _STEP_DIR.match(text)
        if not m:
            raise CheckpointError(
                f"{path} holds {text!r}, not 'step-N': the pointer is damaged; load a step explicitly"
            )
        return int(m.group(1))

    def latest_step(self) -> int | None:
        """Step of the checkpoint ``latest`` points at, or None when there is none yet (call on all ranks)."""
        self.wait()
        return self._on_rank0(self._read_latest)

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints under ``root`` (read locally, no collective)."""
        return list(self._committed())

    # ------------------------------------------------------------------ objects

    def _classify(self, objects: Mapping[str, Any]) -> dict[str, str]:
        kinds = {}
        for name, obj in objects.items():
            kind = _kind(obj)
            if not kind:
                raise CheckpointError(
                    f"cannot checkpoint {name}={type(obj).__name__}: pass an nn.Module, an Optimizer, or an object "
                    "with state_dict() and load_state_dict() (wrap plain values in such an object)"
                )
            kinds[name] = kind
        return kinds

    def _owners(self, objects: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, str]:
        """For each optimizer, the name of the module whose parameters it holds."""
        modules = {n: {id(p) for p in objects[n].parameters()} for n, k in kinds.items() if k == "module"}
        owners = {}
        for name, kind in kinds.items():
            if kind != "optimizer":
                continue
            params = {id(p) for g in objects[name].param_groups for p in g["params"]}
            owner = next((m for m, ids in modules.items() if params <= ids), None)
            if owner is None:
                raise CheckpointError(
                    f"optimizer {name!r} holds parameters of no module passed with it: pass its model too, "
                    f"e.g. save(step, model=model, {name}={name})"
                )
            owners[name] = owner
        return owners

    def _dcp_state(
        self, objects: Mapping[str, Any], kinds: Mapping[str, str], owners: Mapping[str, str], skip: set[str]
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {}
        for name, kind in kinds.items():
            if name in skip:
                continue
            if kind == "module":
                _reshard(objects[name])
                state[name] = get_model_state_dict(objects[name])
            elif kind == "optimizer":
                state[name] = get_optimizer_state_dict(objects[owners[name]], objects[name])
        return state

    def _score_value(self, objects: Mapping[str, Any]) -> float | None:
        if self.score is None:
            return None
        if callable(self.score):
            value = self.score()
        else:
            value = None
            for obj in objects.values():
                metrics = getattr(getattr(obj, "state", None), "metrics", None)
                if isinstance(metrics, Mapping) and self.score in metrics:
                    value = metrics[self.score]
                    break
            if value is None:
                return None  # no score yet (e.g. before the first evaluation): not a candidate for best
        try:
            return float(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"score {self.score!r} gave {value!r}, not a number") from None

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
        kinds = self._classify(objects)
        owners = self._owners(objects, kinds)
        topo = self.topology
        tmp = self.root / f"step-{step}.tmp"
        started = time.time()

        def prepare() -> None:
            self._check_root(for_save=True)
            self.root.mkdir(parents=True, exist_ok=True)
            marker = self.root / MARKER
            if not marker.exists():
                _write_file(marker, json.dumps({"format": FORMAT, "version": FORMAT_VERSION}) + "\n")
            if tmp.exists():
                shutil.rmtree(tmp)  # a stale folder of a save of this step that crashed
            (tmp / OBJECTS_DIR).mkdir(parents=True)
            (tmp / RNG_DIR).mkdir()

        self._on_rank0(prepare)

        fresh = {n for n, k in kinds.items() if k == "optimizer" and not objects[n].state}
        meta_dcp = any(k in ("module", "optimizer") and n not in fresh for n, k in kinds.items())
        error = None
        digests: dict[str, str | None] = {}
        small: dict[Path, Any] = {}  # the small files; an async save writes them in its background thread
        score = None
        try:
            small[tmp / RNG_DIR / f"rank-{self._rank:05d}.pt"] = self._rng_state()
            for name, kind in kinds.items():
                if kind != "state":
                    continue
                sd = objects[name].state_dict()
                digests[name] = _digest(sd)
                if self._rank == 0:
                    small[tmp / OBJECTS_DIR / f"{name}.pt"] = copy.deepcopy(sd) if self.async_save else sd
            score = self._score_value(objects) if self._rank == 0 else None
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        if error is None and not (self.async_save and meta_dcp):
            error = _write_small(small)
            small = {}
        local = {"error": error, "digests": digests}  # reported at the commit, so async saves do not wait here

        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "time": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(),
            "unix_time": started,
            "mesh": {"dims": list(topo.dims), "sizes": [topo.sizes[d] for d in topo.dims], "roles": topo.roles},
            "world_size": topo.world_size,
            "backend": topo.backend,
            "torch": torch.__version__,
            "meshwise": _meshwise_version(),
            "objects": {
                n: {"kind": k, **({"module": owners[n], "fresh": n in fresh} if k == "optimizer" else {})}
                for n, k in kinds.items()
            },
            "score": score,
            "score_name": self.score if isinstance(self.score, str) else None,
            "rng_seed": self.rng_seed,
            "dcp": meta_dcp,
        }
        state = self._dcp_state(objects, kinds, owners, skip=fresh)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        if self.async_save and meta["dcp"]:
            try:
                if self._stager is None:
                    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                    # one stager for every save: it keeps its CPU buffers, so staging is a copy, not an allocation
                    self._stager = DefaultStager(StagingOptions(False, False, False, False))
                future = dcp.async_save(
                    state, checkpoint_id=str(tmp), async_stager=self._stager, process_group=self._group
                )
            except Exception as exc:
                raise CheckpointError(f"async save of {tmp} failed: {exc}. 'latest' is untouched") from exc
            self._pending_step = step
            self._pending = threading.Thread(
                target=self._finish_async, args=(future, step, tmp, meta, local, small), name=f"meshwise-ckpt-{step}"
            )
            self._pending.start()
        else:
            if meta["dcp"]:
                try:
                    dcp.save(state, storage_writer=FileSystemWriter(str(tmp), sync_files=False))
                except Exception as exc:
                    raise CheckpointError(f"saving {tmp} failed: {exc}. 'latest' is untouched") from exc
            self._commit(step, tmp, meta, local, group=None, defer=True)  # fsync and 'latest' in a thread of rank 0
        self._last_saved = step
        return self.step_path(step)

    def _warn_differences(self, reports: list[dict[str, Any]]) -> None:
        """Rank 0: warn about objects whose state differs across ranks (only rank 0's copy is saved)."""
        for name, mine in reports[0]["digests"].items():
            differ = [
                r for r, rep in enumerate(reports) if mine is not None and rep["digests"].get(name) not in (mine, None)
            ]
            if differ:
                warnings.warn(
                    f"meshwise checkpoint: {name}.state_dict() on rank(s) {differ} differs from rank 0's; rank 0's "
                    "copy was saved (objects other than models and optimizers must hold global state)",
                    stacklevel=2,
                )

    def _rng_state(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if self.topology.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.topology.device)
        return state

    def _finish_async(
        self, future: Any, step: int, tmp: Path, meta: dict[str, Any], local: dict[str, Any], small: dict[Path, Any]
    ) -> None:
        try:
            if local["error"] is None:
                local["error"] = _write_small(small)
            try:
                future.result()
            except Exception as exc:
                raise CheckpointError(f"async save of {tmp} failed: {exc}. 'latest' is untouched") from exc
            self._commit(step, tmp, meta, local, group=self._group, defer=False)  # DCP already synced its files
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread at the next wait()
            self._pending_error = exc

    def _commit(
        self, step: int, tmp: Path, meta: dict[str, Any], local: dict[str, Any], group: Any, *, defer: bool
    ) -> None:
        """After every rank wrote its part, rank 0 writes the metadata and renames ``step-N.tmp`` to ``step-N``.

        Then ``latest`` moves, once the files are on disk (fsync), and old checkpoints are pruned. With ``defer``
        that second half runs in a thread of rank 0, so the training loop does not wait for the disk: until it
        is done ``latest`` still names the previous checkpoint, which is whole.
        """
        reports = [local]
        if self._world > 1:
            reports = [None] * self._world
            try:  # the barrier: every rank reports that its files are written (or why not)
                dist.all_gather_object(reports, local, group=group)
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(
                    f"saving checkpoint step {step} into {tmp}: not every rank arrived within "
                    f"{self.topology.timeout.total_seconds():.0f}s ({exc}); a rank died or is stuck. The previous "
                    "checkpoint and 'latest' are untouched"
                ) from exc
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if failed:
            text = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise CheckpointError(f"writing {tmp} failed on {len(failed)} rank(s): {text}. 'latest' is untouched")
        if self._rank == 0:
            self._warn_differences(reports)
        error = None
        if self._rank == 0:
            try:
                _write_file(tmp / META, json.dumps(meta, indent=1) + "\n", fsync=not defer)
                final = self.step_path(step)
                trash = []
                if final.exists():  # the same step saved again (e.g. after resuming from an older one)
                    trash.append(self._to_trash(final))
                os.rename(tmp, final)
                if defer:
                    self._finalizer = threading.Thread(
                        target=self._finalize, args=(step, final, trash, True), name=f"meshwise-ckpt-latest-{step}"
                    )
                    self._finalizer.start()
                else:
                    self._finalize(step, final, trash, False)
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
        if self._world > 1:
            gathered = [error]
            dist.broadcast_object_list(gathered, src=0, group=group)
            error = gathered[0]
        if error:
            raise CheckpointError(f"committing checkpoint step {step} under {self.root} failed on rank 0: {error}")

    def _finalize(self, step: int, final: Path, trash: list[Path], threaded: bool) -> None:
        """Rank 0: make ``final`` durable, point ``latest`` at it, prune; in a thread, errors wait for the next call."""
        try:
            if threaded:
                for dirpath, _, files in os.walk(final):
                    for name in files:
                        fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                    _fsync_dir(Path(dirpath))
            _fsync_dir(self.root)
            _write_file(self.root / LATEST, f"step-{step}\n")
            self._discard(trash + self._prune(step))
        except BaseException as exc:
            if not threaded:
                raise
            self._finalize_error = CheckpointError(
                f"finishing checkpoint {final} failed on rank 0 ({type(exc).__name__}: {exc}); 'latest' still names "
                "the previous checkpoint"
            )

    def _join(self) -> None:
        """Wait for this rank's background work of the previous save (async write, or rank 0's finalizer)."""
        thread, self._pending = self._pending, None
        if thread is not None:
            thread.join()
        thread, self._finalizer = self._finalizer, None
        if thread is not None:
            thread.join()

    def _to_trash(self, path: Path) -> Path:
        """Rename a folder out of the way (atomic), so that a crash leaves a stale ``.tmp``, never a half folder."""
        self._trash_count += 1
        doomed = self.root / f"{path.name.split('.')[0]}.trash-{os.getpid()}-{self._trash_count}.tmp"
        os.rename(path, doomed)
        return doomed

    def _discard(self, paths: list[Path]) -> None:
        """Delete renamed folders in the background: deleting files is slow and nobody waits for it."""
        if not paths:
            return
        thread = threading.Thread(
            target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths], name="meshwise-ckpt-prune"
        )
        thread.start()
        self._reapers = [t for t in self._reapers if t.is_alive()] + [thread]

    def _prune(self, newest: int) -> list[Path]:
        """Retention and stale-folder cleaning, on rank 0 after a successful commit; returns folders to delete."""
        trash = []
        for entry in self.root.iterdir():
            if _TMP_DIR.match(entry.name) and entry.is_dir() and ".trash-" not in entry.name:
                trash.append(self._to_trash(entry))
        if self.keep_last is None and self.keep_best is None:
            return trash
        records = {}
        for step, path in self._committed().items():
            try:
                records[step] = json.loads((path / META).read_text())
            except (OSError, ValueError):
                continue  # not ours to judge; never deleted
        by_time = sorted(records, key=lambda s: (records[s].get("unix_time", 0.0), s), reverse=True)
        keep = {newest}
        if self.keep_last is not None:
            keep.update(by_time[: self.keep_last])
        scored = [s for s in records if isinstance(records[s].get("score"), (int, float))]
        if scored:
            sign = -1.0 if self.mode == "max" else 1.0
            ranked = sorted(scored, key=lambda s: (sign * records[s]["score"], -s))
            keep.update(ranked[: self.keep_best or 1])  # the best one is never deleted
        trash += [self._to_trash(self.step_path(step)) for step in records if step not in keep]
        return trash

    def wait(self) -> None:
        """Wait for a pending async save to be written and committed; raises its error, if any.

        Rank 0's error of a deferred ``latest`` update is raised on every rank by the next save/load/close.
        """
        self._join()
        error, self._pending_error = self._pending_error, None
        self._pending_step = None
        if error is not None:
            if isinstance(error, MeshwiseError):
                raise error
            raise CheckpointError(f"async checkpoint failed: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Wait for a pending async save (and old folders being deleted); call before ``meshwise.shutdown()``."""
        self.wait()
        self._on_rank0(lambda: None)  # raises, on every rank, an error rank 0 had finishing the last save
        for thread in self._reapers:
            thread.join()
        self._reapers = []
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()

    # ------------------------------------------------------------------ load

    def _resolve(self, step: int | str) -> tuple[int, Path]:
        if not self.root.exists():
            raise CheckpointError(f"no checkpoint folder at {self.root}: nothing was saved there yet")
        if not self._check_root(for_save=False):
            raise CheckpointError(f"{self.root} is empty: nothing was saved there yet")
        if step == "latest":
            found = self._read_latest()
            if found is None:
                raise CheckpointError(
                    f"{self.root / LATEST} is missing: no checkpoint under {self.root} completed "
                    f"(committed steps: {self.steps() or 'none'})"
                )
            path = self.step_path(found)
            if not path.is_dir():
                raise CheckpointError(
                    f"{self.root / LATEST} points at {path.name}, which is missing; load one of {self.steps()}"
                )
            return found, path
        if isinstance(step, bool) or not isinstance(step, int):
            raise CheckpointError(f"step must be an int or 'latest', got {step!r}")
        path = self.step_path(step)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint {path}: the committed steps are {self.steps() or 'none'}")
        return step, path

    def _validate_files(self, step: int | str, names: Mapping[str, str]) -> tuple[int, str, dict[str, Any]]:
        """Rank 0: find the folder, read the metadata, check every shard file exists and is long enough."""
        number, path = self._resolve(step)
        meta_path = path / META
        if not meta_path.is_file():
            raise CheckpointError(f"{meta_path} is missing: {path} is not a complete meshwise checkpoint")
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError as exc:
            raise CheckpointError(f"{meta_path} is not valid JSON ({exc}): the checkpoint is damaged") from None
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_path} is not a meshwise checkpoint record (format {meta.get('format')!r})")
        saved = meta.get("objects", {})
        absent = [n for n in names if n not in saved]
        if absent:
            raise CheckpointError(
                f"checkpoint {path} has no object(s) {absent}; it holds {sorted(saved)} (see {meta_path})"
            )
        wrong = [f"{n} (saved as {saved[n]['kind']}, given a {k})" for n, k in names.items() if saved[n]["kind"] != k]
        if wrong:
            raise CheckpointError(f"checkpoint {path}: object kinds differ: {', '.join(wrong)}")
        for n, k in names.items():
            if k == "state" and not (path / OBJECTS_DIR / f"{n}.pt").is_file():
                raise CheckpointError(f"{path / OBJECTS_DIR / (n + '.pt')} is missing: the checkpoint is incomplete")
        if meta.get("dcp") and any(k in ("module", "optimizer") for k in names.values()):
            self._check_shards(path)
        return number, str(path), meta

    def _check_shards(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        dcp_meta = path / DCP_META
        if not dcp_meta.is_file():
            raise CheckpointError(f"{dcp_meta} (the DCP metadata) is missing: the checkpoint {path} is incomplete")
        try:
            md = FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{dcp_meta} cannot be read ({type(exc).__name__}: {exc}): it is damaged") from None
        needed: dict[str, int] = {}
        for info in (md.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for rel, size in sorted(needed.items()):
            shard = path / rel
            if not shard.is_file():
                raise CheckpointError(f"shard file {shard} is missing: the checkpoint {path} is incomplete")
            actual = shard.stat().st_size
            if actual < size:
                raise CheckpointError(
                    f"shard file {shard} is truncated: {actual} bytes, the DCP metadata needs {size}; "
                    "load an older checkpoint"
                )

    def _check_keys(self, path: Path, state: Mapping[str, Any]) -> None:
        """Rank 0: compare the keys and global shapes the objects expect with those the DCP metadata holds."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        flat, _ = flatten_state_dict(dict(state))
        prefixes = tuple(f"{n}." for n in state)
        missing = sorted(k for k in flat if k not in saved)
        unexpected = sorted(k for k in saved if k.startswith(prefixes) and k not in flat)
        shapes = []
        for k, v in flat.items():
            shape = _tensor_shape(v)
            md = saved.get(k)
            if shape is not None and isinstance(md, TensorStorageMetadata) and tuple(md.size) != shape:
                shapes.append(f"{k}: saved {list(md.size)}, expected {list(shape)}")
        if missing or unexpected or shapes:

            def listing(keys: list[str]) -> str:
                return ", ".join(keys[:12]) + (f", ... ({len(keys)} in all)" if len(keys) > 12 else "")

            parts = []
            if missing:
                parts.append(f"missing keys (expected, not in the checkpoint): {listing(missing)}")
            if unexpected:
                parts.append(f"unexpected keys (in the checkpoint, not expected): {listing(unexpected)}")
            if shapes:
                parts.append(f"shape mismatches: {listing(shapes)}")
            raise CheckpointError(
                f"checkpoint {path / DCP_META} is of another model or optimizer: " + "; ".join(parts) + ". "
                "Build the same model (and optimizer) that was saved, or load only the objects that match"
            )

    def load(self, step: int | str = "latest", *, restore_rng: bool = True, **objects: Any) -> CheckpointInfo:
        """Load checkpoint ``step`` (an int or ``"latest"``) into ``objects`` on every rank.

        Files and keys are checked before anything is loaded; a mismatch raises :class:`CheckpointError`
        naming the file. At the mesh it was saved at, each rank's RNG states are restored; at another mesh
        DCP reshards model and optimizer and the RNG streams are re-derived from ``rng_seed``, the step and
        the data rank (ranks holding the same samples share a stream). Rank 0 prints what was resharded.
        """
        return self._load(step, objects, restore_rng=restore_rng, resume_engine=None)

    def _load(
        self, step: int | str, objects: Mapping[str, Any], *, restore_rng: bool, resume_engine: Any
    ) -> CheckpointInfo:
        self.wait()
        kinds = self._classify(objects)
        owners = self._owners(objects, kinds)
        number, path_text, meta = self._on_rank0(lambda: self._validate_files(step, kinds))
        path = Path(path_text)
        topo = self.topology
        saved_mesh = dict(zip(meta["mesh"]["dims"], meta["mesh"]["sizes"]))
        mesh = dict(topo.sizes)
        same_mesh = saved_mesh == mesh and meta.get("world_size") == topo.world_size

        saved_fresh = {n for n in kinds if kinds[n] == "optimizer" and meta["objects"][n].get("fresh")}
        dcp_names = [n for n, k in kinds.items() if k in ("module", "optimizer") and n not in saved_fresh]
        if dcp_names:
            was_empty = {n for n in dcp_names if kinds[n] == "optimizer" and not objects[n].state}
            state = self._dcp_state(objects, kinds, owners, skip=set(kinds) - set(dcp_names))
            try:
                self._on_rank0(lambda: self._check_keys(path, state))
            except CheckpointError:
                for n in was_empty:
                    objects[n].state.clear()  # get_optimizer_state_dict initialised it; leave it as it was
                raise
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

            try:
                dcp.load(state, checkpoint_id=str(path))
            except Exception as exc:
                raise CheckpointError(f"reading {path} failed: {exc}") from exc
            for n in dcp_names:
                if kinds[n] == "module":
                    set_model_state_dict(objects[n], state[n])
            for n in dcp_names:
                if kinds[n] == "optimizer":
                    set_optimizer_state_dict(objects[owners[n]], objects[n], state[n])
        for n in saved_fresh:
            objects[n].state.clear()  # saved before its first step: it had no state

        for name, kind in kinds.items():
            if kind != "state":
                continue
            file = path / OBJECTS_DIR / f"{name}.pt"
            try:
                sd = torch.load(file, weights_only=False)
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}): it is damaged") from exc
            try:
                if resume_engine is not None and objects[name] is resume_engine:
                    sd = _engine_resume_state(resume_engine, sd, file)
                objects[name].load_state_dict(sd)
            except MeshwiseError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{name}.load_state_dict() rejected {file}: {type(exc).__name__}: {exc}") from exc

        rng = "not restored"
        if restore_rng:
            if same_mesh:
                file = path / RNG_DIR / f"rank-{self._rank:05d}.pt"
                error = None
                try:
                    self._set_rng(torch.load(file, weights_only=False))
                except Exception as exc:  # noqa: BLE001
                    error = f"{file}: {type(exc).__name__}: {exc}"
                self._agree(error, "restoring the RNG states")
                rng = "restored"
            else:
                seed = _derived_seed(int(meta.get("rng_seed", self.rng_seed)), number, topo.data_rank)
                torch.manual_seed(seed)
                np.random.seed(seed % (1 << 32))
                random.seed(seed)
                rng = "re-derived"

        where = f"step-{number} from {self.root}"
        if same_mesh:
            message = f"meshwise checkpoint: loaded {where} at the mesh it was saved at ({_mesh_text(mesh)})"
        else:
            parts = [
                f"meshwise checkpoint: loaded {where}, resharded from mesh {_mesh_text(saved_mesh)} "
                f"(world {meta.get('world_size')}) to {_mesh_text(mesh)} (world {topo.world_size})"
            ]
            if dcp_names:
                parts.append(f"DCP resharded {', '.join(dcp_names)}")
            others = [n for n, k in kinds.items() if k == "state"]
            if others:
                parts.append(f"{', '.join(others)} loaded from rank 0's global copy")
            if rng == "re-derived":
                parts.append("RNG streams re-derived from rng_seed + step + data rank")
            message = "; ".join(parts)
        if self.verbose and self._rank == 0:
            print(message, flush=True)
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

    def _set_rng(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and self.topology.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.topology.device)

    # ------------------------------------------------------------------ ignite

    def attach(
        self,
        engine: Any,
        *,
        every_iterations: int | None = None,
        every_epochs: int | None = None,
        resume: bool = True,
        **objects: Any,
    ) -> Checkpointer:
        """Save ``objects`` (and ``engine`` itself, as ``"engine"``) every N iterations and/or epochs.

        The step of each checkpoint is ``engine.state.iteration``. With ``resume`` the run starts from
        ``latest`` when there is one (at ``Events.STARTED``; the loader must be among ``objects`` so it
        continues from its cursor): the engine then runs the rest of that epoch and the remaining epochs,
        until the ``max_epochs``/``max_iters`` given to ``run``. At ``Events.COMPLETED`` a pending async save
        is waited for.
        """
        from ignite.engine import Events

        for name, value in (("every_iterations", every_iterations), ("every_epochs", every_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CheckpointError(f"{name} must be a positive int, got {value!r}")
        if every_iterations is None and every_epochs is None and not resume:
            raise CheckpointError("attach() needs every_iterations=, every_epochs= or resume=True")
        objects = dict(objects)
        if not any(obj is engine for obj in objects.values()):
            if "engine" in objects:
                raise CheckpointError("the name 'engine' is taken by another object: pass the engine as engine=")
            objects["engine"] = engine
        self._classify(objects)

        def save(e: Any) -> None:
            if self._last_saved != e.state.iteration:
                self.save(e.state.iteration, **objects)

        resumed = {"done": False}

        def start(e: Any) -> None:
            if resumed["done"] or e.state.iteration != 0:
                return  # a run() continuing in the same process: its state is already right
            resumed["done"] = True
            if self.latest_step() is not None:
                info = self._load("latest", objects, restore_rng=True, resume_engine=e)
                self._last_saved = info.step

        if resume:
            engine.add_event_handler(Events.STARTED, start)
        if every_iterations is not None:
            engine.add_event_handler(Events.ITERATION_COMPLETED(every=every_iterations), save)
        if every_epochs is not None:
            engine.add_event_handler(Events.EPOCH_COMPLETED(every=every_epochs), save)
        engine.add_event_handler(Events.COMPLETED, lambda _: self.wait())
        return self


def _engine_resume_state(engine: Any, sd: Mapping[str, Any], file: Path) -> dict[str, Any]:
    """The saved engine state with this run's termination (max_epochs / max_iters) in place of the saved one."""
    sd = dict(sd)
    state = engine.state
    if state.epoch_length is not None and sd.get("epoch_length") not in (None, state.epoch_length):
        raise CheckpointError(
            f"{file}: the checkpoint has {sd['epoch_length']} iterations per epoch but this run has "
            f"{state.epoch_length}: resume with the same global batch size and dataset"
        )
    sd.pop("max_epochs", None)
    sd.pop("max_iters", None)
    if state.max_iters is not None:
        sd["max_iters"] = state.max_iters
    else:
        sd["max_epochs"] = state.max_epochs
    done = sd.get("iteration", 0)
    if state.max_iters is not None and done > state.max_iters:
        raise CheckpointError(f"{file} is at iteration {done}, past this run's max_iters={state.max_iters}")
    if state.max_epochs is not None and sd.get("epoch_length") and done > state.max_epochs * sd["epoch_length"]:
        raise CheckpointError(
            f"{file} is at iteration {done} (epoch {done // sd['epoch_length']}), past this run's "
            f"max_epochs={state.max_epochs}: raise max_epochs to continue"
        )
    return sd


def _meshwise_version() -> str:
    try:
        from meshwise import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"
