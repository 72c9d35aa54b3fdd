"""Tokenise a corpus byte-level into ``train.npy`` / ``val.npy`` token memmaps with a deterministic held-out split.

Default corpus: the Python standard library's own ``.py`` files (every machine has them), concatenated in
sorted path order; the held-out split is the last files of that order, about ``val_fraction`` of the bytes,
so no file is in both splits. ``--text FILE`` splits one text file's bytes at the end instead;
``--tokens FILE.npy`` takes already-tokenised ids (any integer dtype) and splits them at the end.

    python examples/gpt/prepare.py --out data/gpt            # the standard library
    python examples/gpt/prepare.py --out data/book --text book.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from meshwise.errors import DataError

FORMAT = 1


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """The ``.py`` files under ``root`` (relative, POSIX, sorted), skipping installed packages."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]
    return sorted(files)


def _save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
    np.save(tmp, array)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.int32)


def prepare(
    out_dir: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    text: str | os.PathLike | None = None,
    tokens: str | os.PathLike | None = None,
    val_fraction: float = 0.05,
    force: bool = False,
    write: bool = True,
) -> dict:
    """Write ``out_dir/{train,val}.npy`` and ``meta.json``; return the metadata (reused when up to date).

    Give at most one of ``source_dir`` (a folder of ``.py`` files; default the standard library),
    ``text`` (one file, byte-level) or ``tokens`` (a 1-D ``.npy`` of token ids). With ``write=False``
    nothing is written: the metadata of up-to-date files, else a :class:`DataError`.
    """
    if sum(x is not None for x in (source_dir, text, tokens)) > 1:
        raise DataError("give only one of source_dir, text and tokens: they are alternative corpora")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    out = Path(out_dir)
    for name, path in (("text", text), ("tokens", tokens)):
        if path is not None and not Path(path).is_file():
            raise DataError(f"the {name} file {path} does not exist: give an existing file")
    if text is not None:
        source = {"kind": "text", "path": str(Path(text).resolve()), "size": Path(text).stat().st_size}
    elif tokens is not None:
        source = {"kind": "tokens", "path": str(Path(tokens).resolve()), "size": Path(tokens).stat().st_size}
    else:
        root = Path(source_dir) if source_dir is not None else stdlib_dir()
        if not root.is_dir():
            raise DataError(f"corpus folder {root} does not exist: pass an existing folder of .py files")
        files = source_files(root)
        source = {"kind": "python", "path": str(root.resolve()), "files": len(files)}
    request = {"format": FORMAT, "source": source, "val_fraction": val_fraction}
    meta_path = out / "meta.json"
    if not force and meta_path.exists() and (out / "train.npy").exists() and (out / "val.npy").exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("request") == request:
            return meta
    if not write:
        raise DataError(f"{out} holds no up-to-date corpus for {source['path']}: prepare it first (prepare.py)")

    extra: dict = {}
    if source["kind"] == "python":
        sizes = [(root / f).stat().st_size for f in files]
        if len(files) < 2:
            raise DataError(f"{root} holds {len(files)} .py file(s): a train/held-out split needs at least 2")
        # Held-out = the last files of the sorted order, at least val_fraction of the bytes, at least one file.
        total, acc, cut = sum(sizes), 0, len(files)
        while cut > 1 and (acc < val_fraction * total or cut == len(files)):
            cut -= 1
            acc += sizes[cut]
        blob = b"".join((root / f).read_bytes() for f in files)
        data = np.frombuffer(blob, dtype=np.uint8)
        split = sum(sizes[:cut])
        vocab_size = 256
        extra = {"train_files": files[:cut], "val_files": files[cut:]}
    elif source["kind"] == "text":
        data = np.fromfile(text, dtype=np.uint8)
        split = len(data) - round(val_fraction * len(data))
        vocab_size = 256
    else:
        data = np.load(tokens, mmap_mode="r")
        if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
            raise DataError(f"{tokens} must hold a 1-D integer array of token ids, got {data.dtype} {data.shape}")
        if len(data) and data.min() < 0:
            raise DataError(f"{tokens} holds negative token ids: ids must be 0..vocab_size-1")
        vocab_size = int(data.max()) + 1 if len(data) else 1
        data = np.asarray(data, dtype=_token_dtype(vocab_size))
        split = len(data) - round(val_fraction * len(data))
    if not 0 < split < len(data):
        raise DataError(f"corpus of {len(data)} tokens is too small to split with val_fraction={val_fraction}")
    out.mkdir(parents=True, exist_ok=True)
    _save(out / "train.npy", data[:split])
    _save(out / "val.npy", data[split:])
    meta = {
        "request": request,
        "vocab_size": vocab_size,
        "dtype": str(data.dtype),
        "train_tokens": int(split),
        "val_tokens": int(len(data) - split),
        "sha256": hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest(),
        **extra,
    }
    tmp = meta_path.with_name(f"meta.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/gpt", help="output folder (default data/gpt)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--source-dir", default=None, help="a folder of .py files (default: the standard library)")
    group.add_argument("--text", default=None, help="one text file, tokenised byte-level")
    group.add_argument("--tokens", default=None, help="a 1-D .npy of token ids")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out share (default 0.05)")
    p.add_argument("--force", action="store_true", help="rewrite even when the output is up to date")
    a = p.parse_args(argv)
    meta = prepare(
        a.out, source_dir=a.source_dir, text=a.text, tokens=a.tokens, val_fraction=a.val_fraction, force=a.force
    )
    print(
        f"{a.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} held-out tokens "
        f"(vocab {meta['vocab_size']}, {meta['dtype']})"
    )


if __name__ == "__main__":
    main()
