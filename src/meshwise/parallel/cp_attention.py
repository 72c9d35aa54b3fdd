"""The context-parallel attention kernel: exact causal attention over token windows split along a ``split`` dim,
forward and backward, by all-gathering K/V (``"gather"``) or passing K/V blocks around the group (``"ring"``,
:mod:`meshwise.parallel.ring`), and :class:`ContextAttention`, the kernel bound to a topology that attention modules
call. What models call it through (entry points, SDPA, an integration's router) is :mod:`meshwise.parallel.context`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshwise.errors import ParallelError
from meshwise.parallel.ring import ring_attention
from meshwise.parallel.routing import note_call, unwatched
from meshwise.topology import Topology, resolve

__all__ = [
    "check_kind",
    "ContextAttention",
    "ENTRY_POINT",
    "KINDS",
    "RING_ABOVE",
    "attention",
    "attention_kind",
    "runs_of",
    "score_elements",
]


ENTRY_POINT = "context_attention"  # the attribute of a model's attention modules that context_parallel sets
KINDS = ("auto", "ring", "gather")
RING_ABOVE = 2048  # kind="auto": windows longer than this many tokens take the ring (docs/context.md: why)


def attention_kind(window: int, size: int, kind: str = "auto", ring_above: int = RING_ABOVE) -> str:
    """The attention that runs, ``"ring"`` or ``"gather"``, for a ``window`` of tokens split over ``size`` ranks."""
    check_kind(kind, ring_above)
    if kind == "auto":
        return "ring" if size > 1 and window > ring_above else "gather"
    return kind


def check_kind(kind: str, ring_above: int) -> None:
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
    check_kind(kind, ring_above)
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
        check_kind(kind, ring_above)
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
