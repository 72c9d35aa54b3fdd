"""The SDPA road of context parallel: a model written without meshwise in mind, run as it is written.

The ``F.scaled_dot_product_attention`` calls of chosen modules become meshwise's attention (a torch function mode
held by a ``with`` inside each module's forward, so activation checkpointing's recompute is routed too and an
exception cannot leave it on), the model is called with ``positions=`` (taken out of the call when its forward
has no such argument), and named position modules get those positions in place of the ``torch.arange(t)`` the
forward builds. :func:`meshwise.parallel.context.context_parallel` takes this road with ``sdpa=``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshwise.errors import ParallelError
from meshwise.parallel.cp_attention import ENTRY_POINT, ContextAttention, attention
from meshwise.parallel.routing import calls_sdpa, unwatched

__all__ = ["SDPARoute", "route_sdpa", "sdpa_modules"]


class _RoutedSDPA(TorchFunctionMode):
    """Inside a routed module's forward: ``F.scaled_dot_product_attention`` becomes meshwise's attention."""

    def __init__(self, route: SDPARoute, name: str) -> None:
        super().__init__()
        self.route, self.name = route, name

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.route.sdpa(self.name, *args, **kwargs)


class _Routed:
    """A routed module's forward: its own, with a ``with`` around it, so an exception cannot leave the mode on and
    activation checkpointing's recompute is routed too (an object, not a closure: a deep copy gets its own)."""

    def __init__(self, route: SDPARoute, name: str, module: nn.Module) -> None:
        self.route, self.name, self.module = route, name, module
        self.own = module.__dict__.get("forward")

    def forward(self) -> Any:
        return self.own if self.own is not None else functools.partial(type(self.module).forward, self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _RoutedSDPA(self.route, self.name):
            return self.forward()(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.forward())


class SDPARoute:
    """The SDPA road: the positions of the forward under way, and SDPA calls turned into meshwise's attention."""

    def __init__(self, attn: ContextAttention, takes_positions: bool) -> None:
        self.attn, self.takes_positions = attn, takes_positions
        self.positions: torch.Tensor | None = None  # kept after the forward: activation checkpointing recomputes

    def take_positions(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get("positions") is None:
            raise ParallelError(
                f"{type(module).__name__} runs under context parallel through its F.scaled_dot_product_attention "
                "calls: each rank holds only part of every window, so call it with its tokens' global positions, "
                "model(batch['input'], positions=batch['positions']) (a loader with Shard(0, balanced=True) adds "
                "them); meshwise takes them out of the call when forward has no `positions` argument"
            )
        self.positions = kwargs["positions"]
        if self.takes_positions:
            return None
        return args, {k: v for k, v in kwargs.items() if k != "positions"}

    def local_tokens(self) -> int | None:
        return None if self.positions is None else int(self.positions.shape[-1])

    def replace_positions(self, name: str, module: nn.Module, args: tuple) -> tuple | None:
        """A ``positions_into`` module's input, ``torch.arange(t)`` over the local tokens, becomes the global ones."""
        if not args or not isinstance(args[0], torch.Tensor) or self.positions is None:
            raise ParallelError(f"positions_into module {name!r} was called without a tensor input")
        x, pos = args[0], self.positions.reshape(-1, self.positions.shape[-1])[0]
        if x.shape[-1] != pos.numel() or x.dtype.is_floating_point:
            raise ParallelError(
                f"positions_into module {name!r} got an input of shape {list(x.shape)} ({x.dtype}); it should get "
                f"the forward's positions of the {pos.numel()} local tokens (integer, last dim {pos.numel()})"
            )
        with unwatched():  # meshwise's own comparison, not the model's positions
            local = torch.arange(pos.numel(), device=x.device, dtype=x.dtype)
            if bool((x == local).all()):
                return (pos.to(device=x.device, dtype=x.dtype).expand(x.shape), *args[1:])
            if bool((x == pos.to(device=x.device, dtype=x.dtype)).all()):
                return None  # already the global positions
        raise ParallelError(
            f"positions_into module {name!r} got positions that are neither torch.arange({pos.numel()}) (built in "
            "the forward, which meshwise replaces by the batch's) nor the batch's own: name the module that is "
            "given torch.arange(t), or pass the batch's positions into your forward yourself"
        )

    def sdpa(
        self,
        name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None:
            raise ParallelError(
                f"{name!r} calls F.scaled_dot_product_attention with attn_mask under context parallel: a mask over "
                "this rank's tokens cannot say which tokens of other ranks to attend to; use is_causal=True (causal "
                "by the tokens' true positions) or no mask"
            )
        if dropout_p:
            raise ParallelError(
                f"{name!r}: attention dropout {dropout_p} under context parallel is not supported: set it to 0"
            )
        if query.shape[-2] != key.shape[-2]:
            raise ParallelError(
                f"{name!r} calls F.scaled_dot_product_attention with {query.shape[-2]} queries and {key.shape[-2]} "
                "keys: context parallel routes self-attention over the split window only"
            )
        if key.shape[-3] != query.shape[-3] and (enable_gqa or query.ndim == 4):
            groups = query.shape[-3] // key.shape[-3]  # grouped-query heads, as SDPA's enable_gqa repeats them
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        a = self.attn
        return attention(
            query, key, value, self.positions, a.topology, dim=a.dim, is_causal=is_causal, scale=scale,
            kind=a.kind, ring_above=a.ring_above,
        )  # fmt: skip


def sdpa_modules(model: nn.Module, sdpa: bool | Sequence[str]) -> dict[str, nn.Module]:
    named = dict(model.named_modules())
    if sdpa is True:
        found = {n: m for n, m in named.items() if not hasattr(m, ENTRY_POINT) and calls_sdpa(type(m))}
        if not found:
            raise ParallelError(
                f"context_parallel(sdpa=True): no module of {type(model).__name__} calls "
                "F.scaled_dot_product_attention in its own forward: name the modules whose forward calls it, "
                "sdpa=['blocks.0.attn', ...]"
            )
        return found
    names = [sdpa] if isinstance(sdpa, str) else list(sdpa)
    missing = [n for n in names if n not in named]
    if missing:
        raise ParallelError(
            f"context_parallel(sdpa=...): {missing} name no submodule of {type(model).__name__} "
            f"(names: {[n for n in named if n][:12]} ...)"
        )
    return {n: named[n] for n in names}


def route_sdpa(model: nn.Module, attn: ContextAttention, sdpa: bool | Sequence[str], into: tuple) -> SDPARoute:
    """Route the SDPA calls of the chosen modules' forwards, and the positions, through meshwise's attention."""
    modules = sdpa_modules(model, sdpa)
    named = dict(model.named_modules())
    missing = [n for n in into if n not in named]
    if missing:
        raise ParallelError(
            f"context_parallel(positions_into=...): {missing} name no submodule of {type(model).__name__} "
            f"(names: {[n for n in named if n][:12]} ...)"
        )
    route = SDPARoute(attn, "positions" in inspect.signature(model.forward).parameters)
    for name, m in modules.items():
        setattr(m, ENTRY_POINT, attn)  # marks it routed: check_attention_routed, describe
        m.forward = _Routed(route, name, m)
    for name in into:
        named[name].register_forward_pre_hook(functools.partial(_positions_hook, route, name))
    model.register_forward_pre_hook(route.take_positions, with_kwargs=True)
    return route


def _positions_hook(route: SDPARoute, name: str, module: nn.Module, args: tuple) -> tuple | None:
    return route.replace_positions(name, module, args)
