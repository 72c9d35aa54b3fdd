"""What a checkpoint holds and how modules and optimizers go through DCP: the ``Checkpointer``'s options and
score, the kind of each named object, each optimizer paired with the module whose parameters it holds, and their DCP
state taken and put back.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from meshwise.errors import CheckpointError
from meshwise.parallel.data_parallel import reshard

__all__ = [
    "FLAT",
    "apply_dcp_state",
    "check_options",
    "classify",
    "dcp_state",
    "object_kind",
    "on_dcp_state",
    "optimizer_owners",
    "score_value",
]


# --------------------------------------------------------------------------- options and score


def check_options(keep_last: Any, keep_best: Any, score: Any, mode: Any, async_save: Any) -> None:
    """Check the options of a ``Checkpointer``: a :class:`CheckpointError` names a bad one."""
    for name, value in (("keep_last", keep_last), ("keep_best", keep_best)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"{name} must be a positive int or None, got {value!r}")
    if keep_best is not None and score is None:
        raise CheckpointError("keep_best needs score=: a metric name (engine.state.metrics key) or a callable")
    if score is not None and not (isinstance(score, str) or callable(score)):
        raise CheckpointError(f"score must be a metric name or a callable returning a float, got {score!r}")
    if mode not in ("max", "min"):
        raise CheckpointError(f"mode must be 'max' (higher score is better) or 'min', got {mode!r}")
    if async_save not in (True, False, "stage-first"):
        raise CheckpointError(f"async_save must be True, False or 'stage-first', got {async_save!r}")


def score_value(score: str | Callable[[], float] | None, objects: Mapping[str, Any]) -> float | None:
    """The score of a save for ``keep_best``: ``score()``, or the metric ``score`` of an Engine in ``objects``."""
    if score is None:
        return None
    if callable(score):
        value = score()
    else:
        value = None
        for obj in objects.values():
            metrics = getattr(getattr(obj, "state", None), "metrics", None)
            if isinstance(metrics, Mapping) and score in metrics:
                value = metrics[score]
                break
        if value is None:
            return None  # no score yet (e.g. before the first evaluation): not a candidate for best
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"score {score!r} gave {value!r}, not a number") from None


# --------------------------------------------------------------------------- kinds of objects


def object_kind(obj: Any) -> str:
    """``"module"``, ``"optimizer"``, ``"state"`` (has ``state_dict``/``load_state_dict``) or ``""`` (none)."""
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "state"
    return ""


def classify(objects: Mapping[str, Any]) -> dict[str, str]:
    """The kind of each named object; raises for an object that cannot be checkpointed."""
    kinds = {}
    for name, obj in objects.items():
        if "deepspeed" in sys.modules:  # DeepSpeed's engine and ZeRO optimizer keep checkpoints of their own
            importlib.import_module("meshwise.deepspeed").refuse_checkpoint(name, obj)
        kind = object_kind(obj)
        if not kind:
            raise CheckpointError(
                f"cannot checkpoint {name}={type(obj).__name__}: pass an nn.Module, an Optimizer, or an object "
                "with state_dict() and load_state_dict() (wrap plain values in such an object)"
            )
        kinds[name] = kind
    return kinds


def optimizer_owners(objects: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, str]:
    """For each optimizer, the name of the module whose parameters it holds.

    Every module is resharded first: after a forward without backward (an evaluation) FSDP2's root holds
    unsharded parameters, other objects than the optimizer's (docs/torch.md, "Checkpoints (DCP)"), and the
    state dicts taken next must see the sharded ones too.
    """
    for name, kind in kinds.items():
        if kind == "module":
            reshard(objects[name])
    modules = {n: {id(p) for p in objects[n].parameters()} for n, k in kinds.items() if k == "module"}
    owners = {}
    for name, kind in kinds.items():
        if kind != "optimizer":
            continue
        params = {id(p) for g in objects[name].param_groups for p in g["params"]}
        owner = next((m for m, ids in modules.items() if params <= ids), None)
        if owner is None:
            raise CheckpointError(
                f"optimizer {name!r} holds parameters of no module passed with it: pass its model too, "
                f"e.g. save(step, model=model, {name}={name})"
            )
        owners[name] = owner
    return owners


# --------------------------------------------------------------------------- DCP state of modules and optimizers

# Optimizer hyperparameters keyed by parameter name, not one param_groups list: DCP keeps one rank's copy of a
# replicated list, which names only that pipeline stage's parameters (docs/pipeline.md).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

DcpHook = Callable[[str, nn.Module, dict[str, Any], bool], dict[str, Any]]
_DCP_HOOKS: list[DcpHook] = []


def on_dcp_state(hook: DcpHook) -> None:
    """Register ``hook(kind, module, state, to_dcp) -> state`` for every module's and optimizer's DCP state dict
    (``kind`` "module" or "optimizer", ``module`` the module or the optimizer's owner): with ``to_dcp`` as it is
    taken to be saved or loaded into, without as loaded state goes back into the object. How an integration whose
    layers split plain tensors themselves (``meshwise.megatron``) shows DCP the global tensors they are shards of."""
    if hook not in _DCP_HOOKS:
        _DCP_HOOKS.append(hook)


def _hooked(kind: str, module: nn.Module, state: dict[str, Any], to_dcp: bool) -> dict[str, Any]:
    if to_dcp and "megatron.core" in sys.modules:  # Megatron's layers split plain tensors: load its integration
        importlib.import_module("meshwise.megatron")
    for hook in _DCP_HOOKS:
        state = hook(kind, module, state, to_dcp)
    return state


def dcp_state(
    objects: Mapping[str, Any], kinds: Mapping[str, str], owners: Mapping[str, str], skip: Collection[str]
) -> dict[str, Any]:
    """The DCP state dict of every module and optimizer not in ``skip`` (call :func:`optimizer_owners` first)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {}
    for name, kind in kinds.items():
        if name in skip:
            continue
        if kind == "module":
            state[name] = _hooked(kind, objects[name], get_model_state_dict(objects[name]), True)
        elif kind == "optimizer":
            owner = objects[owners[name]]
            state[name] = _hooked(kind, owner, get_optimizer_state_dict(owner, objects[name], options=FLAT), True)
    return state


def apply_dcp_state(
    objects: Mapping[str, Any],
    kinds: Mapping[str, str],
    owners: Mapping[str, str],
    names: Collection[str],
    state: Mapping[str, Any],
) -> None:
    """Put the loaded DCP ``state`` of ``names`` back: modules first, then the optimizers that hold their params."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for n in names:
        if kinds[n] == "module":
            set_model_state_dict(objects[n], _hooked("module", objects[n], state[n], False))
    for n in names:
        if kinds[n] == "optimizer":
            owner = objects[owners[n]]
            set_optimizer_state_dict(owner, objects[n], _hooked("optimizer", owner, state[n], False), options=FLAT)


# --------------------------------------------------------------------------- RNG streams
