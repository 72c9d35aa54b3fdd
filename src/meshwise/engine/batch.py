"""Batch preparation shared by the trainer and the evaluator: the user's hook, device moves, rows and micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from meshwise.errors import MeshwiseError

__all__ = ["Batch", "full_tensors", "local_value", "ready_batch", "row_count", "split_rows", "take_rows"]

Batch = Mapping[str, Any]


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
    if not isinstance(batch, Mapping):
        raise error(
            f"the {who} expects dict batches, got {type(batch).__name__}: use meshwise.data.mesh_dataloader "
            "or a prepare= hook returning a dict"
        )
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and v.device != device else v
        for k, v in batch.items()
    }


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


def loss_input(output: Any) -> Any:
    """What ``loss_fn`` gets of the model's output: a transformers ``ModelOutput``'s ``logits``, else the output.

    A ``ModelOutput`` is a Mapping with ``to_tuple`` (no transformers import needed); plain dicts pass
    through unchanged, since a user's own dict output is the user's convention.
    """
    if isinstance(output, Mapping) and hasattr(output, "to_tuple") and "logits" in output:
        return output["logits"]
    return output
