"""Batch preparation shared by the trainer and the evaluator: the user's hook, device moves, rows and micro-batches,
and the causal-LM label shift (``shift_labels``) with the check that tells unshifted labels apart."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from meshwise.errors import MeshwiseError
from meshwise.topology import Topology, resolve

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "full_tensors",
    "labels_unshifted",
    "local_value",
    "ready_batch",
    "row_count",
    "shift_labels",
    "split_rows",
    "take_rows",
]

Batch = Mapping[str, Any]

IGNORE_INDEX = -100
"""The target value that ``loss_weight="labels"`` does not count: PyTorch's and Hugging Face's ``ignore_index``."""


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


def shift_labels(
    batch: Batch, topology: Topology | None = None, *, key: str = "target", ignore_index: int = IGNORE_INDEX
) -> dict[str, Any]:
    """``batch`` with ``batch[key]`` shifted as a causal-LM loss needs: label ``t + 1`` scores logit ``t``.

    Hugging Face's own shift (``ForCausalLMLoss``), done on the batch instead of inside the loss: row ``r`` becomes
    ``labels[r, 1:]`` followed by ``ignore_index``. Meant as the trainer's hook for the ``labels = input_ids``
    habit: ``create_trainer(..., prepare=shift_labels, loss_weight="labels")`` (for other key names
    ``prepare=functools.partial(shift_labels, key="labels")``) with a ``loss_fn`` that does not shift. A batch
    without ``key`` (a pipeline stage that does not read the labels) passes through unchanged. Under a split
    (context-parallel) dim of size > 1 a rank holds chunks of each sequence, whose last label belongs to another
    rank: refused (:class:`MeshwiseError`); shift before the split instead (a ``shift_labels`` field in the data).
    """
    labels = batch.get(key)
    if not isinstance(labels, torch.Tensor):
        return dict(batch)
    topo = resolve(topology)
    if topo.size(topo.split_dims) > 1:
        raise MeshwiseError(
            f"shift_labels cannot shift batch[{key!r}] here: the split dims {topo.split_dims} give each rank chunks "
            "of every sequence, and a chunk's last label is the first token of the next chunk, on another rank. "
            "Shift before the tokens are split: store the shifted labels in the dataset (a 'shift_labels' field, "
            "which the trainer uses as the target, or input = w[:, :-1] and target = w[:, 1:]; docs/context.md)"
        )
    if labels.ndim < 2:
        raise MeshwiseError(
            f"shift_labels needs batch[{key!r}] of shape [batch, sequence], got {tuple(labels.shape)}: it shifts "
            "each row's labels by one token"
        )
    pad = labels.new_full((*labels.shape[:1], 1, *labels.shape[2:]), ignore_index)
    return {**batch, key: torch.cat([labels[:, 1:], pad], dim=1)}


def labels_unshifted(batch: Batch, input_key: str, target_key: str, ignore_index: int = IGNORE_INDEX) -> bool | None:
    """Whether ``batch``'s targets are its inputs (``labels = input_ids``) rather than the next tokens.

    True when every scored target (not ``ignore_index``) equals the input at its own position and, where token
    ``t + 1`` follows token ``t`` (the batch's ``positions`` say so under context parallel; else neighbours do),
    targets break the shift (target ``t`` = input ``t + 1``) more often than they keep it. Shifted targets keep
    it everywhere but at a chunk's border, so they are never called unshifted. False when some scored target
    differs from its input. None (undecided) where both readings fit (runs of one repeated token), without
    integer ``[batch, sequence]`` inputs and targets of one shape (``input_key`` or ``input_ids``: e.g. a
    pipeline stage that does not read the inputs), or without a scored target.
    """
    target = batch.get(target_key)
    if not isinstance(target, torch.Tensor) or target.ndim < 2 or target.is_floating_point():
        return None
    inputs = next(
        (
            v
            for v in (batch.get(input_key), batch.get("input_ids"))
            if isinstance(v, torch.Tensor) and v.shape == target.shape and not v.is_floating_point()
        ),
        None,
    )
    if inputs is None:
        return None
    valid = batch.get("valid")
    keep = valid.bool() if isinstance(valid, torch.Tensor) and valid.shape[:1] == target.shape[:1] else slice(None)
    target, inputs = target[keep], inputs[keep]
    scored = target != ignore_index
    if not bool(scored.any()):
        return None
    if not bool((target == inputs)[scored].all()):
        return False
    pairs = scored[:, :-1]
    positions = batch.get("positions")
    if isinstance(positions, torch.Tensor) and positions.shape == batch[target_key].shape:
        positions = positions[keep]
        pairs = pairs & (positions[:, 1:] == positions[:, :-1] + 1)
    kept = int((pairs & (target[:, :-1] == inputs[:, 1:])).sum())
    broken = int(pairs.sum()) - kept
    return True if broken > kept else None  # else mostly repeated tokens: both readings fit
