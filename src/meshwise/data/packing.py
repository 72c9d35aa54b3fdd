"""Sequence packing: tokenised documents concatenated into fixed rows of ``seq_len`` tokens, vectorised."""

from __future__ import annotations

from typing import Any

import numpy as np

from meshwise.data.mapped import check_map_style
from meshwise.data.reading import is_hf_dataset
from meshwise.data.sources import ArrayDataset
from meshwise.errors import DataError

__all__ = ["pack", "pack_arrays"]


def _documents(dataset: Any, field: str) -> tuple[np.ndarray, np.ndarray]:
    """All tokens of ``field`` end to end (int64) and each document's length, in dataset order."""
    if is_hf_dataset(dataset):
        import pyarrow as pa
        import pyarrow.compute as pc

        if field not in dataset.column_names:
            raise DataError(f"the dataset has no column {field!r}; its columns are {dataset.column_names}")
        # The public Arrow view of one column, in the dataset's row order: the table's own column (memory-mapped
        # when loaded from disk, no copy) or, for a select()/shuffle() view, one take of just this column's rows.
        column = dataset.with_format("arrow")[field]  # a ChunkedArray: read chunk by chunk, never joined first
        if not pa.types.is_list(column.type) and not pa.types.is_large_list(column.type):
            raise DataError(f"column {field!r} is {column.type}, not a list of token ids per document")
        lengths = pc.list_value_length(column).fill_null(0).to_numpy().astype(np.int64)
        flat = pc.list_flatten(column)
        tokens = flat.to_numpy().astype(np.int64, copy=False) if len(flat) else np.zeros(0, dtype=np.int64)
        return tokens, lengths
    if not isinstance(dataset, (list, tuple)):
        check_map_style(dataset)
    docs = []  # one Python step per document, none per token
    for i in range(len(dataset)):
        doc = dataset[i]
        if isinstance(doc, dict):
            if field not in doc:
                raise DataError(f"sample {i} has no field {field!r}; its fields are {sorted(doc)}")
            doc = doc[field]
        arr = np.asarray(doc.numpy() if hasattr(doc, "numpy") else doc)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise DataError(f"document {i}'s {field!r} is not a 1-D list of integer token ids (shape {arr.shape})")
        docs.append(arr.astype(np.int64, copy=False))
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
    return tokens, lengths


def pack_arrays(tokens: np.ndarray, lengths: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Rows ``[R, seq_len]`` of ``input_ids``, ``position_ids`` (0 at each document start), ``document_ids``.

    ``tokens`` are the documents end to end, ``lengths`` each one's token count. The last
    ``len(tokens) % seq_len`` tokens do not fill a row and are dropped.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise DataError(f"seq_len must be an int >= 1, got {seq_len!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if int(lengths.sum()) != len(tokens):
        raise DataError(f"lengths add up to {int(lengths.sum())} tokens, but {len(tokens)} tokens were given")
    rows = len(tokens) // seq_len
    if rows == 0:
        raise DataError(
            f"the documents hold {len(tokens)} tokens, fewer than one row of seq_len={seq_len}: use a shorter seq_len"
        )
    n = rows * seq_len
    starts = np.cumsum(lengths) - lengths  # each document's first token in the stream
    document_ids = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)[:n]
    position_ids = np.arange(n, dtype=np.int64) - starts[document_ids]
    return {
        "input_ids": np.asarray(tokens[:n], dtype=np.int64).reshape(rows, seq_len),
        "position_ids": position_ids.reshape(rows, seq_len),
        "document_ids": document_ids.reshape(rows, seq_len),
    }


def pack(dataset: Any, seq_len: int, field: str = "input_ids") -> ArrayDataset:
    """Concatenate the documents of ``dataset[field]`` into an ArrayDataset of rows of exactly ``seq_len`` tokens.

    ``dataset`` is a ``datasets.Dataset`` (read column-wise through Arrow, no Python step per row), a map-style
    torch Dataset of dicts or a list of token sequences. Fields: ``input_ids`` (int64), ``position_ids``
    (restarting at 0 where a document starts, continuing across a row boundary) and ``document_ids`` (the
    index of each token's document in ``dataset``). Deterministic; the tail that does not fill a row is
    dropped. The rows are plain array samples: cursor, resume, exact eval and ``Shard(0, balanced=True)`` apply.
    """
    tokens, lengths = _documents(dataset, field)
    return ArrayDataset(pack_arrays(tokens, lengths, seq_len))
