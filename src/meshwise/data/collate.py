"""The default collate of map-style samples: stack equal shapes, pad variable-length 1-D fields, add a mask."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch

from meshwise.data.sources import RESERVED, torch_dtype
from meshwise.errors import DataError

__all__ = ["as_fields", "pad_collate"]

LABEL_PAD = -100  # the ignore_index of torch.nn.functional.cross_entropy


def as_fields(sample: Any) -> dict[str, Any]:
    """A sample as named fields: a dict as is, a tuple/list as ``"0"``, ``"1"``, ..., anything else as ``"input"``."""
    if isinstance(sample, Mapping):
        clash = [k for k in sample if k in RESERVED]
        if clash:
            raise DataError(f"sample fields {clash} are reserved for the loader's batch keys {RESERVED}: rename them")
        return dict(sample)
    if isinstance(sample, (tuple, list)) and not _is_number_list(sample):
        return {str(i): v for i, v in enumerate(sample)}
    return {"input": sample}


def _is_number_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, (int, float, np.number)) for v in value)


def _as_tensor(name: str, value: Any) -> torch.Tensor | None:
    """A field value as a tensor (token lists become int64), or ``None`` for values that are not numeric."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return torch.from_numpy(np.ascontiguousarray(value).astype(_np_twin(value.dtype), copy=False))
    if isinstance(value, (bool, int, float, np.number)) or _is_number_list(value):
        return torch.as_tensor(value)  # Python ints become int64: embedding and loss kernels want that
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, list) for v in value):
        try:
            return torch.as_tensor(value)
        except (ValueError, TypeError):
            raise DataError(f"field {name!r} is a ragged nested list: give it as a 1-D list per sample") from None
    return None


def _int_lists(values: list[Any]) -> tuple[torch.Tensor, list[int]] | None:
    """A field whose samples are all lists of Python ints: every token as one int64 tensor and each sample's length.

    The per-field fast path: one ``map(type, ...)`` and one ``np.fromiter`` over the tokens end to end, both in C
    (no Python step per token). ``None`` for anything else (floats, bools, numpy scalars, empty fields), which
    the per-sample path below handles.
    """
    if not all(type(v) is list for v in values):
        return None
    if set(map(type, chain.from_iterable(values))) != {int}:
        return None
    lengths = [len(v) for v in values]
    try:
        tokens = np.fromiter(chain.from_iterable(values), dtype=np.int64, count=sum(lengths))
    except OverflowError:  # ints past int64: the per-sample path says what torch makes of them
        return None
    return torch.from_numpy(tokens), lengths


def _np_twin(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.int64) if torch_dtype(dtype) == torch.int64 else dtype


def pad_collate(
    samples: Sequence[Any],
    *,
    pad_to: int | None = None,
    pad_value: float | Mapping[str, float] | None = None,
    mask_field: str = "input_ids",
) -> dict[str, Any]:
    """Join samples into a dict batch: equal shapes are stacked, 1-D fields of different lengths padded.

    Variable-length 1-D fields are right-padded to the batch's longest (or to ``pad_to``, which then pads
    every 1-D field): ``labels`` with ``-100`` (cross-entropy's ignore index), other fields with 0, or with
    ``pad_value`` (a number for every field but ``labels``, or a mapping field -> number). ``attention_mask``
    (int64, 1 = real token) is added for ``mask_field`` when it is 1-D, else for the first padded field,
    unless a sample has one.
    Non-numeric fields (strings, ...) are kept as lists. Shapes that no padding can join raise a DataError.
    """
    if not samples:
        raise DataError("pad_collate got no samples")
    rows = [as_fields(s) for s in samples]
    names = list(rows[0])
    for i, row in enumerate(rows):
        if list(row) != names:
            raise DataError(
                f"sample {i} has fields {sorted(row)}, sample 0 has {sorted(names)}: give every sample the same fields"
            )
    if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1):
        raise DataError(f"pad_to must be an int >= 1, got {pad_to!r}")
    out: dict[str, Any] = {}
    lengths: dict[str, torch.Tensor] = {}
    for name in names:
        raw = [row[name] for row in rows]
        ints = _int_lists(raw)
        if ints is not None:  # token id lists: joined and padded as one tensor
            tokens, sizes = ints
            if len(set(sizes)) == 1 and pad_to is None:
                out[name] = tokens.view(len(rows), sizes[0])
                continue
            longest = max(sizes)
            width = longest if pad_to is None else pad_to
            _check_width(name, longest, width, pad_to)
            lengths[name] = torch.tensor(sizes)
            out[name] = _padded(tokens, lengths[name], width, _fill(name, pad_value), torch.int64)
            continue
        values = [_as_tensor(name, v) for v in raw]
        if any(v is None for v in values):
            out[name] = [row[name] for row in rows]
            continue
        shapes = {tuple(v.shape) for v in values}
        one_d = all(v.dim() == 1 for v in values)
        if len(shapes) == 1 and not (one_d and pad_to is not None):
            out[name] = torch.stack(values)
            continue
        if not one_d:
            raise DataError(
                f"field {name!r} has samples of shapes {sorted(shapes)}: only 1-D fields are padded; give it one "
                "shape, or pass collate_fn= that joins it"
            )
        longest = max(len(v) for v in values)
        width = longest if pad_to is None else pad_to
        _check_width(name, longest, width, pad_to)
        dtype = values[0].dtype
        lengths[name] = torch.tensor([len(v) for v in values])
        tokens = torch.cat([v.to(dtype) for v in values])  # each sample cast first, as to the first one's dtype
        out[name] = _padded(tokens, lengths[name], width, _fill(name, pad_value), dtype)
    if "attention_mask" not in out:
        key = mask_field if mask_field in lengths else next(iter(lengths), None)
        if key is None and isinstance(out.get(mask_field), torch.Tensor) and out[mask_field].dim() == 2:
            out["attention_mask"] = torch.ones_like(out[mask_field], dtype=torch.int64)  # keys stay the same each step
        elif key is not None:
            width = out[key].shape[1]
            out["attention_mask"] = (torch.arange(width) < lengths[key][:, None]).to(torch.int64)
    return out


def _check_width(name: str, longest: int, width: int, pad_to: int | None) -> None:
    if longest > width:
        raise DataError(
            f"field {name!r} has a sample of {longest} elements, longer than pad_to={pad_to}: raise pad_to or truncate"
        )


def _padded(tokens: torch.Tensor, lengths: torch.Tensor, width: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[len(lengths), width]`` filled with ``fill``; row i starts with its ``lengths[i]`` tokens.

    One slice copy a row (a boolean-mask assignment costs more than all of them: it builds an index per cell).
    """
    batch = torch.full((len(lengths), width), fill, dtype=dtype)
    for row, piece in zip(batch, torch.split(tokens, lengths.tolist())):
        row[: len(piece)] = piece
    return batch


def _fill(name: str, pad_value: float | Mapping[str, float] | None) -> float:
    if isinstance(pad_value, Mapping) and name in pad_value:
        return pad_value[name]
    if name == "labels":  # a plain number pads the inputs; labels keep the loss's ignore index
        return LABEL_PAD
    return pad_value if pad_value is not None and not isinstance(pad_value, Mapping) else 0
