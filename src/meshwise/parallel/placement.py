"""``parallelize``: a model placed on the topology in torch's order (tensor parallel, activation checkpointing,
compile, data parallel), cut into pipeline stages first where the mesh has a stage dim; the hook integrations
register to run before any placement.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from meshwise.dryrun import note_model
from meshwise.errors import ParallelError
from meshwise.parallel.context import check_attention_routed
from meshwise.parallel.data_parallel import (
    DP_MODES,
    FsdpUnits,
    apply_data_parallel,
    check_data_parallel,
    fsdp_unit_names,
)
from meshwise.parallel.plan_match import module_matches
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
from meshwise.parallel.stages import Cut, check_schedule, split_model, stage_plan
from meshwise.parallel.tp_plan import apply_tp_plan, check_tp_plan
from meshwise.topology import Topology, resolve

__all__ = ["Placement", "on_parallelize", "parallelize"]


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
    result is a :class:`~meshwise.parallel.stages.PipelineModel` with the full model's parameter names.
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
    if "transformers" in sys.modules:  # the model may be a transformers model: load the integration's checks
        importlib.import_module("meshwise.hf")
    if "megatron.core" in sys.modules:  # Megatron's layers split plain tensors: its integration refuses FSDP2 on them
        importlib.import_module("meshwise.megatron")
    for hook in _PARALLELIZE_HOOKS:  # integrations' checks and gradient conventions (docs/physicsnemo.md)
        hook(model, topology)
    check_attention_routed(model, topology)  # token-split parts through plain attention: a silently wrong loss
    check_schedule(schedule, stages_per_rank)
    plan = check_tp_plan(model, topology, tp_plan)
    units = fsdp_unit_names(model, fsdp_units)
    policy = _check_extras(model, topology, dp, precision, fsdp_kwargs, activation_checkpointing, compile)
    blocks = block_names(model, units)
    if compile is not False and compile is not None and not blocks:
        apply_compile(model, blocks, {})  # raises: nothing to compile per block
    placement = Placement(
        plan=plan,
        dp=dp,
        units=units,
        blocks=blocks,
        fsdp_kwargs=fsdp_kwargs,
        policy=policy,
        checkpointed=checkpointed_modules(model, blocks, activation_checkpointing),
        compile=compile,
    )
    if topology.size(topology.stage_dims) > 1:

        def place(stage: nn.Module) -> nn.Module:
            return attach_precision(_place(stage, topology, placement.for_stage(stage)), policy)

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
    return attach_precision(_place(model, topology, placement), policy)


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


@dataclasses.dataclass(frozen=True)
class Placement:
    """What :func:`parallelize` puts on a model (or on one pipeline stage of it), checked: the tensor-parallel
    ``plan``, the ``dp`` mode, the FSDP ``units`` and the compiled ``blocks`` (names in the model), the user's
    ``fsdp_kwargs``, the precision ``policy``, the ``checkpointed`` modules and the ``compile`` option."""

    plan: dict[str, Any] | None
    dp: str
    units: Sequence[str]
    blocks: Sequence[str]
    fsdp_kwargs: Mapping[str, Any] | None
    policy: Precision
    checkpointed: Any
    compile: bool | Mapping[str, Any]

    def for_stage(self, stage: nn.Module) -> Placement:
        """This placement narrowed to the modules pipeline ``stage`` holds."""
        names = dict(stage.named_modules())
        return dataclasses.replace(
            self,
            plan=None if self.plan is None else stage_plan(self.plan, stage, module_matches),
            units=[n for n in self.units if n in names],
            blocks=[b for b in self.blocks if b in names],
        )


def _place(model: nn.Module, topology: Topology, placement: Placement) -> nn.Module:
    """TP, then activation checkpointing, then compile, then data parallel (torchtitan's order)."""
    model = apply_tp_plan(model, topology, placement.plan)
    apply_activation_checkpointing(model, placement.checkpointed)
    compile = placement.compile
    if compile is not False and compile is not None and placement.blocks:
        apply_compile(model, list(placement.blocks), compile if isinstance(compile, Mapping) else {})
    kwargs = dict(placement.fsdp_kwargs or {})
    if placement.policy.mp_policy() is not None:
        kwargs["mp_policy"] = placement.policy.mp_policy()
    return note_model(
        apply_data_parallel(model, topology, placement.dp, placement.units, kwargs)
    )  # a dry run reports its shapes


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
