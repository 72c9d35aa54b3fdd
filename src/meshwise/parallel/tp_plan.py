"""Tensor-parallel plans: ``tp_plan`` checked against the model and the mesh (a dict of torch styles, a function
of the model, or ``"auto"``: the plan a registered integration reads from the model) and applied over the replica dim.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from meshwise.errors import ParallelError, PlacementWarning
from meshwise.parallel.data_parallel import dtensor_params
from meshwise.parallel.plan_match import module_matches, name_matches
from meshwise.topology import Topology

__all__ = ["apply_tp_plan", "check_tp_plan", "on_auto_plan"]

# Who reads a model's own plan for tp_plan="auto": an integration registers here (meshwise.hf: a transformers
# model's plan), so this layer never imports it.
_AUTO_PLANS: list[Callable[[nn.Module, int], dict[str, Any] | None]] = []


def on_auto_plan(reader: Callable[[nn.Module, int], dict[str, Any] | None]) -> None:
    """Register ``reader(model, tp)``: the torch plan for ``model``'s own plan over ``tp`` ranks, or None when
    ``model`` is not of the reader's kind (integrations register here; see ``tp_plan="auto"``)."""
    if reader not in _AUTO_PLANS:
        _AUTO_PLANS.append(reader)


def _auto_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    if "transformers" in sys.modules:  # the plan may be a transformers model's own: load the integration's reader
        importlib.import_module("meshwise.hf")
    for reader in _AUTO_PLANS:
        plan = reader(model, tp)
        if plan is not None:
            return plan
    raise ParallelError(
        f"tp_plan='auto' reads a Hugging Face model's own plan, but {type(model).__name__} is not a transformers "
        "PreTrainedModel: pass a dict name -> ColwiseParallel()/RowwiseParallel() instead"
    )


def _same_mesh(a: Any, b: Any) -> bool:
    return a is b or (
        getattr(a, "mesh_dim_names", None) == getattr(b, "mesh_dim_names", None)
        and torch.equal(a.mesh.cpu(), b.mesh.cpu())
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
        split_by_hand = any(getattr(p, "tensor_model_parallel", False) for p in model.parameters())  # Megatron's
        if replica and topology.size(replica) > 1 and not (existing or split_by_hand) and topology.rank == 0:
            warnings.warn(
                f"the mesh has the replica dim(s) {list(replica)} of {topology.size(replica)} ranks but parallelize() "
                "got no tp_plan: the model stays whole there, so those ranks repeat the same work on the same "
                "samples. Pass tp_plan={...} (or 'auto' for a Hugging Face model), or drop the dim from the mesh",
                PlacementWarning,
                stacklevel=3,  # parallelize()'s caller
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
        tp = topology.size(replica[0])
        if tp == 1:  # one script runs anywhere: nothing to shard over a single rank
            return None
        plan = _auto_plan(model, tp)
    else:
        plan = tp_plan(model) if callable(tp_plan) else tp_plan
    if not isinstance(plan, Mapping):
        raise ParallelError(f"tp_plan must be a mapping name -> ParallelStyle, got {type(plan).__name__}")
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    for key, style in plan.items():
        if not isinstance(key, str) or not module_matches(model, key):
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
        odd = [(n, m) for n, m in model.named_modules() if n and name_matches(n, key)]
        odd = [(n, type(m).__name__) for n, m in odd if not isinstance(m, nn.Linear | nn.Embedding)]
        if type(style) in (ColwiseParallel, RowwiseParallel) and odd:  # e.g. GPT-2's Conv1D, stored [in, out]
            raise ParallelError(
                f"tp_plan[{key!r}] gives {odd[0][0]!r}, a {odd[0][1]}, the torch style {type(style).__name__}, "
                "which shards only nn.Linear and nn.Embedding: leave it out of tp_plan (docs/hf.md, 'Tensor parallel')"
            )
    return dict(plan)


def apply_tp_plan(model: nn.Module, topology: Topology, plan: dict[str, Any] | None) -> nn.Module:
    if not plan:
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, topology.submesh(topology.replica_dims[0]), plan)
