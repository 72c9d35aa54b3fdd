"""Parameters several pipeline stages hold (a tied embedding and head): found at the cut, their copies checked
to be placed alike, their gradients summed over the stages holding them before each optimizer step, and marked
so the global gradient norm counts them once (Megatron-LM's embedding group, over the stage dim)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshwise.errors import ParallelError

__all__ = ["STAGE_COPIES", "SharedParameter", "check_shared", "find_shared", "sum_shared_grads"]

STAGE_COPIES = "meshwise_stage_copies"
"""The attribute a shared parameter (and its gradient after :func:`sum_shared_grads`) carries: how many stages
hold an identical copy of it. :func:`meshwise.parallel.clipping.local_norm_contribution` divides by it."""


@dataclass
class SharedParameter:
    """One parameter held by several stages: ``(stage, name)`` of its copy in each (the first name it has there),
    and, once checked, the local shape and dtype of every copy (the same on each stage)."""

    names: tuple[tuple[int, str], ...]
    local_shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    @property
    def stages(self) -> list[int]:
        return [s for s, _ in self.names]

    def text(self) -> str:
        return " and ".join(f"{n!r} (stage {s})" for s, n in self.names)


def _stage_of(name: str, owner: dict[str, int]) -> int | None:
    """The stage holding parameter ``name``: the stage of the longest unit that is a prefix of it."""
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        stage = owner.get(".".join(parts[:k]))
        if stage is not None:
            return stage
    return None


def find_shared(model: nn.Module, units: Sequence[Sequence[str]]) -> list[SharedParameter]:
    """The parameters of ``model`` that the cut ``units`` (the pieces of each stage) puts on several stages.

    Read before any stage drops a piece: one ``Parameter`` reachable under names in different stages (nanoGPT's
    and GPT-2's ``transformer.wte.weight`` / ``lm_head.weight``, a transformers model with
    ``tie_word_embeddings=True``). Each stage's deep copy then holds its own copy, equal at the start.
    """
    owner = {u: i for i, stage in enumerate(units) for u in stage}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    shared = []
    for group in names.values():
        by_stage: dict[int, str] = {}
        for name in group:
            stage = _stage_of(name, owner)
            if stage is not None:
                by_stage.setdefault(stage, name)
        if len(by_stage) > 1:
            shared.append(SharedParameter(tuple(sorted(by_stage.items()))))
    return shared


def _describe(p: torch.Tensor) -> tuple:
    """What must agree between two copies for their local gradients to add up: placements and shapes."""
    if isinstance(p, DTensor):
        return (str(p.device_mesh.mesh_dim_names), str(p.placements), tuple(p.to_local().shape), str(p.dtype))
    return ("", "", tuple(p.shape), str(p.dtype))


def check_shared(
    shared: list[SharedParameter], module: nn.Module, stages: Sequence[int], group: dist.ProcessGroup
) -> None:
    """Check that every stage placed its copy of each shared parameter alike, record the local shape, mark them.

    One ``all_gather_object`` over the stage group at :func:`meshwise.parallelize` (only when a parameter is
    shared). Copies sharded differently (an embedding split one way by ``tp_plan``, the head another) cannot
    have their local gradients summed: refused on every stage alike, naming the parameter and the stages.
    """
    mine = {}
    for entry in shared:
        for stage, name in entry.names:
            if stage in stages:
                p = module.get_parameter(name)
                setattr(p, STAGE_COPIES, len(entry.names))
                mine[(stage, name)] = _describe(p)
    everyone: list[dict] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, mine, group=group)
    seen = {k: v for part in everyone for k, v in part.items()}
    for entry in shared:
        kinds = {seen[key] for key in entry.names}
        if len(kinds) != 1:
            found = "; ".join(
                f"stage {s}: mesh {seen[(s, n)][0]}, {seen[(s, n)][1]}, local shape {seen[(s, n)][2]}"
                for s, n in entry.names
            )
            raise ParallelError(
                f"the parameter shared by {entry.text()} (one Parameter under those names, e.g. a tied embedding "
                f"and head) is placed differently on the stages holding it ({found}): meshwise sums its gradient "
                "over those stages, which needs each copy split alike. Give both the same tensor-parallel split "
                "(nn.Embedding with RowwiseParallel() and the head nn.Linear with ColwiseParallel() both shard "
                "the vocabulary dim) or leave both out of tp_plan, or untie them"
            )
        _, _, shape, _ = kinds.pop()
        entry.local_shape = shape
        entry.dtype = module_dtype(seen[entry.names[0]][3])


def module_dtype(text: str) -> torch.dtype:
    """The dtype named by ``str(dtype)`` (``"torch.float64"``)."""
    return getattr(torch, text.rsplit(".", 1)[-1])


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """The local shard of ``p.grad`` laid out as ``p`` is (a tensor-parallel gradient may come back Partial or
    Replicate where the parameter is Shard)."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local() if isinstance(g, DTensor) else g


def _set_grad(p: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` (a local shard laid out as ``p``) the gradient of ``p``."""
    if isinstance(p, DTensor):
        p.grad = DTensor.from_local(value.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    elif p.grad is None:
        p.grad = value.clone()
    else:
        p.grad.copy_(value)


def sum_shared_grads(
    shared: list[SharedParameter],
    module: nn.Module,
    stages: Sequence[int],
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
    """Sum each shared parameter's gradient over the stages holding it, in place on every copy (after backward,
    after data parallel reduced it, before clipping and the optimizer step).

    One all-reduce over the stage group of every shared gradient's local shard: a rank holding no copy adds
    zeros, a rank holding two (interleaved stages) adds both. Each gradient is then marked with
    :data:`STAGE_COPIES` so the global norm counts it once.
    """
    if not shared:
        return
    held, parts = [], []
    for entry in shared:
        params = [module.get_parameter(n) for s, n in entry.names if s in stages]
        grads = [_local_grad(p) for p in params if p.grad is not None]
        total = torch.zeros(entry.local_shape, dtype=entry.dtype, device=device)
        for g in grads:
            total = total + g
        held.append((entry, params))
        parts.append(total.reshape(-1))
    flat = torch.cat(parts)
    dist.all_reduce(flat, group=group)
    offset = 0
    for (entry, params), part in zip(held, parts):
        value = flat[offset : offset + part.numel()].view(entry.local_shape)
        offset += part.numel()
        for p in params:
            _set_grad(p, value)
            setattr(p.grad, STAGE_COPIES, len(entry.names))
