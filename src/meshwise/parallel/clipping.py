"""The global gradient norm over every mesh dim (each gradient counted once however many ranks hold it) and
clipping by it: ``clip_grad_norm`` and the pieces the trainer's own step uses.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from meshwise import compat
from meshwise.errors import ParallelError
from meshwise.parallel.pipeline_shared import STAGE_COPIES
from meshwise.topology import Topology, resolve

__all__ = [
    "SHARDS",
    "clip_coefficient",
    "clip_grad_norm",
    "grads_of",
    "local_norm_contribution",
    "norm_from_power",
    "on_shard_count",
    "scale_grads",
]

SHARDS = "meshwise_shards"
"""The attribute a plain (not DTensor) gradient carries when its parameter is one of that many distinct shards of
one tensor, each held alike by the ranks of the other dims (Megatron's tensor-parallel weights): counted once each."""

_SHARD_RULES: list[Callable[[torch.Tensor], int]] = []


def on_shard_count(rule: Callable[[torch.Tensor], int]) -> None:
    """Register ``rule(parameter) -> shards`` (1: a copy), asked by :func:`grads_of` for every plain parameter:
    how an integration whose layers split plain tensors themselves (``meshwise.megatron``) names its shards."""
    if rule not in _SHARD_RULES:
        _SHARD_RULES.append(rule)


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params`` that exist, each plain one marked with :data:`SHARDS` where a registered rule
    says its parameter is a shard (what the trainer and :func:`clip_grad_norm` measure)."""
    if "megatron.core" in sys.modules:  # Megatron's layers split plain tensors: load its integration's rule
        importlib.import_module("meshwise.megatron")
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if _SHARD_RULES and not isinstance(g, DTensor):
            setattr(g, SHARDS, max(rule(p) for rule in _SHARD_RULES))
        grads.append(g)
    return grads


# --------------------------------------------------------------------------- global gradient norm


def _grads(params: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        params = [params]
    return grads_of(params)


def _replication(grad: torch.Tensor, holders: int) -> tuple[torch.Tensor, float]:
    """The local shard to measure and how many ranks hold an identical copy of it.

    ``holders`` ranks hold the parameter (the world, or one pipeline stage of it). A DTensor's shard
    is distinct along the mesh dims where it is ``Shard``; a ``Partial`` grad is first reduced.
    """
    if not isinstance(grad, DTensor):
        return grad, float(holders)
    if any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    mesh = grad.device_mesh
    # Anything neither Replicate nor Partial splits the tensor: Shard, and FSDP2's _StridedShard (no Shard subclass)
    distinct = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if not p.is_replicate())
    return grad.to_local(), holders / distinct


def local_norm_contribution(grads: Sequence[torch.Tensor], topology: Topology, norm_type: float) -> torch.Tensor:
    """This rank's share of ``sum |g|^p`` (float64 scalar): summed over the world it gives the global value.

    Every shard's power-sum is divided by the number of ranks holding an identical copy, so one
    all-reduce over the world counts every distinct element exactly once, whatever mesh it lives on.
    For ``norm_type=inf`` it is the local max instead (combine with a MAX reduction). A gradient that several
    pipeline stages hold (a tied embedding and head, summed over them by the trainer) carries ``STAGE_COPIES``
    and is counted once; a plain gradient marked :data:`SHARDS` (by :func:`grads_of`) is that many distinct shards.
    """
    holders = topology.world_size // topology.size(topology.stage_dims)
    buckets: dict[float, list[torch.Tensor]] = {}
    for g in grads:
        local, copies = _replication(g, holders * getattr(g, STAGE_COPIES, 1) / getattr(g, SHARDS, 1))
        if local.numel():
            buckets.setdefault(copies, []).append(local)
    device = topology.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for copies, tensors in buckets.items():
        if math.isinf(norm_type):
            norms = compat.foreach_norm(tensors, math.inf)
            total = torch.maximum(total, torch.stack(norms).max().to(device, torch.float64))
        else:
            norms = compat.foreach_norm(tensors, norm_type)
            part = torch.stack([n.to(device, torch.float64) for n in norms]).pow(norm_type).sum()
            total = total + part / copies
    return total


def scale_grads(grads: Sequence[torch.Tensor], factor: float) -> None:
    """Multiply gradients (DTensor or plain) in place by one number."""
    if factor == 1.0:
        return
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    locals_ = [t for t in locals_ if t.numel()]
    if locals_:
        compat.foreach_mul_(locals_, factor)


def norm_from_power(power: float, norm_type: float) -> float:
    """The global norm from the world sum of :func:`local_norm_contribution` (for ``inf``: the world max)."""
    return power if math.isinf(norm_type) else max(power, 0.0) ** (1.0 / norm_type)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch's ``clip_grad_norm_`` rule: ``max_norm / (norm + 1e-6)``, never above 1."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def clip_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    topology: Topology | None = None,
    *,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients in place by their global ``norm_type``-norm over the whole topology; returns that norm.

    Works on any mix of plain, tensor-parallel and FSDP2 (+TP) gradients (torch's ``clip_grad_norm_``
    fails on those: docs/torch.md, "Gradient clipping"): each shard is counted once however many ranks
    hold it. Every rank must call it. Plain-tensor gradients are taken to be identical on every rank that
    holds the parameter. ``topology`` defaults to the current one.
    """
    topology = resolve(topology)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ParallelError(f"norm_type must be positive (or inf), got {norm_type}")
    grads = _grads(parameters)
    value = local_norm_contribution(grads, topology, norm_type)
    if topology.world_size > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(value, op=op)
    norm = norm_from_power(float(value), norm_type)
    if error_if_nonfinite and not math.isfinite(norm):
        raise ParallelError(
            f"the global gradient {norm_type}-norm is {norm}: the loss or a gradient is not finite; lower the "
            "learning rate, check the inputs, or pass error_if_nonfinite=False to clip anyway"
        )
    scale_grads(grads, clip_coefficient(norm, float(max_norm)))
    return value.new_tensor(norm, dtype=torch.float32)
