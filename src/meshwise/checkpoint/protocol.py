"""The on-disk protocol of a checkpoint root: its folder layout and how a checkpoint becomes visible.

A save fills ``step-N.tmp/``, which is renamed to ``step-N/`` once whole, then ``latest`` moves; folders to
delete are first renamed to a ``.tmp`` name (atomic) and deleted in the background. Everything here runs on
rank 0 (or reads locally); the collectives around it are the checkpointer's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

from meshwise.errors import CheckpointError

__all__ = [
    "DCP_META",
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "MARKER",
    "META",
    "OBJECTS_DIR",
    "RNG_DIR",
    "CheckpointFolder",
    "entry_name",
    "fsync_dir",
    "fsync_tree",
    "write_file",
]

FORMAT = "meshwise-checkpoint"
FORMAT_VERSION = 2  # 2: small states as JSON, RNG states as tensors and numbers (1: pickles, still read)
MARKER = "meshwise-checkpoints.json"  # marks a folder as a checkpoint root
META = "meshwise.json"  # the metadata record of one checkpoint, written last
LATEST = "latest"
DCP_META = ".metadata"
OBJECTS_DIR = "objects"
RNG_DIR = "rng"

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-\d+(\.[A-Za-z0-9_-]+)?\.tmp$")


def entry_name(entry: int | str) -> str:
    """The folder name of a checkpoint: ``step-N`` for a step, else the name itself (an ignite file name).

    A name must be one folder name that cannot be taken for a step, a temporary folder or a root file.
    """
    if isinstance(entry, int) and not isinstance(entry, bool):
        return f"step-{entry}"
    name = str(entry)
    if (
        not isinstance(entry, str)
        or not name
        or name != Path(name).name
        or name.startswith(".")
        or name.endswith(".tmp")
        or _STEP_DIR.match(name)
        or name in (LATEST, MARKER, META)
    ):
        raise CheckpointError(
            f"{entry!r} cannot name a checkpoint folder: use a step number, or a single folder name that does not "
            "start with '.' or 'step-N', end with '.tmp', or contain '/'"
        )
    return name


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that a rename or a new file in it survives a crash (best effort: not every OS can)."""
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


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root``."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_file(path: Path, text: str, fsync: bool = True) -> None:
    """Write a small file so that readers see either the old or the new content, never a torn one.

    The temporary file is made anew (a stale one, or a symlink planted in its place, is removed first, not
    followed), and ``os.replace`` replaces a symlink at ``path`` itself: nothing outside the folder is written."""
    tmp = path.with_name(path.name + ".partial")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(tmp, flags, 0o644), "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


# The thread moving each root's 'latest' (by real path), whichever CheckpointFolder started it: another object on
# the same root in this process (a Checkpointer made to load what one just saved) waits for it before reading.
_PUBLISHING: dict[str, threading.Thread] = {}


def _wait_for_publish(root: Path) -> None:
    thread = _PUBLISHING.get(os.path.realpath(root))
    if thread is not None and thread is not threading.current_thread():
        thread.join()


class CheckpointFolder:
    """One checkpoint root: find, create, publish, retain and delete its ``step-N`` folders.

    ``keep_last`` keeps the N most recently saved checkpoints, ``keep_best`` the N best by the ``score`` in their
    metadata (``mode`` ``"max"`` or ``"min"``); the newest and the best are never deleted.
    """

    def __init__(self, root: Path, *, keep_last: int | None, keep_best: int | None, mode: str) -> None:
        self.root = root
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.mode = mode
        self._trash_count = 0
        self._reapers: list[threading.Thread] = []
        self._finalizer: threading.Thread | None = None
        self._finalize_error: BaseException | None = None

    # ------------------------------------------------------------------ reading

    def step_path(self, step: int) -> Path:
        """The folder of the committed checkpoint of ``step``."""
        return self.root / f"step-{int(step)}"

    def entry_path(self, entry: int | str) -> Path:
        """The folder of the committed checkpoint ``entry`` (a step or a name, see :func:`entry_name`)."""
        return self.root / entry_name(entry)

    def tmp_path(self, entry: int | str) -> Path:
        """The folder a save of ``entry`` writes into until it is whole."""
        return self.root / f"{entry_name(entry)}.tmp"

    def committed(self) -> dict[int, Path]:
        """Committed checkpoints (a ``step-N`` folder with its metadata record), by step."""
        out = {}
        if self.root.is_dir():
            for entry in self.root.iterdir():
                m = _STEP_DIR.match(entry.name)
                if m and not entry.is_symlink() and entry.is_dir() and (entry / META).is_file():
                    out[int(m.group(1))] = entry  # a symlinked step folder is not this root's: never listed
        return dict(sorted(out.items()))

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, in order."""
        return list(self.committed())

    def check_root(self, for_save: bool) -> bool:
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

    def read_latest(self) -> int | None:
        """The step ``latest`` names, or None when there is none yet."""
        _wait_for_publish(self.root)
        if not self.check_root(for_save=False):
            return None
        path = self.root / LATEST
        if path.is_symlink():
            raise CheckpointError(
                f"{path} is a symlink (to {os.readlink(path)}), which a save never writes: refused, nothing was read; "
                "load a step explicitly"
            )
        if not path.is_file():
            return None
        text = path.read_text(errors="replace")[:200].strip()
        m = _STEP_DIR.match(text)
        if not m:
            outside = text.isprintable() and ("/" in text or "\\" in text or ".." in text)
            shown = repr(text) if len(text) <= 60 else repr(text[:60]) + "..."
            raise CheckpointError(
                f"{path} holds {shown}, not 'step-N': "
                + ("it points outside the checkpoint root, refused, nothing was read" if outside else "it is damaged")
                + "; load a step explicitly"
            )
        return int(m.group(1))

    def find(self, step: int | str) -> tuple[int, Path]:
        """The step number and folder of ``step`` (an int or ``"latest"``); raises when it does not exist or leads
        outside ``root`` (a symlink)."""
        number, path = self._find(step)
        if path.is_symlink():
            raise CheckpointError(
                f"{path} is a symlink (to {os.readlink(path)}), which a save never makes: refused, nothing was read"
            )
        return number, path

    def _find(self, step: int | str) -> tuple[int, Path]:
        if not self.root.exists():
            raise CheckpointError(f"no checkpoint folder at {self.root}: nothing was saved there yet")
        if not self.check_root(for_save=False):
            raise CheckpointError(f"{self.root} is empty: nothing was saved there yet")
        if step == "latest":
            found = self.read_latest()
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

    # ------------------------------------------------------------------ writing

    def make_root(self) -> None:
        """Create the root with its marker (a folder holding other files is refused, untouched)."""
        self.check_root(for_save=True)
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / MARKER
        if not marker.exists():
            write_file(marker, json.dumps({"format": FORMAT, "version": FORMAT_VERSION}) + "\n")

    def prepare(self, step: int | str, subdirs: Iterable[str]) -> None:
        """Create the root (with its marker) and an empty :meth:`tmp_path` holding ``subdirs``."""
        self.make_root()
        tmp = self.tmp_path(step)
        if tmp.is_symlink():
            tmp.unlink()  # not a folder of ours: the link goes, never what it points at
        elif tmp.exists():
            shutil.rmtree(tmp)  # a stale folder of a save of this step that crashed
        tmp.mkdir(parents=True)
        for name in subdirs:
            (tmp / name).mkdir()

    def publish(self, step: int | str, tmp: Path, record: str, *, defer: bool) -> None:
        """Write the metadata ``record`` into ``tmp``, rename it to ``step-N``, then move ``latest`` and prune.

        A named checkpoint (``step`` a str) moves neither ``latest`` nor prunes: its owner (ignite's
        ``Checkpoint``) keeps its own list and deletes with :meth:`remove`. With ``defer`` the files are not yet
        on disk (no fsync so far): a thread makes them durable before ``latest`` moves, so the caller does not
        wait for the disk; until then ``latest`` still names the previous, whole, checkpoint. Its error is kept
        for :meth:`take_error`.
        """
        write_file(tmp / META, record, fsync=not defer)
        final = self.entry_path(step)
        trash = []
        if final.exists():  # the same step saved again (e.g. after resuming from an older one)
            trash.append(self._to_trash(final))
        os.rename(tmp, final)
        if isinstance(step, int):
            # stale folders of crashed saves, moved aside now: the caller publishes before any rank may start its
            # next save, so none of these is a save in progress (the thread below runs while one may be)
            trash += [
                self._to_trash(e)
                for e in self.root.iterdir()
                if _TMP_DIR.match(e.name) and e.is_dir() and ".trash-" not in e.name
            ]
        _wait_for_publish(self.root)  # 'latest' moves in the order of the saves, whoever made them
        if defer:
            self._finalizer = threading.Thread(
                target=self._finalize, args=(step, final, trash, True), name=f"meshwise-ckpt-latest-{step}"
            )
            _PUBLISHING[os.path.realpath(self.root)] = self._finalizer
            self._finalizer.start()
        else:
            self._finalize(step, final, trash, False)

    def _finalize(self, step: int | str, final: Path, trash: list[Path], threaded: bool) -> None:
        try:
            if threaded:
                fsync_tree(final)
            fsync_dir(self.root)
            if isinstance(step, str):
                self._discard(trash)
                return
            write_file(self.root / LATEST, f"step-{step}\n")
            self._discard(trash + self._prune(step))
        except BaseException as exc:
            if not threaded:
                raise
            self._finalize_error = CheckpointError(
                f"finishing checkpoint {final} failed on rank 0 ({type(exc).__name__}: {exc}); 'latest' still names "
                "the previous checkpoint"
            )

    def join(self) -> None:
        """Wait for the thread that makes the last checkpoint durable and moves ``latest``."""
        thread, self._finalizer = self._finalizer, None
        if thread is not None:
            thread.join()

    def take_error(self) -> BaseException | None:
        """The error of the last deferred publish (once), or None."""
        error, self._finalize_error = self._finalize_error, None
        return error

    def join_deletions(self) -> None:
        """Wait for old folders being deleted in the background."""
        for thread in self._reapers:
            thread.join()
        self._reapers = []

    # ------------------------------------------------------------------ retention and deletion

    def remove(self, name: str) -> None:
        """Delete the named checkpoint ``name`` (renamed away first, atomic; deleted in the background)."""
        path = self.entry_path(name)
        if path.is_dir():
            self._discard([self._to_trash(path)])

    def _to_trash(self, path: Path) -> Path:
        """Rename a folder out of the way (atomic), so that a crash leaves a stale ``.tmp``, never a half folder."""
        self._trash_count += 1
        stem = path.name.split(".")[0] if _STEP_DIR.match(path.name.split(".")[0]) else path.name
        doomed = self.root / f"{stem}.trash-{os.getpid()}-{self._trash_count}.tmp"
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
        """Retention after a successful commit; returns the folders to delete."""
        trash: list[Path] = []
        if self.keep_last is None and self.keep_best is None:
            return trash
        records = {}
        for step, path in self.committed().items():
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
