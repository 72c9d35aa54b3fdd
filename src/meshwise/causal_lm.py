"""The conventions of causal language models that the trainer, the evaluator and pipeline stages follow: the
tensor a loss reads from a model output (a transformers ``ModelOutput``'s ``logits``, recognised by its shape, not
by importing transformers), ``ignore_index``, the label shift (``shift_labels``) and the check that tells
unshifted labels apart. Nothing here imports transformers: any model may follow them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from meshwise.errors import MeshwiseError
from meshwise.topology import Topology, resolve

__all__ = ["Batch", "IGNORE_INDEX", "SHIFT_LABELS_KEY", "labels_unshifted", "loss_input", "shift_labels", "target_of"]


Batch = Mapping[str, Any]

IGNORE_INDEX = -100
"""The target value that ``loss_weight="labels"`` does not count: PyTorch's and Hugging Face's ``ignore_index``."""


def loss_input(output: Any) -> Any:
    """What ``loss_fn`` gets of the model's output: a transformers ``ModelOutput``'s ``logits``, else the output.

    A ``ModelOutput`` is a Mapping with ``to_tuple`` (no transformers import needed); plain dicts pass
    through unchanged, since a user's own dict output is the user's convention.
    """
    if isinstance(output, Mapping) and hasattr(output, "to_tuple") and "logits" in output:
        return output["logits"]
    return output


SHIFT_LABELS_KEY = "shift_labels"
"""transformers' batch field of labels already shifted (label ``t`` scores logit ``t``): used as the target."""


def target_of(batch: Batch, target_key: str) -> Any:
    """The target the loss and the metrics score: transformers' ``shift_labels`` field where the batch has one."""
    shifted = batch.get(SHIFT_LABELS_KEY)
    return shifted if isinstance(shifted, torch.Tensor) else batch[target_key]


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
