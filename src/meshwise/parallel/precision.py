"""Mixed precision policies, activation checkpointing and ``torch.compile`` as :func:`meshwise.parallelize`
applies them, the trainer's loss scaler, and the bytes of parameters, gradients and optimizer state a rank holds."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshwise import compat
from meshwise.errors import ParallelError

__all__ = [
    "PRECISIONS",
    "ActivationCheckpointing",
    "LossScaler",
    "MemoryPerRank",
    "Precision",
    "apply_activation_checkpointing",
    "apply_compile",
    "block_names",
    "attach_precision",
    "check_compiler",
    "check_precision",
    "check_trainer_precision",
    "checkpointed_modules",
    "memory_per_rank",
    "precision_of",
    "precision_policy",
]

# name -> the dtype forward and backward compute in; master weights, gradient reduction and the loss stay fp32
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_ATTR = "meshwise_precision"  # where parallelize() leaves the policy on the model it returns

ActivationCheckpointing = None | bool | str | int | Sequence[str] | Callable[[str, nn.Module], bool]


@dataclass(frozen=True)
class Precision:
    """A named policy as applied to one model: ``by_fsdp`` when FSDP2/replicate units cast the parameters
    (``MixedPrecisionPolicy``), otherwise the trainer's forward runs under ``torch.autocast``."""

    name: str = "fp32"
    by_fsdp: bool = False
    device_type: str = "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.name]

    @property
    def needs_scaler(self) -> bool:
        # fp16's 5 exponent bits underflow small gradients: the loss is scaled up and steps with inf/nan skipped
        return self.name == "fp16"

    def mp_policy(self) -> Any:
        """FSDP2's policy: compute in ``dtype``, reduce gradients in fp32; None for fp32 (FSDP2's default)."""
        if self.name == "fp32":
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the trainer runs the forward in: autocast where no FSDP2 unit casts the parameters."""
        if self.name == "fp32" or self.by_fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaler(self) -> LossScaler | None:
        return LossScaler() if self.needs_scaler else None


@dataclass
class LossScaler:
    """A dynamic loss scale (torch ``GradScaler``'s rule): backward runs on ``loss * scale``; a step whose
    gradients hold inf/nan anywhere on the mesh is skipped and the scale halved; after ``growth_interval``
    good steps in a row it doubles. The decision comes from the world-reduced gradient norm, so every rank
    skips the same steps."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    skipped: int = 0
    good_steps: int = field(default=0, repr=False)

    def update(self, finite: bool) -> bool:
        """Record one step's verdict (the same on every rank); True when the optimizer may step."""
        if not finite:
            self.skipped += 1
            self.good_steps = 0
            self.scale *= self.backoff_factor
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True


def precision_policy(name: str | None) -> str:
    """The canonical policy name for ``name`` (None: fp32); unknown names raise :class:`ParallelError`."""
    if name is None:
        return "fp32"
    key = _ALIASES.get(str(name).lower(), str(name).lower()) if isinstance(name, str) else None
    if key not in PRECISIONS:
        raise ParallelError(
            f"precision={name!r} is not a policy meshwise knows: use one of {sorted(PRECISIONS)} ('bf16': bfloat16 "
            "compute with fp32 master weights and fp32 gradient reduction; 'fp16': float16 with a loss scaler)"
        )
    return key


def _float_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]


def check_precision(model: nn.Module, name: str, fsdp_kwargs: Mapping[str, Any] | None) -> None:
    """Refuse what would train in lower precision without meshwise knowing (before any collective)."""
    mp = dict(fsdp_kwargs or {}).get("mp_policy")
    if mp is not None and name != "fp32":
        raise ParallelError(
            f"precision={name!r} and fsdp_kwargs['mp_policy'] both set mixed precision: keep one "
            "(precision= also sets the trainer's autocast, loss scaler and fp32 loss)"
        )
    if mp is not None and getattr(mp, "param_dtype", None) == torch.float16:
        raise ParallelError(
            "fsdp_kwargs['mp_policy'] computes in float16, which needs a loss scaler the trainer would not know "
            "of (small gradients underflow to 0): pass precision='fp16' instead of the mp_policy"
        )
    low = [(n, p.dtype) for n, p in _float_params(model) if p.dtype != torch.float32]
    if low and name != "fp32":
        raise ParallelError(
            f"parameter {low[0][0]!r} is {low[0][1]}: precision={name!r} keeps fp32 master weights and casts for "
            "compute itself; build the model in float32 (drop model.half()/.bfloat16()/.to(dtype))"
        )


def precision_of(model: nn.Module) -> Precision:
    """The policy :func:`meshwise.parallelize` applied to ``model`` (fp32 for a model it did not build)."""
    policy = getattr(model, _ATTR, None)
    return policy if isinstance(policy, Precision) else Precision()


def attach_precision(model: nn.Module, policy: Precision, outputs: bool = True) -> nn.Module:
    """Leave ``policy`` on ``model`` for the trainer and (``outputs``) make its floating outputs fp32, the
    dtype the loss is computed in."""
    object.__setattr__(model, _ATTR, policy)  # not a submodule or buffer: never in a state dict
    if outputs and policy.name != "fp32":
        model.register_forward_hook(lambda _m, _a, out: _to_fp32(out))
    return model


def _to_fp32(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float32 else out
    if isinstance(out, (list, tuple)):
        return type(out)(_to_fp32(o) for o in out)
    if isinstance(out, dict):
        return {k: _to_fp32(v) for k, v in out.items()}
    return out


def check_trainer_precision(model: nn.Module, policy: Precision) -> None:
    """The trainer refuses float16 parameters it was not told to scale (a model.half() of its own)."""
    if policy.needs_scaler:
        return
    half = [n for n, p in _float_params(model) if p.dtype == torch.float16]
    if half:
        raise ParallelError(
            f"parameter {half[0]!r} is float16 and the trainer has no loss scaler for it (gradients would "
            "underflow, and steps with inf would corrupt the weights): build the model in float32 and call "
            "meshwise.parallelize(model, topo, precision='fp16'), which keeps fp32 master weights and scales the loss"
        )


# --------------------------------------------------------------------------- activation checkpointing, compile


def block_names(model: nn.Module, units: Sequence[str]) -> list[str]:
    """The blocks activation checkpointing and compile act on: the outermost FSDP units when given, else the
    children of the model's largest ``ModuleList``/``Sequential`` (a transformer's layers)."""
    if units:
        outer = [u for u in units if not any(u.startswith(o + ".") for o in units if o != u)]
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        return sorted(outer, key=order.__getitem__)
    lists = [(len(m), n) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)]
    if not lists:
        return []
    name = max(lists)[1]
    prefix = f"{name}." if name else ""
    return [prefix + k for k, _ in dict(model.named_modules())[name].named_children()]


def _chosen(model: nn.Module, blocks: list[str], spec: ActivationCheckpointing) -> list[str]:
    named = dict(model.named_modules())
    if spec in ("full", True):
        return blocks
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ParallelError(f"activation_checkpointing={spec}: an int k checkpoints every k-th block, k >= 1")
        return [b for i, b in enumerate(blocks) if (i + 1) % spec == 0]
    if isinstance(spec, str) or (isinstance(spec, Sequence) and all(isinstance(s, str) for s in spec)):
        patterns = [spec] if isinstance(spec, str) else list(spec)
        picked = [n for n in named if n and any(_matches(n, p) for p in patterns)]
    elif callable(spec):
        picked = [n for n, m in named.items() if n and spec(n, m)]
    else:
        raise ParallelError(
            f"activation_checkpointing={spec!r}: use None, 'full' (every block), an int k (every k-th block), "
            "module names/patterns, or a predicate (name, module) -> bool"
        )
    return [n for n in picked if not any(n.startswith(o + ".") for o in picked if o != n)]


def _matches(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms))


def checkpointed_modules(model: nn.Module, blocks: list[str], spec: ActivationCheckpointing) -> list[str]:
    """The names of the modules ``activation_checkpointing=spec`` selects (outermost only); selecting none
    is an error, raised before anything is placed."""
    if spec is None or spec is False:
        return []
    chosen = _chosen(model, blocks, spec)
    if not chosen:
        raise ParallelError(
            f"activation_checkpointing={spec!r} selects no module of {type(model).__name__} (its blocks: "
            f"{blocks[:6] or 'none found'}): name modules from model.named_modules(), pass fsdp_units=, "
            "or use a predicate that matches"
        )
    return chosen


def apply_activation_checkpointing(model: nn.Module, names: Sequence[str]) -> None:
    """Recompute the named modules' activations in backward (torch's composable ``checkpoint``: parameter
    names unchanged, so checkpoints load with or without it). Names not in ``model`` (another stage) are skipped."""
    named = dict(model.named_modules())
    for name in names:
        if name in named:
            compat.checkpoint_module(named[name])


def check_compiler(device_type: str, options: Mapping[str, Any]) -> None:
    """Refuse ``compile=`` up front where inductor has no compiler (no C++ compiler on CPU, no triton on GPU)."""
    if options.get("backend", "inductor") != "inductor":
        return
    if device_type == "cpu":
        names = [os.environ.get("CXX") or "", "g++", "c++", "clang++"]
        if not any(n and shutil.which(n) for n in names):
            raise ParallelError(
                "compile=True needs a C++ compiler for torch.compile's inductor backend on CPU, and none "
                "(g++, c++, clang++ or $CXX) is on PATH: install one (e.g. apt-get install g++), or pass "
                "compile={'backend': 'aot_eager'}, or compile=False"
            )
    elif importlib.util.find_spec("triton") is None:
        raise ParallelError(
            f"compile=True on {device_type} needs triton for inductor, which is not installed: install it "
            "(pip install triton), or pass compile={'backend': 'aot_eager'}, or compile=False"
        )


def apply_compile(model: nn.Module, blocks: list[str], options: Mapping[str, Any]) -> None:
    """``Module.compile(**options)`` on each block in place (names unchanged; identical blocks share a graph)."""
    if not blocks:
        raise ParallelError(
            f"compile=True compiles per block and {type(model).__name__} has none found: pass fsdp_units= "
            "(the blocks), or compile the model yourself"
        )
    named = dict(model.named_modules())
    for name in blocks:
        named[name].compile(**dict(options))


# --------------------------------------------------------------------------- memory per rank


@dataclass(frozen=True)
class MemoryPerRank:
    """Bytes this rank holds: parameters and gradients (local shards; a gradient per trainable parameter, as
    the optimizer reads it) and optimizer state (``optimizer_estimated``: Adam-like/SGD state before its
    first step, from the parameters)."""

    params: int
    grads: int
    optimizer: int
    optimizer_estimated: bool = False

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def describe(self) -> str:
        mib = 1024.0**2
        est = " (estimated)" if self.optimizer_estimated else ""
        return (
            f"parameters {self.params / mib:.2f} MiB, gradients {self.grads / mib:.2f} MiB, "
            f"optimizer state {self.optimizer / mib:.2f} MiB{est}, total {self.total / mib:.2f} MiB"
        )


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def memory_per_rank(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryPerRank:
    """The parameter, gradient and optimizer-state bytes this rank holds for ``model`` (no collective)."""
    params = list(model.parameters())
    param_bytes = sum(_local_bytes(p) for p in params)
    grad_bytes = sum(_local_bytes(p) for p in params if p.requires_grad)
    if optimizer is None:
        return MemoryPerRank(param_bytes, grad_bytes, 0)
    ours = {id(p) for p in params}
    state = [v for p, s in optimizer.state.items() if id(p) in ours for v in s.values() if isinstance(v, torch.Tensor)]
    if state:
        return MemoryPerRank(param_bytes, grad_bytes, sum(_local_bytes(t) for t in state))
    estimate = 0
    for group in optimizer.param_groups:
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            per_param = 3 if group.get("amsgrad") else 2  # exp_avg, exp_avg_sq (and max_exp_avg_sq)
        elif isinstance(optimizer, torch.optim.SGD):
            per_param = 1 if group.get("momentum") else 0
        else:
            per_param = 0
        estimate += per_param * sum(_local_bytes(p) for p in group["params"] if id(p) in ours and p.requires_grad)
    return MemoryPerRank(param_bytes, grad_bytes, estimate, optimizer_estimated=estimate > 0)
