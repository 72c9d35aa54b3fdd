"""Export: one consolidated, plain ``state_dict`` file from any meshwise checkpoint, for inference without meshwise.

``export(src, out)`` reads only the model's tensors (whole, at their global shapes) in one process, no process
group needed; ``python -m meshwise.checkpoint.export SRC OUT`` does the same from a shell.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

import torch

from meshwise.checkpoint.consolidated import read_model
from meshwise.errors import CheckpointError

__all__ = ["export", "main", "read_model", "run_cli"]


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
    ``from_pretrained`` reads (see :func:`meshwise.hf.folder.export_hf`)."""
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
        # the Hugging Face integration (layered above the checkpoint) is loaded only when asked for
        export_hf = importlib.import_module("meshwise.hf.folder").export_hf
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
