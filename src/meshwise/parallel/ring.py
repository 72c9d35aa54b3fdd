"""Ring context-parallel attention: K/V blocks travel the split group's ring, no rank holds the whole window's K/V.

Each of the ``k`` split ranks keeps the queries, keys and values of its own tokens. Forward: ``k`` steps; at step
``t`` rank ``r`` scores its queries against the K/V block of rank ``r - t`` (its own first) while it passes that
block on to rank ``r + 1`` (``batch_isend_irecv``), folding each block into an online softmax (running max, sum
and output, rescaled by ``exp(m_old - m_new)``). Autograd saves only the local q, K/V, output and log-sum-exp.
Backward runs the ring again: each K/V block travels with its gradient, every rank adds its queries' share, and
after ``k`` steps the gradient arrives back at the block's owner. The causal mask is by true token positions:
a query tile scores a key run in full, not at all (all keys later), or with the triangle masked; with the
balanced layout every rank scores the same ``2k+1`` chunk blocks. :mod:`meshwise.parallel.context` chooses it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Q_TILE", "ring_plan", "ring_attention"]

Q_TILE = 128  # query rows scored at once: bounds the score tile to Q_TILE x (a key run) per head

Tile = tuple[int, int, int, int, bool]  # local query rows [q0, q1), peer key rows [k0, k1), masked


def _runs(positions: Sequence[int], cut: int) -> list[tuple[int, int, int]]:
    """Runs ``(first row, a, b)`` of consecutive positions ``[a, b)``, cut to at most ``cut`` rows."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            a, b = positions[start], positions[i - 1] + 1
            runs += [(start + j, a + j, min(a + j + cut, b)) for j in range(0, b - a, cut)]
            start = i
    return runs


def ring_plan(
    positions: Sequence[int], peers: Sequence[Sequence[int]], causal: bool, tile: int | None = None
) -> list[list[Tile]]:
    """For each split rank ``j``: the tiles ``(q0, q1, k0, k1, masked)`` this rank scores against ``j``'s block.

    ``positions``: this rank's; ``peers``: every split rank's (``peers[j]`` holds block ``j``'s key positions).
    Key runs are cut to the shortest run of any rank (the middle rank's touching balanced chunks become two
    blocks); query runs are cut further to ``tile`` rows. Causal: a tile is skipped when all its keys come
    after all its queries, scored in full when none does, else keys past its last query are dropped and the
    rest masked by position. ``tile=None``: :data:`Q_TILE`.
    """
    tile = Q_TILE if tile is None else tile
    if not causal:
        n = len(positions)
        rows = [(s, min(s + tile, n)) for s in range(0, n, tile)]
        return [[(q0, q1, 0, len(p), False) for q0, q1 in rows] for p in peers]
    shortest = min(b - a for p in peers for _, a, b in _runs(p, len(p) or 1))
    runs = _runs(positions, shortest)
    queries = [(s + o, a + o, min(a + o + tile, b)) for s, a, b in runs for o in range(0, b - a, tile)]
    plans = []
    for p in peers:
        tiles = []
        for qs, a, b in queries:
            for ks, c, d in _runs(p, shortest):
                if c >= b:  # every key after every query
                    continue
                if d <= a + 1:  # every key at or before every query
                    tiles.append((qs, qs + b - a, ks, ks + d - c, False))
                else:
                    tiles.append((qs, qs + b - a, ks, ks + min(d, b) - c, True))
        plans.append(tiles)
    return plans


def _exchange(send: torch.Tensor, recv: torch.Tensor, group, me: int, size: int, tag: int) -> list:
    """Send ``send`` to the next rank of the ring and receive ``recv`` from the previous one (asynchronous)."""
    nxt, prev = dist.get_global_rank(group, (me + 1) % size), dist.get_global_rank(group, (me - 1) % size)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prev, group, tag)]
    return dist.batch_isend_irecv(ops)


def _scores(q, keys, qpos, kpos, masked: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if masked:
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, peers, plans, group, me, scale):  # type: ignore[override]
        size, d = len(peers), k.shape[-1]
        kv = torch.cat([k, v], dim=-1).contiguous()
        m = q.new_full((*q.shape[:-1], 1), float("-inf"))
        total, acc = q.new_zeros(m.shape), q.new_zeros(*q.shape[:-1], v.shape[-1])
        cur = kv
        for t in range(size):
            j = (me - t) % size
            reqs, nxt = [], None
            if t < size - 1:  # pass the block on while scoring it
                nxt = torch.empty_like(cur)
                reqs = _exchange(cur, nxt, group, me, size, tag=0)
            for q0, q1, k0, k1, masked in plans[j]:
                s = _scores(q[..., q0:q1, :], cur[..., k0:k1, :d], positions[q0:q1], peers[j][k0:k1], masked, scale)
                new = torch.maximum(m[..., q0:q1, :], s.amax(dim=-1, keepdim=True))
                safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # a row with no key yet
                alpha, p = torch.exp(m[..., q0:q1, :] - safe), torch.exp(s - safe)
                total[..., q0:q1, :] = total[..., q0:q1, :] * alpha + p.sum(dim=-1, keepdim=True)
                acc[..., q0:q1, :] = acc[..., q0:q1, :] * alpha + torch.matmul(p, cur[..., k0:k1, d:])
                m[..., q0:q1, :] = new
            for r in reqs:
                r.wait()
            if nxt is not None:
                cur = nxt
        out = acc / total
        lse = m + torch.log(total)
        ctx.save_for_backward(q, kv, out, lse, positions)
        ctx.peers, ctx.plans, ctx.group, ctx.me, ctx.scale, ctx.d = peers, plans, group, me, scale, d
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, kv, out, lse, positions = ctx.saved_tensors
        peers, plans, group, me, scale, d = ctx.peers, ctx.plans, ctx.group, ctx.me, ctx.scale, ctx.d
        size = len(peers)
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq, cur, dcur = torch.zeros_like(q), kv, torch.zeros_like(kv)
        for t in range(size):
            j = (me - t) % size
            reqs, nxt, dnxt = [], None, None
            if t < size - 1:  # the block moves on now; its gradient once this rank has added its share
                nxt = torch.empty_like(cur)
                reqs = _exchange(cur, nxt, group, me, size, tag=0)
            for q0, q1, k0, k1, masked in plans[j]:
                qr, gr, keys, values = q[..., q0:q1, :], dout[..., q0:q1, :], cur[..., k0:k1, :d], cur[..., k0:k1, d:]
                s = _scores(qr, keys, positions[q0:q1], peers[j][k0:k1], masked, scale)
                p = torch.exp(s - lse[..., q0:q1, :])
                dcur[..., k0:k1, d:] += torch.matmul(p.transpose(-1, -2), gr)
                ds = p * (torch.matmul(gr, values.transpose(-1, -2)) - delta[..., q0:q1, :]) * scale
                dq[..., q0:q1, :] += torch.matmul(ds, keys)
                dcur[..., k0:k1, :d] += torch.matmul(ds.transpose(-1, -2), qr)
            if size > 1:  # after the last step this sends block me+1's gradient home and receives my own
                dnxt = torch.empty_like(dcur)
                reqs += _exchange(dcur, dnxt, group, me, size, tag=1)
            for r in reqs:
                r.wait()
            if nxt is not None:
                cur = nxt
            if dnxt is not None:
                dcur = dnxt
        return dq, dcur[..., :d], dcur[..., d:], None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    gathered: torch.Tensor,
    group,
    me: int,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Ring attention of this rank's ``q, k, v`` (``[..., n, head_dim]``) at ``positions`` (``[n]``).

    ``gathered``: every split rank's positions in group-rank order (``[size * n]``, checked by the caller to be
    ``0..T-1`` once each); ``group``/``me``: the split group and this rank's index in it (``None``/0: one rank).
    """
    size = gathered.numel() // positions.numel()
    peers_list = gathered.view(size, -1).tolist()
    plans = ring_plan(positions.tolist(), peers_list, causal)
    peers = list(gathered.view(size, -1).to(q.device).unbind(0))
    return _RingAttention.apply(q, k, v, positions.to(q.device), peers, plans, group, me, scale)
