"""``create_trainer``: an ignite Engine whose step trains a model placed on the topology like one process would."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from ignite.engine import Engine
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from meshwise.debug import guarded
from meshwise.errors import MeshwiseError, ParallelError
from meshwise.parallel.apply import (
    _dtensor_params,
    clip_coefficient,
    data_parallel_kind,
    local_norm_contribution,
    scale_grads,
)
from meshwise.topology import Topology

Batch = Mapping[str, Any]
LossWeight = str | Callable[[Batch], int | float | torch.Tensor]


def _resolve_topology(topology: Topology | None) -> Topology:
    if topology is not None:
        return topology
    import meshwise

    topo = meshwise.current()
    if topo is None:
        raise MeshwiseError("no topology: call meshwise.init(...) first or pass topology=")
    return topo


def _rows(batch: Batch, input_key: str) -> int:
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


def _take_rows(batch: Batch, rows: int, index: torch.Tensor | slice) -> dict[str, Any]:
    """Select rows of every tensor field whose axis 0 is the sample axis; other fields pass through."""
    return {
        k: v[index] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v for k, v in batch.items()
    }


def _split(batch: Batch, rows: int, parts: int) -> list[dict[str, Any]]:
    if parts == 1:
        return [dict(batch)]
    if rows < parts:
        raise MeshwiseError(
            f"accumulation_steps={parts} needs at least {parts} samples per rank, the local batch has {rows}: "
            "raise the global batch size or lower accumulation_steps"
        )
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [_take_rows(batch, rows, slice(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]


def ready_batch(
    batch: Any,
    prepare: Callable[[Batch], Batch] | None,
    device: torch.device,
    who: str,
    error: type[MeshwiseError] = MeshwiseError,
) -> dict[str, Any]:
    """Apply the user's ``prepare`` hook, check the batch is a dict, and move only its tensors to ``device``."""
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


def _local_value(loss: torch.Tensor) -> torch.Tensor:
    if isinstance(loss, DTensor):
        if all(isinstance(p, Replicate) for p in loss.placements):
            return loss.to_local().detach()
        return loss.full_tensor().detach()
    return loss.detach()


def create_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    topology: Topology | None = None,
    *,
    grad_clip: float | None = None,
    norm_type: float = 2.0,
    accumulation_steps: int = 1,
    loss_weight: LossWeight = "samples",
    prepare: Callable[[Batch], Batch] | None = None,
    forward: Callable[[nn.Module, Batch], Any] | None = None,
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    input_key: str = "input",
    target_key: str | None = "target",
) -> Engine:
    """An ignite ``Engine`` whose step trains ``model`` on one local batch per iteration, like one process would.

    Each iteration takes this rank's batch (a dict; ``valid`` False rows are excluded), applies
    ``prepare(batch)``, splits it into ``accumulation_steps`` micro-batches, and for each runs
    ``output = forward(model, micro)`` (default ``model(micro[input_key])``) and
    ``loss = loss_fn(output, micro[target_key])`` (``loss_fn(output, micro)`` when ``target_key`` is None),
    inside ``step_context()`` if given (e.g. ``torch.distributed.tensor.parallel.loss_parallel``), then
    backward. ``loss_fn`` must return the mean over the units that ``loss_weight`` counts:
    ``"samples"`` (rows), ``"tokens"`` (elements of the target) or ``callable(micro) -> count``.
    Gradients are those of the mean over the *global* batch; with ``grad_clip`` they are clipped by
    their global norm (``norm_type``) across every mesh. ``engine.state.output`` is the global mean
    loss as a float, the same on every rank (``nan`` if the global batch had no valid row: the step
    is then skipped). Nothing is moved except to ``topology.device``.
    """
    topo = _resolve_topology(topology)
    if not isinstance(model, nn.Module):
        raise MeshwiseError(f"create_trainer() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MeshwiseError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise MeshwiseError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
        raise MeshwiseError(f"grad_clip must be a positive number or None, got {grad_clip!r}")
    if not (callable(loss_weight) or loss_weight in ("samples", "tokens")):
        raise MeshwiseError(f"loss_weight must be 'samples', 'tokens' or a function of the batch, got {loss_weight!r}")
    if loss_weight == "tokens" and target_key is None:
        raise MeshwiseError("loss_weight='tokens' counts the elements of batch[target_key]: set target_key")
    if topo.size(topo.stage_dims) > 1:
        raise ParallelError(
            f"create_trainer() does not run pipeline stages (mesh dims {topo.stage_dims}): use a mesh without a "
            "'stage' dim"
        )
    metric_dims = topo.metric_dims
    data_parallel = topo.size(metric_dims)
    kind = data_parallel_kind(model)
    if kind == "ddp" and _dtensor_params(model):
        raise ParallelError(
            "the model is DistributedDataParallel with tensor-parallel parameters, which loses them after the "
            "first forward (PITFALLS.md): build it with meshwise.parallelize(model, topo, tp_plan=..., dp='replicate')"
        )
    if kind == "legacy-replicate":
        raise ParallelError(
            "the model uses torch.distributed._composable.replicate (wrong gradients beside TP): use "
            "meshwise.parallelize(model, topo, dp='replicate')"
        )
    if data_parallel > 1 and kind is None:
        raise ParallelError(
            f"the model is not data parallel over the metric dims {metric_dims} ({data_parallel} ranks), so their "
            "gradients would never be averaged: call meshwise.parallelize(model, topo) first"
        )

    params = [p for p in model.parameters() if p.requires_grad]
    device = topo.device
    metric_group = topo.group(metric_dims) if data_parallel > 1 else None
    # The fused reduction for clipping runs over the world; count and loss are identical on the replica ranks.
    replica_copies = topo.world_size // data_parallel
    no_sync = accumulation_steps > 1 and hasattr(model, "set_requires_gradient_sync")
    run_forward = forward or (lambda m, b: m(b[input_key]))
    context = step_context or contextlib.nullcontext
    max_norm = None if grad_clip is None else float(grad_clip)
    # Backward runs on loss * count * data_parallel / reference: gradients arrive scaled by
    # (global count / reference), fixed afterwards in the same pass as clipping. The reference is the
    # previous step's global count (the same on every rank), so for steady batches no pass is needed.
    reference = [1.0]

    def count_of(micro: Batch) -> float:
        if loss_weight == "samples":
            return float(_rows(micro, input_key))
        if loss_weight == "tokens":
            return float(micro[target_key].numel())
        value = loss_weight(micro)
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def step(engine: Engine, batch: Batch) -> float:
        # Every rank takes part in some collective of a step (FSDP, TP, the loss reduction): if one fails, the
        # error names the step and the ranks that never started it, e.g. one that left its loop early.
        with guarded(topo, topo.dims, "trainer step", step=engine.state.iteration, region=True):
            return train_step(engine, batch)

    def train_step(engine: Engine, batch: Batch) -> float:
        if not model.training:
            model.train()
        batch = ready_batch(batch, prepare, device, "trainer")
        rows = _rows(batch, input_key)
        micros = _split(batch, rows, accumulation_steps)
        optimizer.zero_grad(set_to_none=True)
        local_count, loss_sum = 0.0, None
        for j, micro in enumerate(micros):
            n = _rows(micro, input_key)
            valid = micro.get("valid")
            empty = False
            if isinstance(valid, torch.Tensor) and not bool(valid.all()):
                if bool(valid.any()):
                    micro = _take_rows(micro, n, valid)
                else:  # every rank must still run forward/backward (collectives inside); weight 0
                    micro, empty = _take_rows(micro, n, slice(0, 1)), True
            count = 0.0 if empty else count_of(micro)
            if no_sync:
                model.set_requires_gradient_sync(j == len(micros) - 1)
            with context():
                output = run_forward(model, micro)
                loss = loss_fn(output, micro if target_key is None else micro[target_key])
                if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                    raise MeshwiseError(
                        f"loss_fn returned {shape}, not a scalar tensor: return the mean over the batch "
                        "(e.g. reduction='mean'); meshwise weights it by the sample or token count itself"
                    )
                scale = count * data_parallel / reference[0]
                (loss if scale == 1.0 else loss * scale).backward()
            if count:
                local_count += count
                weighted = _local_value(loss).double() * count
                loss_sum = weighted if loss_sum is None else loss_sum + weighted
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        grads = [p.grad for p in params if p.grad is not None]
        if max_norm is not None and not math.isinf(norm_type):
            # One reduction for count, loss and the norm: every entry is divided by its number of copies.
            norm_part = local_norm_contribution(grads, topo, norm_type)
            vec = torch.stack([loss_sum.new_tensor(local_count) / replica_copies, loss_sum / replica_copies, norm_part])
            if topo.world_size > 1:
                dist.all_reduce(vec)
            count, loss_total, norm_power = vec.tolist()
        else:
            if metric_group is not None:
                vec = torch.stack([loss_sum.new_tensor(local_count), loss_sum])
                dist.all_reduce(vec, group=metric_group)
                count, loss_total = vec.tolist()
            else:
                count, loss_total = local_count, loss_sum.item()
            if max_norm is not None:
                peak = local_norm_contribution(grads, topo, norm_type)
                if topo.world_size > 1:
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                norm_power = peak.item()
        if count <= 0:
            engine.state.global_count = 0.0
            return math.nan
        factor = reference[0] / count
        if max_norm is not None:
            norm = (norm_power if math.isinf(norm_type) else max(norm_power, 0.0) ** (1.0 / norm_type)) * factor
            engine.state.grad_norm = norm
            factor *= clip_coefficient(norm, max_norm)
        scale_grads(grads, factor)
        reference[0] = count
        optimizer.step()
        engine.state.global_count = count
        return loss_total / count

    engine = Engine(step)
    engine.topology = topo  # type: ignore[attr-defined]
    return engine
