"""Place a model on the topology (torch's TP plan over the replica dim, FSDP2/replicate over the metric dims)
and clip gradients by their global norm across every mesh they live on."""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from meshwise import compat
from meshwise.dryrun import note_advice, note_model
from meshwise.errors import ParallelError, PlacementWarning
from meshwise.parallel.pipeline import Cut, check_schedule, pipeline_of, split_model, stage_plan
from meshwise.parallel.pipeline_shared import STAGE_COPIES
from meshwise.parallel.precision import (
    ActivationCheckpointing,
    Precision,
    apply_activation_checkpointing,
    apply_compile,
    attach_precision,
    block_names,
    check_compiler,
    check_precision,
    checkpointed_modules,
    precision_policy,
)
from meshwise.topology import Topology, resolve

__all__ = [
    "DP_MODES",
    "FsdpUnits",
    "check_data_parallel",
    "check_tp_plan",
    "clip_coefficient",
    "clip_grad_norm",
    "data_parallel_kind",
    "dtensor_params",
    "fsdp_unit_names",
    "local_norm_contribution",
    "norm_from_power",
    "on_parallelize",
    "parallelize",
    "reshard",
    "scale_grads",
]

DP_MODES = ("fsdp", "replicate", "none")

FsdpUnits = Sequence[str | nn.Module] | Callable[[str, nn.Module], bool] | type | tuple[type, ...]


# --------------------------------------------------------------------------- inspection helpers


def _state_kind(module: nn.Module) -> str | None:
    """'fsdp', 'replicate' (replicate_with_fsdp), 'legacy-replicate', 'ddp' or None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "ddp"
    if isinstance(module, FSDPModule):
        return "replicate" if isinstance(module, compat.replicate_module_type()) else "fsdp"
    if compat.LEGACY_REPLICATE_KEY in compat.composable_registry(module):  # legacy replicate (a DDP underneath)
        return "legacy-replicate"
    return None


def data_parallel_kind(model: nn.Module) -> str | None:
    """How ``model`` (or any of its submodules) is data parallel: 'fsdp', 'replicate', 'ddp', ... or None."""
    for module in _all_modules(model):
        kind = _state_kind(module)
        if kind is not None:
            return kind
    return None


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back into its sharded state.

    A forward without backward (an evaluation) leaves FSDP2's root unsharded: ``parameters()`` are then
    not the tensors the optimizer holds, and a state dict would see the gathered ones.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in _all_modules(model):
        if isinstance(module, FSDPModule):
            module.reshard()


def _all_modules(model: nn.Module) -> list[nn.Module]:
    """``model.modules()``, and for a pipelined model also its stage modules (the FSDP roots are those)."""
    pipeline = pipeline_of(model)
    stages = [m for stage in pipeline.stage_modules for m in stage.modules()] if pipeline else []
    return [*stages, *model.modules()]


def dtensor_params(model: nn.Module) -> list[tuple[str, DTensor]]:
    """``(name, parameter)`` of every DTensor (tensor-parallel) parameter of ``model``."""
    return [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]


def check_data_parallel(model: nn.Module) -> str | None:
    """How ``model`` is data parallel (see :func:`data_parallel_kind`), refusing wrappers that are wrong beside TP.

    Raises :class:`ParallelError` for a ``DistributedDataParallel`` model with tensor-parallel parameters
    and for legacy composable ``replicate`` (docs/torch.md, "DDP and tensor parallel").
    """
    kind = data_parallel_kind(model)
    if kind == "ddp" and dtensor_params(model):
        raise ParallelError(
            "the model is DistributedDataParallel with tensor-parallel parameters, which loses them after the "
            "first forward (docs/torch.md, 'DDP and tensor parallel'): pass the plain module and build it with "
            "meshwise.parallelize(model, topo, tp_plan=..., dp='replicate')"
        )
    if kind == "legacy-replicate":
        raise ParallelError(
            "the model uses torch.distributed._composable.replicate, which gives wrong gradients beside tensor "
            "parallel (docs/torch.md, 'DDP and tensor parallel'): build a fresh model and use "
            "meshwise.parallelize(model, topo, dp='replicate') (replicate_with_fsdp) instead"
        )
    return kind


def _same_mesh(a: Any, b: Any) -> bool:
    return a is b or (
        getattr(a, "mesh_dim_names", None) == getattr(b, "mesh_dim_names", None)
        and torch.equal(a.mesh.cpu(), b.mesh.cpu())
    )


def _plan_matches(model: nn.Module, key: str) -> bool:
    """Whether a ``parallelize_module`` plan key resolves to a module (its matching is atom by atom)."""
    if key == "":
        return True
    atoms = key.split(".")
    for name, _ in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) == len(atoms) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms)):
            return True
    return False


def fsdp_unit_names(model: nn.Module, units: FsdpUnits | None) -> list[str]:
    """The names of the submodules ``fsdp_units`` selects, to shard as their own FSDP units (children before
    parents), excluding the root; bad entries raise :class:`ParallelError`."""
    if units is None:
        return []
    named = dict(model.named_modules())
    chosen: list[str] = []
    if isinstance(units, type) or (isinstance(units, tuple) and all(isinstance(u, type) for u in units)):
        chosen = [n for n, m in named.items() if n and isinstance(m, units)]
    elif callable(units) and not isinstance(units, nn.Module):
        chosen = [n for n, m in named.items() if n and units(n, m)]
    else:
        by_id = {id(m): n for n, m in named.items()}
        for unit in units:
            if isinstance(unit, nn.Module):
                if id(unit) not in by_id:
                    raise ParallelError(
                        f"fsdp_units holds a {type(unit).__name__} that is not a submodule of the model: "
                        "pass modules of this model, or their names"
                    )
                chosen.append(by_id[id(unit)])
            elif isinstance(unit, str):
                matches = [n for n in named if n and _plan_matches_name(n, unit)]
                if not matches:
                    raise ParallelError(
                        f"fsdp_units names {unit!r}, which matches no submodule: use names from "
                        f"model.named_modules(), e.g. {[n for n in named if n][:5]}"
                    )
                chosen.extend(matches)
            else:
                raise ParallelError(f"fsdp_units entries must be module names or modules, got {unit!r}")
    chosen = [n for n in dict.fromkeys(chosen) if n]
    chosen.sort(key=lambda n: -n.count("."))  # FSDP2 wants inner units sharded before the units holding them
    return chosen


def _plan_matches_name(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms))


# --------------------------------------------------------------------------- parallelize

_PARALLELIZE_HOOKS: list[Callable[[nn.Module, Topology], None]] = []


def on_parallelize(hook: Callable[[nn.Module, Topology], None]) -> None:
    """Run ``hook(model, topology)`` in :func:`parallelize` before any placement (integrations register here)."""
    if hook not in _PARALLELIZE_HOOKS:
        _PARALLELIZE_HOOKS.append(hook)


def parallelize(
    model: nn.Module,
    topology: Topology | None = None,
    *,
    tp_plan: Mapping[str, Any] | Callable[[nn.Module], Mapping[str, Any]] | str | None = None,
    dp: str = "fsdp",
    fsdp_units: FsdpUnits | None = None,
    fsdp_kwargs: Mapping[str, Any] | None = None,
    cut: Cut | None = None,
    schedule: str = "1F1B",
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    precision: str | None = "fp32",
    activation_checkpointing: ActivationCheckpointing = None,
    compile: bool | Mapping[str, Any] = False,
) -> nn.Module:
    """Apply ``tp_plan`` over the topology's replica dim, then data parallel over its metric dims; returns the model.

    ``tp_plan`` maps submodule names (``parallelize_module`` patterns such as ``"blocks.*.attn.q"``) to
    torch ``ParallelStyle`` objects (``ColwiseParallel()``, ``RowwiseParallel()``, ...), or is a function
    of the model returning that mapping, or ``"auto"``: a Hugging Face model's own plan translated to those
    styles after checking its head, MLP and vocabulary sizes divide by tp (docs/hf.md).
    ``dp`` is ``"fsdp"`` (FSDP2 ``fully_shard``: each of
    ``fsdp_units`` — names, modules, a module type or a predicate ``(name, module) -> bool`` — then the
    root), ``"replicate"`` (``replicate_with_fsdp``: DDP semantics that compose with TP) or ``"none"``.
    Data parallel spans the batch *and* split dims (flattened): split ranks hold partial gradients of
    the same parameters, so their gradients must be averaged too. Over a single rank no wrapper is added.
    Build the model with full (not sharded) weights, the same on every rank, before calling this.
    ``topology`` defaults to the current one (:func:`meshwise.topology.resolve`).

    With a ``stage`` dim of size > 1 the model is cut into pipeline stages (docs/pipeline.md): ``cut``
    names the module each stage after the first starts at (or is a function of the units and the stage
    count; default: the largest block list cut evenly), ``schedule`` is ``"GPipe"``, ``"1F1B"`` or
    ``"Interleaved1F1B"`` (``stages_per_rank`` stages a rank, default 2), ``microbatches`` the micro-batch
    count (default: the number of stages). Each stage gets the TP plan and data parallel as above; the
    result is a :class:`~meshwise.parallel.pipeline.PipelineModel` with the full model's parameter names.
    Without a stage dim these four options are checked and otherwise ignored, so one script runs anywhere.

    ``precision`` is ``"fp32"``, ``"bf16"`` or ``"fp16"`` (docs/precision.md): FSDP2/replicate units compute
    in that dtype and reduce gradients in fp32 (a model without them runs its forward under autocast); the
    parameters the optimizer steps stay fp32, the model's outputs come back fp32 for the loss, and for fp16
    the trainer scales the loss. ``activation_checkpointing`` recomputes activations in backward: ``"full"``
    (every block: the outermost ``fsdp_units``, else the children of the largest ``ModuleList``), an int k
    (every k-th block), module names/patterns, or a predicate ``(name, module) -> bool``. ``compile=True``
    (or a dict of ``torch.compile`` options) compiles each block in place. The order is torch's: TP, then
    activation checkpointing, then compile, then data parallel. Parameter names never change.
    """
    topology = resolve(topology)
    _check_parallelize_input(model, topology, dp)
    if "physicsnemo.domain_parallel" in sys.modules:  # ShardTensors may be in use: load the integration's hook
        importlib.import_module("meshwise.physicsnemo")
    for hook in _PARALLELIZE_HOOKS:  # integrations' checks and gradient conventions (docs/physicsnemo.md)
        hook(model, topology)
    from meshwise.parallel.context import check_attention_routed

    check_attention_routed(model, topology)  # token-split parts through plain attention: a silently wrong loss
    check_schedule(schedule, stages_per_rank)
    plan = check_tp_plan(model, topology, tp_plan)
    units = fsdp_unit_names(model, fsdp_units)
    policy = _check_extras(model, topology, dp, precision, fsdp_kwargs, activation_checkpointing, compile)
    blocks = block_names(model, units)
    if compile is not False and compile is not None and not blocks:
        apply_compile(model, blocks, {})  # raises: nothing to compile per block
    extras = (policy, checkpointed_modules(model, blocks, activation_checkpointing), compile)
    if topology.size(topology.stage_dims) > 1:

        def place(stage: nn.Module) -> nn.Module:
            names = dict(stage.named_modules())
            stage_tp = None if plan is None else stage_plan(plan, stage, _plan_matches)
            stage_units, stage_blocks = [n for n in units if n in names], [b for b in blocks if b in names]
            placed = _place(stage, topology, stage_tp, dp, stage_units, stage_blocks, fsdp_kwargs, extras)
            return attach_precision(placed, policy)

        return attach_precision(
            split_model(
                model,
                topology,
                cut=cut,
                schedule=schedule,
                microbatches=microbatches,
                stages_per_rank=stages_per_rank,
                place=place,
            ),
            policy,
            outputs=False,
        )
    return attach_precision(_place(model, topology, plan, dp, units, blocks, fsdp_kwargs, extras), policy)


def _check_extras(
    model: nn.Module, topology: Topology, dp: str, precision: Any, fsdp_kwargs: Any, ac: Any, compile: Any
) -> Precision:
    """The precision policy for this placement; bad precision, checkpointing or compile options raise first."""
    name = precision_policy(precision)
    check_precision(model, name, fsdp_kwargs)
    by_fsdp = dp != "none" and topology.size(topology.metric_dims) > 1
    if name != "fp32" and topology.size(topology.stage_dims) > 1 and (name == "fp16" or not by_fsdp):
        raise ParallelError(
            f"precision={name!r} with pipeline stages needs bf16 over FSDP2/replicate units (dp > 1): the "
            "pipeline schedule runs no autocast and no loss scaler; use precision='bf16' with a dp dim"
        )
    if compile is not False and compile is not None:
        if not (compile is True or isinstance(compile, Mapping)):
            raise ParallelError(f"compile= must be True, False or a dict of torch.compile options, got {compile!r}")
        check_compiler(topology.device.type, compile if isinstance(compile, Mapping) else {})
    return Precision(name, by_fsdp=by_fsdp, device_type=topology.device.type)


def _place(
    model: nn.Module,
    topology: Topology,
    plan: dict[str, Any] | None,
    dp: str,
    units: Sequence[str],
    blocks: list[str],
    fsdp_kwargs: Mapping[str, Any] | None,
    extras: tuple[Precision, Any, Any],
) -> nn.Module:
    """TP, then activation checkpointing, then compile, then data parallel (torchtitan's order)."""
    policy, checkpointed, compile = extras
    model = _apply_tp_plan(model, topology, plan)
    apply_activation_checkpointing(model, checkpointed)
    if compile is not False and compile is not None and blocks:
        apply_compile(model, blocks, compile if isinstance(compile, Mapping) else {})
    kwargs = dict(fsdp_kwargs or {})
    if policy.mp_policy() is not None:
        kwargs["mp_policy"] = policy.mp_policy()
    return note_model(_apply_data_parallel(model, topology, dp, units, kwargs))  # a dry run reports its shapes


def _apply_data_parallel(
    model: nn.Module, topology: Topology, dp: str, units: Sequence[str], kwargs: Mapping[str, Any] | None
) -> nn.Module:
    metric = topology.metric_dims
    if dp == "none" or not metric or topology.size(metric) == 1:
        return model
    dp_mesh = topology.submesh(metric)
    named = dict(model.named_modules())
    if dp == "fsdp":
        from torch.distributed.fsdp import fully_shard as wrap

        _advise_empty_shards(model, topology, kwargs)
    else:
        wrap = compat.replicate_with_fsdp()
    for unit in units:
        wrap(named[unit], mesh=dp_mesh, **dict(kwargs or {}))
    wrap(model, mesh=dp_mesh, **dict(kwargs or {}))
    return model


def _rows_sharded(p: torch.Tensor, placement_fn: Any) -> tuple[int, int]:
    """(dim, size) of what FSDP2 shards over the data-parallel ranks: dim 0 (or the dim ``shard_placement_fn``
    picks) of the parameter, as tensor parallel left it on this rank (each ``Shard`` of that dim divides it)."""
    chosen = placement_fn(p) if placement_fn is not None else None
    dim = getattr(chosen, "dim", 0) if chosen is not None else 0
    size = p.shape[dim]
    if isinstance(p, DTensor):
        for mesh_dim, placement in enumerate(p.placements):
            if placement.is_shard(dim):
                size = -(-size // p.device_mesh.size(mesh_dim))
    return dim, size


def _advise_empty_shards(model: nn.Module, topology: Topology, kwargs: Mapping[str, Any] | None) -> None:
    """Warn once (rank 0, or the rank a dry run plays) when FSDP2 would leave trailing data-parallel ranks with
    empty shards: a parameter whose sharded dim has fewer rows than there are data-parallel ranks."""
    metric = topology.metric_dims
    ranks = topology.size(metric)
    placement_fn = dict(kwargs or {}).get("shard_placement_fn")
    small = []
    for name, p in model.named_parameters():
        if p.ndim:
            dim, size = _rows_sharded(p, placement_fn)
            if size < ranks:
                small.append(f"{name} ({size} along dim {dim})")
    if not small or (topology.rank != 0 and topology.environment.launcher != "dry-run"):
        return
    listing = ", ".join(small[:8]) + (f", ... ({len(small)} in all)" if len(small) > 8 else "")
    message = (
        f"FSDP2 shards each parameter over the {ranks} data-parallel ranks of {'+'.join(metric)}, but "
        f"{len(small)} parameter(s) have fewer rows there: {listing}. The trailing data-parallel ranks hold empty "
        "shards of them (their memory and optimizer state sit on the first ranks). Fix: shard them along a longer "
        "dim with parallelize(..., fsdp_kwargs={'shard_placement_fn': lambda p: Shard(1) if p.ndim > 1 and "
        f"p.shape[0] < {ranks} else None}}), keep them out with fsdp_kwargs={{'ignored_params': ...}}, or use "
        "dp='replicate'"
    )
    note_advice(message)  # a dry run's report lists it too
    warnings.warn(message, PlacementWarning, stacklevel=5)


def _check_parallelize_input(model: nn.Module, topology: Topology, dp: str) -> None:
    if not isinstance(model, nn.Module):
        raise ParallelError(f"parallelize() needs an nn.Module, got {type(model).__name__}")
    if dp not in DP_MODES:
        hint = (
            " DDP is not offered: beside tensor parallel it drops DTensor parameters and legacy replicate gives "
            "wrong gradients (docs/torch.md, 'DDP and tensor parallel'); dp='replicate' gives the same all-reduce "
            "semantics and composes with TP."
            if str(dp).lower() in ("ddp", "dp", "data_parallel")
            else ""
        )
        raise ParallelError(f"dp={dp!r} is not one of {DP_MODES}.{hint}")
    kind = check_data_parallel(model)
    if kind == "ddp":
        raise ParallelError(
            "the model is wrapped in DistributedDataParallel: pass the plain module (model.module) and let "
            "parallelize() apply dp='replicate' or 'fsdp' (DDP beside tensor parallel loses DTensor parameters)"
        )
    if kind is not None:
        raise ParallelError(
            f"the model is already data parallel ({kind}): call parallelize() once, on a model without wrappers"
        )


def check_tp_plan(model: nn.Module, topology: Topology, tp_plan: Any) -> dict[str, Any] | None:
    """``tp_plan`` as a checked dict (a function of the model is called), or None; bad plans raise.

    Without a plan the model's existing DTensor parameters must live on this topology's replica mesh.
    """
    replica = topology.replica_dims
    existing = dtensor_params(model)
    if tp_plan == "auto" and (not replica or topology.size(replica) == 1) and not existing:
        return None  # 'auto' on a mesh without tensor parallel: the model stays whole
    if tp_plan is None:
        tp_mesh = topology.submesh(replica[0]) if len(replica) == 1 else None
        for name, p in existing:
            if tp_mesh is None or not _same_mesh(p.device_mesh, tp_mesh):
                raise ParallelError(
                    f"parameter {name!r} is already a DTensor on mesh {p.device_mesh}, which is not this "
                    f"topology's replica mesh ({list(replica) or 'none'}); data parallel over "
                    f"{topology.metric_dims} cannot compose with it. Build the model with plain parameters "
                    "and pass tp_plan=... so meshwise shards it on this topology"
                )
        return None
    if len(replica) != 1:
        raise ParallelError(
            f"a tp_plan needs exactly one mesh dim with role 'replica' to shard over; this mesh has "
            f"{list(replica) or 'none'} (dims {topology.roles}). Declare one, e.g. init({{'dp': -1, 'tp': 2}})"
        )
    if existing:
        raise ParallelError(
            f"parameter {existing[0][0]!r} is already a DTensor: the model was already tensor parallel; "
            "give parallelize() a model with plain parameters, or drop tp_plan"
        )
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise ParallelError(f"tp_plan={tp_plan!r}: the only string is 'auto' (the Hugging Face model's own plan)")
        from meshwise.parallel.hf import hf_tp_plan

        tp = topology.size(replica[0])
        if tp == 1:  # one script runs anywhere: nothing to shard over a single rank
            return None
        plan = hf_tp_plan(model, tp)
    else:
        plan = tp_plan(model) if callable(tp_plan) else tp_plan
    if not isinstance(plan, Mapping):
        raise ParallelError(f"tp_plan must be a mapping name -> ParallelStyle, got {type(plan).__name__}")
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    for key, style in plan.items():
        if not isinstance(key, str) or not _plan_matches(model, key):
            names = [n for n, _ in model.named_modules() if n]
            raise ParallelError(
                f"tp_plan names {key!r}, which matches no submodule of {type(model).__name__}: use names "
                f"from model.named_modules() (wildcards allowed per level), e.g. {names[:6]}"
            )
        if not isinstance(style, ParallelStyle):
            raise ParallelError(
                f"tp_plan[{key!r}] is a {type(style).__name__}, not a torch ParallelStyle: use "
                "ColwiseParallel(), RowwiseParallel(), SequenceParallel() or PrepareModuleInput(...)"
            )
        odd = [(n, m) for n, m in model.named_modules() if n and _plan_matches_name(n, key)]
        odd = [(n, type(m).__name__) for n, m in odd if not isinstance(m, nn.Linear | nn.Embedding)]
        if type(style) in (ColwiseParallel, RowwiseParallel) and odd:  # e.g. GPT-2's Conv1D, stored [in, out]
            raise ParallelError(
                f"tp_plan[{key!r}] gives {odd[0][0]!r}, a {odd[0][1]}, the torch style {type(style).__name__}, "
                "which shards only nn.Linear and nn.Embedding: leave it out of tp_plan (docs/hf.md, 'Tensor parallel')"
            )
    return dict(plan)


def _apply_tp_plan(model: nn.Module, topology: Topology, plan: dict[str, Any] | None) -> nn.Module:
    if not plan:
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, topology.submesh(topology.replica_dims[0]), plan)


# --------------------------------------------------------------------------- global gradient norm


def _grads(params: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        params = [params]
    return [p.grad for p in params if p.grad is not None]


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
    and is counted once.
    """
    holders = topology.world_size // topology.size(topology.stage_dims)
    buckets: dict[float, list[torch.Tensor]] = {}
    for g in grads:
        local, copies = _replication(g, holders * getattr(g, STAGE_COPIES, 1))
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
