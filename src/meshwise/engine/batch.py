"""Batch preparation shared by the trainer and the evaluator: the user's hook, device moves, rows and micro-batches,
and plain values of DTensor losses and outputs (the causal-LM label conventions are in :mod:`meshwise.causal_lm`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from meshwise.causal_lm import Batch
from meshwise.errors import MeshwiseError

__all__ = [
    "full_tensors",
    "positional_fields",
    "local_value",
    "ready_batch",
    "row_count",
    "split_rows",
    "take_rows",
]


def ready_batch(
    batch: Any,
    prepare: Callable[[Batch], Batch] | None,
    device: torch.device,
    who: str,
    error: type[MeshwiseError] = MeshwiseError,
) -> dict[str, Any]:
    """Apply the user's ``prepare`` hook, check the batch is a dict, and move only its tensors to ``device``.

    ``who`` ("trainer", "evaluator") names the engine in the message; ``error`` is the class raised.
    """
    if prepare is not None:
        batch = prepare(batch)
    batch = positional_fields(batch, who, error)
    if not isinstance(batch, Mapping):
        raise error(
            f"the {who} expects dict batches, got {type(batch).__name__}: use meshwise.data.mesh_dataloader "
            "or a prepare= hook returning a dict"
        )
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and v.device != device else v
        for k, v in batch.items()
    }


_KEPT = ("valid", "index")  # what mesh_dataloader adds to a sample's own fields


def positional_fields(batch: Any, who: str, error: type[MeshwiseError] = MeshwiseError) -> Any:
    """Tuple samples (``TensorDataset``) named: a batch of two positional fields (a tuple/list, or
    ``mesh_dataloader``'s ``"0"``, ``"1"``) becomes ``{"input": ..., "target": ...}``; more than two are refused
    with the keys to pass. Any other batch is returned as is."""
    if isinstance(batch, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in batch):
        batch = {str(i): v for i, v in enumerate(batch)}
    elif not isinstance(batch, Mapping):
        return batch
    own = [k for k in batch if k not in _KEPT]
    if not own or not all(isinstance(k, str) and k.isdigit() for k in own):
        return batch
    if len(own) == 2:
        return {"input": batch["0"], "target": batch["1"], **{k: batch[k] for k in _KEPT if k in batch}}
    names = ", ".join(repr(k) for k in own)
    raise error(
        f"the {who}'s samples are tuples of {len(own)} unnamed fields ({names}: a TensorDataset), so it cannot tell "
        f"which is the input and which the target: name them with prepare=lambda b: {{'input': b['0'], "
        f"'target': b['1'], ...}} (input_key=/target_key= choose the names read), or give the loader dict samples "
        "(meshwise.data.ArrayDataset({'input': x, 'target': y}))"
    )


def row_count(batch: Batch, input_key: str) -> int:
    """The number of samples of ``batch``: the length of ``valid``, else of ``batch[input_key]``, else of any tensor."""
    valid = batch.get("valid")
    if isinstance(valid, torch.Tensor):
        return int(valid.shape[0])
    first = batch.get(input_key)
    if not isinstance(first, torch.Tensor):
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim), None)
    if first is None or first.ndim == 0:
        raise MeshwiseError(
            f"cannot tell the batch size: the batch has no tensor {input_key!r} (or 'valid'); give the batch a "
            "tensor field with samples on axis 0, or a prepare= hook that builds one"
        )
    return int(first.shape[0])


def take_rows(batch: Batch, rows: int, index: torch.Tensor | slice) -> dict[str, Any]:
    """Select rows of every tensor field whose axis 0 is the sample axis (length ``rows``); others pass through."""
    return {
        k: v[index] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v for k, v in batch.items()
    }


def split_rows(batch: Batch, rows: int, parts: int) -> list[dict[str, Any]]:
    """``batch`` cut along the sample axis into ``parts`` micro-batches of nearly equal size, in order."""
    if parts == 1:
        return [dict(batch)]
    if rows < parts:
        raise MeshwiseError(
            f"accumulation_steps={parts} needs at least {parts} samples per rank, the local batch has {rows}: "
            "raise the global batch size or lower accumulation_steps"
        )
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [take_rows(batch, rows, slice(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor holding a loss's value (a replicated DTensor's local copy, else its full value)."""
    if isinstance(loss, DTensor):
        if all(isinstance(p, Replicate) for p in loss.placements):
            return loss.to_local().detach()
        return loss.full_tensor().detach()
    return loss.detach()


def full_tensors(value: Any) -> Any:
    """Model outputs as plain tensors: a DTensor becomes its full value (a collective every TP rank makes)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, Mapping):
        return {k: full_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full_tensors(v) for v in value)
    return value
