"""Export: one consolidated, plain ``state_dict`` file from any meshwise checkpoint, for inference without meshwise.

``export(src, out)`` reads only the model's tensors (whole, at their global shapes) in one process, no process
group needed; ``python -m meshwise.checkpoint.export SRC OUT`` does the same from a shell.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from meshwise.checkpoint.protocol import MARKER, META, CheckpointFolder
from meshwise.checkpoint.safe import SafeLoadPlanner, SafeReader, read_dcp_metadata
from meshwise.checkpoint.validation import check_shards, read_record
from meshwise.checkpoint.writer import failure_text
from meshwise.errors import CheckpointError

__all__ = ["export", "main", "read_model", "run_cli"]


def _folder(src: Path) -> Path:
    """The checkpoint folder ``src`` names: itself, or a root's ``latest`` (else its newest folder)."""
    if (src / META).is_file():
        return src
    if not (src / MARKER).is_file():
        raise CheckpointError(
            f"{src} is neither a meshwise checkpoint folder (no {META}) nor a checkpoint root (no {MARKER})"
        )
    folder = CheckpointFolder(src, keep_last=None, keep_best=None, mode="max")
    if folder.read_latest() is not None:  # refused when 'latest' leads outside src
        return folder.find("latest")[1]
    found = []
    for entry in src.iterdir():
        if entry.is_symlink():
            continue  # never a folder of a save
        try:
            found.append((json.loads((entry / META).read_text())["unix_time"], entry))
        except (OSError, ValueError, KeyError):
            continue
    if not found:
        raise CheckpointError(f"no complete checkpoint under {src}")
    return max(found)[1]


def _model_key(path: Path, meta: dict[str, Any], key: str) -> str:
    objects = meta.get("objects", {})
    single = meta.get("info", {}).get("ignite", {}).get("single")
    if key not in objects and single and "checkpoint" in objects:
        key = "checkpoint"  # ignite saved one object; its state dict is kept under ignite's own name
    if key not in objects:
        raise CheckpointError(f"checkpoint {path} has no object {key!r}; it holds {sorted(objects)}: pass key=")
    if objects[key]["kind"] not in ("module", "tensors"):
        raise CheckpointError(f"{key!r} in {path} is a {objects[key]['kind']}, not a model's tensors: pass key=")
    return key


def read_model(checkpoint: str | os.PathLike, key: str = "model", *, trust: bool = False) -> dict[str, Any]:
    """The model ``key`` of ``checkpoint`` as whole tensors at their global shapes, keyed by the model's own FQNs.

    One process, no process group; see :func:`export` for what ``checkpoint`` may name. Nothing in the files runs:
    a value only full pickle reads (a module's extra state holding objects) needs ``trust=True``.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    path = _folder(Path(checkpoint))
    meta = read_record(path, {}, trust)
    key = _model_key(path, meta, key)
    check_shards(path, writer_torch=meta.get("torch"), trust=trust)
    saved = read_dcp_metadata(path, trust).state_dict_metadata
    prefix = f"{key}."
    target: dict[str, Any] = {}
    for name, md in saved.items():
        if not name.startswith(prefix):
            continue
        if isinstance(md, TensorStorageMetadata):
            target[name[len(prefix) :]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            target[name[len(prefix) :]] = None  # a non-tensor value (e.g. a module's extra state)
    if not target:
        raise CheckpointError(f"{key!r} in {path} holds no tensors to export")
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is what is asked here
            warnings.simplefilter("ignore", UserWarning)
            reader, planner = SafeReader(path, trust), SafeLoadPlanner(path, trust)
            dcp_load({key: target}, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise CheckpointError(f"reading {key!r} from {path} failed: {failure_text(exc)}") from exc
    return target


def export(
    checkpoint: str | os.PathLike,
    out_file: str | os.PathLike,
    key: str = "model",
    *,
    overwrite: bool = False,
    trust: bool = False,
) -> Path:
    """Write the model ``key`` of ``checkpoint`` as one ``torch.save`` file of plain, whole tensors.

    ``checkpoint``: a checkpoint folder (``root/step-N`` or a :class:`MeshSaver` folder) or a checkpoint root (its
    ``latest``, else its newest folder). The keys are the model's own FQNs (as the unwrapped model's
    ``state_dict()`` has them), so ``model.load_state_dict(torch.load(out_file))`` works in one process without
    meshwise. An existing ``out_file`` is refused unless ``overwrite=True``; the file appears whole or not at all.
    The checkpoint is read as data (``trust``: see :func:`read_model`).
    """
    out = Path(out_file)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} exists: pass overwrite=True (--overwrite) to replace it, or another path")
    target = read_model(checkpoint, key, trust=trust)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    try:
        torch.save(target, tmp)
        os.replace(tmp, out)
    except BaseException:
        os.remove(tmp)
        raise
    return out


def run_cli(argv: list[str], prog: str = "python -m meshwise.checkpoint.export") -> int:
    """The command line ``SRC OUT [--key model] [--overwrite] [--hf --config PATH]``; raises :class:`CheckpointError`
    (for ``meshwise``'s own console script to report). With ``--hf``, OUT is a folder that
    ``from_pretrained`` reads (see :func:`meshwise.checkpoint.hf_folder.export_hf`)."""
    p = argparse.ArgumentParser(prog=prog, description="Write one plain state_dict file from a meshwise checkpoint.")
    p.add_argument("src", help="a checkpoint folder, or a checkpoint root (its latest)")
    p.add_argument("out", help="the file to write (torch.save of a plain state_dict)")
    p.add_argument("--key", default="model", help="the saved object to export (default: model)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument(
        "--trust",
        action="store_true",
        help="also read values only full pickle can (it runs code the files name): only for a checkpoint you trust",
    )
    p.add_argument("--hf", action="store_true", help="write OUT as a Hugging Face folder (config.json + safetensors)")
    p.add_argument("--config", default=None, help="with --hf: the model's config.json, or a folder holding one")
    a = p.parse_args(argv)
    if a.hf:
        from meshwise.checkpoint.hf_folder import export_hf

        if a.config is None:
            p.error("--hf needs --config PATH (the model's config.json, or a folder holding one)")
        if a.overwrite:
            p.error("--hf never overwrites: pass an empty or new folder as OUT")
        print(f"wrote {export_hf(a.src, a.out, config=a.config, key=a.key, trust=a.trust)}")
        return 0
    print(f"wrote {export(a.src, a.out, a.key, overwrite=a.overwrite, trust=a.trust)}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m meshwise.checkpoint.export SRC OUT [--key model] [--overwrite]``."""
    try:
        run_cli(sys.argv[1:] if argv is None else argv)
    except CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
