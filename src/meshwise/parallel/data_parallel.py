"""Data parallel on the mesh's metric dims: how a model is already wrapped (and the wrappers refused beside tensor
parallel), FSDP2 resharding, the submodules sharded as their own units, and the FSDP2 or replicate wrap itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshwise import compat
from meshwise.dryrun import note_advice
from meshwise.errors import ParallelError, PlacementWarning
from meshwise.parallel.plan_match import name_matches
from meshwise.parallel.stages import pipeline_of
from meshwise.topology import Topology

__all__ = [
    "DP_MODES",
    "apply_data_parallel",
    "FsdpUnits",
    "check_data_parallel",
    "data_parallel_kind",
    "dtensor_params",
    "fsdp_unit_names",
    "reshard",
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
                matches = [n for n in named if n and name_matches(n, unit)]
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


def apply_data_parallel(
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
    for module in [*(named[unit] for unit in units), model]:
        wrap(module, mesh=dp_mesh, **dict(kwargs or {}))
        # ahead of FSDP2's post-forward hook, which warns of (and is broken by in-place ops on) view outputs
        module.register_forward_hook(_unview_outputs, prepend=True)
    return model


class _Alias(torch.autograd.Function):
    """The same storage as a new, non-view tensor; the gradient passes through unchanged (identical numbers)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.detach()  # shares storage and version counter, but is no autograd view

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _unview(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return _Alias.apply(out) if out.requires_grad and out._base is not None else out
    if isinstance(out, tuple | list):
        items = [_unview(o) for o in out]
        if all(a is b for a, b in zip(items, out, strict=True)):
            return out
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)  # a namedtuple takes fields
    if isinstance(out, dict):  # a plain dict or a transformers ModelOutput, just made by this forward
        for key, value in list(out.items()):
            new = _unview(value)
            if new is not value:
                out[key] = new
    return out


@torch.compiler.disable  # beside FSDP2's own post-forward hook, which dynamo skips too
def _unview_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """A data-parallel unit's outputs with no autograd view among them (zero copy).

    A tensor-parallel layer's output is a view: ``DTensor.to_local()`` (the ``use_local_output=True`` of
    ``ColwiseParallel``/``RowwiseParallel``) returns ``view_as`` of the local shard. When it is what an FSDP2
    unit returns (a model ending in a TP linear), FSDP2 registers its pre-backward hook on that view, and an
    in-place op on it (``out += y``) would drop the hook and skip the all-gather in backward; torch warns of it
    on every rank. The alias here is the same memory with its own autograd node, on which the hook holds (an
    in-place op on it still bumps the shared version counter: a saved tensor it changed fails loudly).
    """
    if not torch.is_grad_enabled():
        return output
    return _unview(output)


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
