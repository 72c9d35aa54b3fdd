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
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from meshwise.errors import ParallelError
from meshwise.parallel.ring import ring_attention
from meshwise.parallel.routing import arm, calls_sdpa, note_call, unwatched
from meshwise.topology import Topology, resolve

__all__ = [
    "KINDS",
    "RING_ABOVE",
    "ContextAttention",
    "attention",
    "attention_kind",
    "check_attention_routed",
    "context_parallel",
    "describe",
    "runs_of",
    "score_elements",
    "unrouted_attention",
]

ENTRY_POINT = "context_attention"  # the attribute of a model's attention modules that context_parallel sets
KINDS = ("auto", "ring", "gather")
RING_ABOVE = 2048  # kind="auto": windows longer than this many tokens take the ring (docs/context.md: why)


def attention_kind(window: int, size: int, kind: str = "auto", ring_above: int = RING_ABOVE) -> str:
    """The attention that runs, ``"ring"`` or ``"gather"``, for a ``window`` of tokens split over ``size`` ranks."""
    _check_kind(kind, ring_above)
    if kind == "auto":
        return "ring" if size > 1 and window > ring_above else "gather"
    return kind


def _check_kind(kind: str, ring_above: int) -> None:
    if kind not in KINDS:
        raise ParallelError(f"context-parallel attention kind={kind!r}: choose one of {list(KINDS)}")
    if isinstance(ring_above, bool) or not isinstance(ring_above, int) or ring_above < 0:
        raise ParallelError(
            f"context-parallel attention ring_above={ring_above!r}: give a window length in tokens, an int >= 0 "
            f"(default {RING_ABOVE}; 0 takes the ring for every window)"
        )


def _gather_positions(positions: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Every split rank's positions in group order (``[size * n]``), checked to be ``0..T-1`` once each."""
    if size > 1:
        n = torch.tensor([positions.numel()], dtype=torch.int64, device=positions.device)
        counts = [torch.empty_like(n) for _ in range(size)]
        dist.all_gather(counts, n, group=group)
        counts = [int(c) for c in counts]
        if len(set(counts)) > 1:  # every rank sees the same counts: the same verdict everywhere, no hang
            raise ParallelError(
                f"context-parallel attention: the split ranks hold {counts} tokens of the window; each must hold "
                f"the same number (T / {size}) so K/V blocks of one size can pass between them: load the token "
                f"fields with Shard(0, balanced=True) and a window length divisible by {2 * size}"
            )
        parts = [torch.empty_like(positions) for _ in range(size)]
        dist.all_gather(parts, positions.contiguous(), group=group)
        gathered = torch.cat(parts)
    else:
        gathered = positions
    if not torch.equal(torch.sort(gathered).values, torch.arange(gathered.numel(), device=gathered.device)):
        with unwatched():
            local = torch.arange(positions.numel(), device=gathered.device)
        if size > 1 and positions.numel() and bool((gathered.view(size, -1) == local).all()):
            raise ParallelError(
                f"context-parallel attention: every split rank passed positions 0..{positions.numel() - 1}, the local "
                "token count: they were built inside the forward (torch.arange(t) over this rank's part), but the "
                f"ranks hold different parts of a window of {gathered.numel()} tokens; pass the batch's global "
                "positions, model(x, positions=batch['positions']) (position_ids= for transformers models), and use "
                "them in the forward instead of torch.arange (docs/context.md: third-party models)"
            )
        raise ParallelError(
            f"context-parallel attention: the positions of the split ranks' tokens are not 0..{gathered.numel() - 1} "
            f"once each (got {sorted(gathered.tolist())[:16]}...): pass batch['positions'] from a loader with "
            "Shard(0, balanced=True) (or Shard(0)) on the token fields, the same on every rank of the split group"
        )
    return gathered


def _layout(positions: torch.Tensor, gathered: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The order that sorts the gathered keys into token order, and the local query runs ``(start, a, b)``.

    A run is local rows ``[start, start + b - a)`` holding the consecutive positions ``[a, b)``.
    """
    peers = gathered.view(-1, positions.numel()).tolist()
    return torch.argsort(gathered), runs_of(positions.tolist(), peers)


def _runs(positions: Sequence[int]) -> list[tuple[int, int, int]]:
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, positions[start], positions[i - 1] + 1))
            start = i
    return runs


def runs_of(positions: Sequence[int], peers: Sequence[Sequence[int]] = ()) -> list[tuple[int, int, int]]:
    """Runs of consecutive positions ``(first local row, a, b)``: the run's rows hold positions ``[a, b)``.

    Runs are cut to the length of the shortest run of any rank (``peers``: every split rank's positions): a run
    scores its queries against keys up to its end, so a long run computes a large masked triangle. With balanced
    parts the middle rank's two chunks touch; cut apart, every rank scores the same ``2k+1`` chunk-sized blocks.
    """
    runs = _runs(positions)
    cut = min((b - a for p in [positions, *peers] for _, a, b in _runs(p)), default=0)
    return [(s + j, a + j, min(a + j + cut, b)) for s, a, b in runs for j in range(0, b - a, cut)]


def score_elements(positions: Sequence[int], peers: Sequence[Sequence[int]] = (), causal: bool = True) -> int:
    """Attention scores a rank computes per head and query row for its tokens at ``positions``.

    ``peers``: every split rank's positions, as the attention sees them. Causal: a run of positions ``[a, b)``
    scores its ``b - a`` queries against keys ``[0, b)``; otherwise every query scores the whole window.
    """
    window = len(positions) * max(len(peers), 1)
    return sum((b - a) * (b if causal else window) for _, a, b in runs_of(list(positions), peers))


def _scores(q: torch.Tensor, k: torch.Tensor, a: int, b: int, causal: bool, scale: float) -> torch.Tensor:
    """Scores of queries at positions ``[a, b)`` against keys ``[0, b)`` (``[0, T)`` when not causal)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:  # only the last b - a keys can be later than a query: a triangle, built per call, never saved
        tri = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu_(1)
        s[..., a:b] = s[..., a:b].masked_fill(tri, float("-inf"))
    return s


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, gathered, group, me, causal, scale):  # type: ignore[override]
        size = dist.get_world_size(group) if group is not None else 1
        kv = torch.cat([k, v], dim=-1).contiguous()
        if size > 1:
            parts = [torch.empty_like(kv) for _ in range(size)]
            dist.all_gather(parts, kv, group=group)
            kv = torch.cat(parts, dim=-2)
        perm, runs = _layout(positions, gathered)
        kv = kv.index_select(-2, perm)  # token order
        d = k.shape[-1]
        keys, values = kv[..., :d], kv[..., d:]
        out, lses = q.new_empty(*q.shape[:-1], v.shape[-1]), []
        for start, a, b in runs:
            stop = b if causal else keys.shape[-2]
            s = _scores(q[..., start : start + b - a, :], keys[..., :stop, :], a, b, causal, scale)
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            out[..., start : start + b - a, :] = torch.matmul(torch.exp(s - lse), values[..., :stop, :])
            lses.append(lse)
        ctx.save_for_backward(q, kv, out, perm, *lses)
        ctx.runs, ctx.group, ctx.me, ctx.causal, ctx.scale, ctx.d, ctx.size = runs, group, me, causal, scale, d, size
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, kv, out, perm, *lses = ctx.saved_tensors
        d, scale = ctx.d, ctx.scale
        keys, values = kv[..., :d], kv[..., d:]
        dq, dkv = torch.zeros_like(q), torch.zeros_like(kv)
        dkeys, dvalues = dkv[..., :d], dkv[..., d:]
        for (start, a, b), lse in zip(ctx.runs, lses):
            rows = slice(start, start + b - a)
            stop = b if ctx.causal else keys.shape[-2]
            qr, gr = q[..., rows, :], dout[..., rows, :]
            p = torch.exp(_scores(qr, keys[..., :stop, :], a, b, ctx.causal, scale) - lse)
            dvalues[..., :stop, :] += torch.matmul(p.transpose(-1, -2), gr)
            dp = torch.matmul(gr, values[..., :stop, :].transpose(-1, -2))
            ds = p * (dp - (gr * out[..., rows, :]).sum(dim=-1, keepdim=True)) * scale
            dq[..., rows, :] = torch.matmul(ds, keys[..., :stop, :])
            dkeys[..., :stop, :] += torch.matmul(ds.transpose(-1, -2), qr)
        # back to gathered (rank) order; every rank's queries add to every key: sum, then keep my own rows
        dkv = torch.empty_like(dkv).index_copy_(-2, perm, dkv)
        if ctx.size > 1:
            dist.all_reduce(dkv, group=ctx.group)
        n = q.shape[-2]
        mine = dkv[..., ctx.me * n : (ctx.me + 1) * n, :]
        return dq, mine[..., :d], mine[..., d:], None, None, None, None, None, None


def _split_dim(topology: Topology, dim: str | None) -> str:
    split = list(topology.split_dims)
    if dim is None:
        if len(split) != 1:
            raise ParallelError(
                f"context-parallel attention needs the split dim that cuts the token windows; the mesh has "
                f"{split or 'none'} ({topology.layout.dims_text()}): add one (e.g. {{'dp': -1, 'cp': 2}}) or pass "
                "dim=..."
            )
        return split[0]
    if topology.roles.get(dim) != "split":
        raise ParallelError(
            f"context-parallel attention over {dim!r}: not a split dim of the mesh ({topology.layout.dims_text()}); "
            f"name a split dim or declare roles={{{dim!r}: 'split'}}"
        )
    return dim


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    topology: Topology | None = None,
    *,
    dim: str | None = None,
    is_causal: bool = True,
    scale: float | None = None,
    kind: str = "auto",
    ring_above: int = RING_ABOVE,
) -> torch.Tensor:
    """Attention of this rank's tokens to every token of the window, split over the split dim ``dim``.

    ``q``, ``k``, ``v``: ``[..., T_local, head_dim]`` (e.g. ``[B, heads, T_local, head_dim]``, as for
    ``F.scaled_dot_product_attention``); ``positions``: the global index of each local token, ``[T_local]`` or
    ``[B, T_local]`` with equal rows (the loader's ``batch["positions"]``). The split ranks' positions together
    must be ``0..T-1`` once each, every rank with the same ``T_local``. Causal by the true positions
    (``is_causal=False``: every token sees the whole window). Equals one process's attention over the whole
    window, forward and backward. ``kind``: ``"gather"``, ``"ring"`` or ``"auto"`` (the ring for windows longer
    than ``ring_above`` tokens, :func:`attention_kind`). Communication on ``topology.group(dim)``: two small
    all-gathers of the token counts and positions, then for ``"gather"`` one all-gather of K and V forward and one
    all-reduce of their gradients backward; for ``"ring"`` ``size - 1`` sends of a K/V block to the next rank
    forward, ``size - 1`` K/V and ``size`` gradient sends backward.
    """
    _check_kind(kind, ring_above)
    note_call()  # the routing proof counts the calls (meshwise.parallel.routing)
    topology = resolve(topology)
    dim = _split_dim(topology, dim)
    if not (q.shape[-2] == k.shape[-2] == v.shape[-2] and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ParallelError(
            f"context-parallel attention wants q, k, v of one shape [..., T_local, head_dim], got {list(q.shape)}, "
            f"{list(k.shape)}, {list(v.shape)}"
        )
    if positions.ndim == 2:
        if positions.shape[0] == 0:  # no valid row here: the split peers hold the same (no) samples
            return q * 0
        if not bool((positions == positions[:1]).all()):
            raise ParallelError("context-parallel attention: positions differ between rows; every row shares one")
        positions = positions[0]
    if positions.ndim != 1 or positions.numel() != q.shape[-2]:
        raise ParallelError(
            f"context-parallel attention: positions of shape {list(positions.shape)} for {q.shape[-2]} local tokens; "
            "pass batch['positions'] ([B, T_local]) or one row of it"
        )
    size = topology.size(dim)
    group = topology.group(dim) if size > 1 else None
    me = dist.get_group_rank(group, dist.get_rank()) if group is not None else 0
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    positions = positions.to(torch.int64)
    gathered = _gather_positions(positions, group, size)
    if gathered.numel() == 0:  # no token on any split rank
        return q * 0
    if attention_kind(gathered.numel(), size, kind, ring_above) == "ring":
        return ring_attention(q, k, v, positions, gathered, group, me, is_causal, scale)
    return _ContextAttention.apply(q, k, v, positions, gathered, group, me, is_causal, scale)


class ContextAttention:
    """The attention a model's attention modules call under context parallel: ``(q, k, v, positions) -> y``."""

    def __init__(
        self, topology: Topology | None = None, dim: str | None = None, kind: str = "auto", ring_above: int = RING_ABOVE
    ) -> None:
        _check_kind(kind, ring_above)
        self.topology = resolve(topology)
        self.dim = _split_dim(self.topology, dim)
        self.kind, self.ring_above = kind, ring_above
        how = {
            "gather": "K/V all-gathered",
            "ring": "K/V blocks passed around the ring",
            "auto": f"K/V all-gathered for windows up to {ring_above} tokens, passed around a ring above",
        }[kind]
        name = {"gather": "all-gather", "ring": "ring", "auto": "context"}[kind]
        self.description = (
            f"meshwise {name} attention over {self.dim!r} ({self.topology.size(self.dim)} ranks: {how}, causal by "
            "true token positions)"
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, positions, self.topology, dim=self.dim, kind=self.kind, ring_above=self.ring_above)

    def __repr__(self) -> str:
        return f"ContextAttention({self.description})"


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
    _check_kind(kind, ring_above)
    topology = resolve(topology)
    if topology.size(topology.stage_dims) > 1:
        raise ParallelError(
            f"context parallel with pipeline stages (stage dims {list(topology.stage_dims)}) is not supported: the "
            "pipeline hands later stages activations without their tokens' positions, which the causal mask needs; "
            "use a mesh with either a stage dim or a token split dim"
        )
    from meshwise.parallel.hf import hf_context_parallel, is_hf_model

    into = (positions_into,) if isinstance(positions_into, str) else tuple(positions_into)
    if into and sdpa is False:
        raise ParallelError("context_parallel(positions_into=...) belongs to the SDPA road: pass sdpa=True as well")
    own = sdpa is False and not is_hf_model(model)
    if own:  # checked before the attention is built: a bad model is refused on any mesh
        _check_entry_points(model)
    attn = ContextAttention(topology, dim, kind, ring_above)
    route = None
    if sdpa is not False:
        from meshwise.parallel.sdpa import route_sdpa

        route = route_sdpa(model, attn, sdpa, into)
        fix = (
            "their forward made no F.scaled_dot_product_attention call (e.g. a hand-written softmax path): make "
            "it call SDPA, or give them the `context_attention` entry point"
        )
    elif not own:  # transformers' own attention, routed through its AttentionInterface
        hf_context_parallel(model, attn)
        fix = (
            "this transformers family's attention does not call transformers' attention interface "
            "(config._attn_implementation), which is the only door meshwise has into it: train it without a "
            "split dim, or pick a family whose attention goes through the interface (Llama, Mistral, Qwen, ...)"
        )
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
