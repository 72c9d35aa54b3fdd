"""Context parallel: attention over token windows split along a ``split`` dim, exact, forward and backward.

Each rank holds the queries, keys and values of its own tokens (e.g. the loader's balanced chunks,
``Shard(0, balanced=True)``) and their global positions. Two kinds, one result: ``"gather"`` all-gathers K and V
over the split group once per call and puts them in token order; each run of consecutive local positions attends
to the keys up to its end (causal), saving only q, the gathered K/V, the output and the log-sum-exp; backward
recomputes the scores and sums the key/value gradients back to their owners. ``"ring"``
(:mod:`meshwise.parallel.ring`) passes K/V blocks around the group instead, so no rank holds the whole window's
K/V. ``"auto"`` (the default) takes the ring for windows longer than ``ring_above`` tokens. torch's
``context_parallel`` is not used (docs/context.md says why).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Protocol

import torch.nn as nn

from meshwise.errors import ParallelError
from meshwise.parallel.cp_attention import (
    ENTRY_POINT,
    KINDS,
    RING_ABOVE,
    ContextAttention,
    attention,
    attention_kind,
    check_kind,
    runs_of,
    score_elements,
)
from meshwise.parallel.plugins import Registry
from meshwise.parallel.routing import arm, calls_sdpa
from meshwise.parallel.sdpa import route_sdpa
from meshwise.topology import Topology, resolve

__all__ = [
    "ENTRY_POINT",
    "KINDS",
    "AttentionRouter",
    "on_attention_router",
    "RING_ABOVE",
    "ContextAttention",
    "attention",
    "attention_kind",
    "check_attention_routed",
    "router_of",
    "context_parallel",
    "describe",
    "runs_of",
    "score_elements",
    "unrouted_attention",
]


def _plain_attention(module: nn.Module) -> bool:
    """An attention module without meshwise's entry point: it attends to whatever tokens it is given."""
    if hasattr(module, ENTRY_POINT):
        return False
    cls = type(module)
    hf = cls.__module__.startswith("transformers.") and cls.__name__.endswith("Attention")
    return isinstance(module, nn.MultiheadAttention) or hf or calls_sdpa(cls)


def unrouted_attention(model: nn.Module) -> list[str]:
    """Names of ``model``'s attention modules that would attend only to this rank's tokens under a split dim.

    Routed: a ``context_attention`` entry point that :func:`context_parallel` set. Unrouted: that entry point
    still ``None``, ``nn.MultiheadAttention``, a transformers attention class, or a module whose ``forward``
    calls ``F.scaled_dot_product_attention`` itself — each sees only its rank's part of every window.
    """
    found = []
    for name, m in model.named_modules():
        if (hasattr(m, ENTRY_POINT) and getattr(m, ENTRY_POINT) is None) or _plain_attention(m):
            found.append(name or type(m).__name__)
    return found


def check_attention_routed(model: nn.Module, topology: Topology | None = None) -> None:
    """Refuse, under a split dim of size > 1, a model with attention not routed through meshwise's attention.

    Such attention runs without error on token-split parts and gives a wrong loss (each rank attends only to its
    own chunks), so it is refused before the first step.
    """
    topology = resolve(topology)
    if topology.size(topology.split_dims) == 1:
        return
    bad = unrouted_attention(model)
    if bad:
        raise ParallelError(
            f"the mesh splits tokens over {list(topology.split_dims)}, but {type(model).__name__}'s attention "
            f"module(s) {bad[:4]}{' ...' if len(bad) > 4 else ''} would attend only to this rank's part of every "
            "window (a silently wrong loss): call meshwise.parallel.context.context_parallel(model, topo) first "
            f"(its attention modules declare `{ENTRY_POINT} = None` and call it when set), or drop the split dim"
        )


def _require_positions(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("positions") is None and (len(args) < 2 or args[1] is None):
        raise ParallelError(
            f"{type(module).__name__} runs under context parallel: each rank holds only part of every window, so "
            "call it with the global positions of its tokens, model(batch['input'], positions=batch['positions']) "
            "(a loader with Shard(0, balanced=True) adds them)"
        )


class AttentionRouter(Protocol):
    """How an integration routes the attention of the models it knows (meshwise.hf: transformers models) through
    a :class:`ContextAttention`; ``fix`` says what to do when the first forward proves the routing missed."""

    fix: str

    def claims(self, model: nn.Module) -> bool:
        """Whether this router routes ``model``."""

    def route(self, model: nn.Module, attn: ContextAttention) -> None:
        """Route ``model``'s attention through ``attn`` (its modules get the ``context_attention`` entry point)."""


_ROUTERS: Registry[AttentionRouter] = Registry()


def on_attention_router(router: AttentionRouter) -> None:
    """Register an :class:`AttentionRouter` (integrations do, so this layer never imports them)."""
    _ROUTERS.add(router)


def router_of(model: nn.Module) -> AttentionRouter | None:
    """The registered router that claims ``model``, or None (the entry-point road)."""
    return _ROUTERS.claimant(model)


def context_parallel(
    model: nn.Module,
    topology: Topology | None = None,
    *,
    dim: str | None = None,
    kind: str = "auto",
    ring_above: int = RING_ABOVE,
    sdpa: bool | Sequence[str] = False,
    positions_into: str | Sequence[str] = (),
) -> nn.Module:
    """Make ``model``'s attention attend across the split dim ``dim``; return ``model`` (changed in place).

    Every submodule with a ``context_attention`` attribute (the known entry point: ``None`` by default, called
    as ``self.context_attention(q, k, v, positions)`` when set) gets a :class:`ContextAttention` of ``kind``
    (``"auto"``: the ring for windows longer than ``ring_above`` tokens, else the all-gather). The model's
    ``forward`` must take ``positions`` (its tokens' global positions); calling it without them then raises.
    A transformers model is routed through its attention interface instead.

    ``sdpa``: the road for a model written without meshwise in mind. ``True`` routes the
    ``F.scaled_dot_product_attention`` calls of every module whose own ``forward`` makes them (or name the
    modules); the model is called with ``positions=`` (taken out of the call when its forward has no such
    argument), and each module named in ``positions_into`` (e.g. a learned position embedding) gets them in
    place of the ``torch.arange(t)`` the forward gives it.

    Under a split dim of size > 1 the first forward proves the routing (:mod:`meshwise.parallel.routing`): an
    attention module that did not call meshwise's attention, an SDPA call that bypassed it, or (``sdpa``) a
    ``torch.arange`` of the local token count no ``positions_into`` module took, raise a ``ParallelError``
    naming them before any backward.
    """
    check_kind(kind, ring_above)
    topology = resolve(topology)
    if topology.size(topology.stage_dims) > 1:
        raise ParallelError(
            f"context parallel with pipeline stages (stage dims {list(topology.stage_dims)}) is not supported: the "
            "pipeline hands later stages activations without their tokens' positions, which the causal mask needs; "
            "use a mesh with either a stage dim or a token split dim"
        )
    into = (positions_into,) if isinstance(positions_into, str) else tuple(positions_into)
    if into and sdpa is False:
        raise ParallelError("context_parallel(positions_into=...) belongs to the SDPA road: pass sdpa=True as well")
    router = router_of(model) if sdpa is False else None
    own = sdpa is False and router is None
    if own:  # checked before the attention is built: a bad model is refused on any mesh
        _check_entry_points(model)
    attn = ContextAttention(topology, dim, kind, ring_above)
    route = None
    if sdpa is not False:
        route = route_sdpa(model, attn, sdpa, into)
        fix = (
            "their forward made no F.scaled_dot_product_attention call (e.g. a hand-written softmax path): make "
            "it call SDPA, or give them the `context_attention` entry point"
        )
    elif router is not None:  # e.g. transformers' own attention, routed through its AttentionInterface
        router.route(model, attn)
        fix = router.fix
    else:
        for m in model.modules():
            if hasattr(m, ENTRY_POINT):
                setattr(m, ENTRY_POINT, attn)
        model.register_forward_pre_hook(_require_positions, with_kwargs=True)
        fix = f"their forward must call `self.{ENTRY_POINT}(q, k, v, positions)` when it is set"
    _check_no_plain_attention(model)
    if topology.size(attn.dim) > 1:
        expected = {n: m for n, m in model.named_modules() if getattr(m, ENTRY_POINT, None) is attn}
        local = route.local_tokens if route is not None else None
        arm(model, expected, fix, local_tokens=local, positions_into=into)
    return model


def _check_no_plain_attention(model: nn.Module) -> None:
    others = [n or type(m).__name__ for n, m in model.named_modules() if _plain_attention(m)]
    if others:
        raise ParallelError(
            f"{type(model).__name__}'s attention module(s) {others[:4]} have no `{ENTRY_POINT}` entry point, so "
            "under context parallel they would attend only to this rank's tokens: route them through "
            f"`self.{ENTRY_POINT}(q, k, v, positions)` too, or route their F.scaled_dot_product_attention calls "
            "with context_parallel(model, topo, sdpa=[their names])"
        )


def _check_entry_points(model: nn.Module) -> None:
    if not any(hasattr(m, ENTRY_POINT) for m in model.modules()):
        raise ParallelError(
            f"{type(model).__name__} has no known attention entry point for context parallel: give its attention "
            f"modules an attribute `{ENTRY_POINT} = None` and, when it is set, call "
            f"`self.{ENTRY_POINT}(q, k, v, positions)` instead of F.scaled_dot_product_attention (or call "
            "meshwise.parallel.context.attention yourself), or route its F.scaled_dot_product_attention calls "
            "as they are: context_parallel(model, topo, sdpa=True) (docs/context.md: third-party models)"
        )
    if "positions" not in inspect.signature(model.forward).parameters:
        raise ParallelError(
            f"{type(model).__name__}.forward takes no `positions`: under context parallel the model needs the "
            "global positions of its tokens (position embeddings, the causal mask): add a positions=None argument, "
            "or take the SDPA road, context_parallel(model, topo, sdpa=True, positions_into=[...])"
        )
    _check_no_plain_attention(model)


def describe(model: Any) -> str:
    """Which attention the model's context-parallel entry points run (for the run's description)."""
    found = {getattr(m, ENTRY_POINT) for m in model.modules() if getattr(m, ENTRY_POINT, None) is not None}
    return "; ".join(a.description for a in found) if found else "torch scaled_dot_product_attention (no split)"
