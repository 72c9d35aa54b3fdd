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

Q_TILE = 128  # at most this many query rows are scored at once

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


def _rows(n: int, head_dim: int | None, keys: int) -> int:
    """Query rows a tile scores: a score tile (rows x keys) holds at most a quarter of a K block (n x head_dim)."""
    return Q_TILE if head_dim is None else min(Q_TILE, max(1, n * head_dim // (4 * max(keys, 1))))


def ring_plan(
    positions: Sequence[int], peers: Sequence[Sequence[int]], causal: bool, head_dim: int | None = None
) -> list[list[Tile]]:
    """For each split rank ``j``: the tiles ``(q0, q1, k0, k1, masked)`` this rank scores against ``j``'s block.

    ``positions``: this rank's; ``peers``: every split rank's (``peers[j]`` holds block ``j``'s key positions).
    Key runs are cut to the shortest run of any rank (the middle rank's touching balanced chunks become two
    blocks); query runs are cut further so that a score tile holds at most a quarter of a K block of
    ``head_dim`` columns (and at most :data:`Q_TILE` rows; ``head_dim=None``: ``Q_TILE`` rows). Causal: a tile is
    skipped when all its keys come after all its queries, scored in full when none does, else keys past its
    last query are dropped and the rest masked by position.
    """
    n = len(positions)
    if not causal:
        tile = _rows(n, head_dim, n)
        rows = [(s, min(s + tile, n)) for s in range(0, n, tile)]
        return [[(q0, q1, 0, len(p), False) for q0, q1 in rows] for p in peers]
    shortest = min(b - a for p in peers for _, a, b in _runs(p, len(p) or 1))
    tile = _rows(n, head_dim, shortest)
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


def _exchange(send: Sequence[torch.Tensor], group, me: int, size: int, tag: int) -> tuple[list, list]:
    """Send the tensors ``send`` to the next rank of the ring, receive their like from the previous one (async)."""
    nxt, prev = dist.get_global_rank(group, (me + 1) % size), dist.get_global_rank(group, (me - 1) % size)
    recv = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag + i) for i, t in enumerate(send)]
    ops += [dist.P2POp(dist.irecv, t, prev, group, tag + i) for i, t in enumerate(recv)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    """Wait for the exchange, then drop its works: they hold the sent tensors, which would stay alive."""
    for r in reqs:
        r.wait()
    reqs.clear()


def _scores(q, keys, qpos, kpos, masked: bool, scale: float) -> torch.Tensor:
    """One score tile, built in place (one tile-sized tensor)."""
    s = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)
    if masked:
        s.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
    return s


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are kept in: float32 for 16-bit inputs (k steps of rescaling), else the inputs' own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, peers, plans, group, me, scale):  # type: ignore[override]
        size, dtype = len(peers), _accumulate(q.dtype)
        m = q.new_full((*q.shape[:-1], 1), float("-inf"), dtype=dtype)
        total, acc = q.new_zeros(m.shape, dtype=dtype), q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=dtype)
        keys, values = k.contiguous(), v.contiguous()
        for t in range(size):
            j = (me - t) % size
            reqs, nxt = [], None
            if t < size - 1:  # pass the block on while scoring it
                nxt, reqs = _exchange((keys, values), group, me, size, tag=0)
            for q0, q1, k0, k1, masked in plans[j]:
                s = _scores(q[..., q0:q1, :], keys[..., k0:k1, :], positions[q0:q1], peers[j][k0:k1], masked, scale)
                s = s.to(dtype)
                new = torch.maximum(m[..., q0:q1, :], s.amax(dim=-1, keepdim=True))
                safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # a row with no key yet
                alpha, p = torch.exp(m[..., q0:q1, :] - safe), s.sub_(safe).exp_()
                total[..., q0:q1, :] = total[..., q0:q1, :] * alpha + p.sum(dim=-1, keepdim=True)
                acc[..., q0:q1, :] = acc[..., q0:q1, :] * alpha + torch.matmul(
                    p.to(values.dtype), values[..., k0:k1, :]
                )
                m[..., q0:q1, :] = new
                del s, p
            _wait(reqs)
            if nxt is not None:
                keys, values = nxt
        out = acc.div_(total).to(q.dtype)
        lse = m.add_(torch.log(total))
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.peers, ctx.plans, ctx.group, ctx.me, ctx.scale = peers, plans, group, me, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, positions = ctx.saved_tensors
        peers, plans, group, me, scale = ctx.peers, ctx.plans, ctx.group, ctx.me, ctx.scale
        size, dtype = len(peers), lse.dtype
        dout = dout.contiguous()
        delta = (dout.to(dtype) * out.to(dtype)).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q, dtype=dtype)
        keys, values = k.contiguous(), v.contiguous()
        dkeys, dvalues = torch.zeros_like(keys, dtype=dtype), torch.zeros_like(values, dtype=dtype)
        for t in range(size):
            j = (me - t) % size
            for q0, q1, k0, k1, masked in plans[j]:
                qr, gr = q[..., q0:q1, :], dout[..., q0:q1, :]
                p = _scores(qr, keys[..., k0:k1, :], positions[q0:q1], peers[j][k0:k1], masked, scale).to(dtype)
                p.sub_(lse[..., q0:q1, :]).exp_()
                dvalues[..., k0:k1, :] += torch.matmul(p.to(gr.dtype).transpose(-1, -2), gr)
                ds = torch.matmul(gr, values[..., k0:k1, :].transpose(-1, -2)).to(dtype)
                ds.sub_(delta[..., q0:q1, :]).mul_(p).mul_(scale)
                del p
                ds = ds.to(q.dtype)
                dq[..., q0:q1, :] += torch.matmul(ds, keys[..., k0:k1, :])
                dkeys[..., k0:k1, :] += torch.matmul(ds.transpose(-1, -2), qr)
                del ds
            if size == 1:
                break
            # after scoring, not during, and one tensor at a time: a rank holds its block, the block's gradient and
            # one received tensor at most (memory over overlap); the last step sends block me+1's gradient home
            held = [keys, values, dkeys, dvalues]
            del keys, values, dkeys, dvalues
            for x in range(0 if t < size - 1 else 2, 4):
                (held[x],), reqs = _exchange((held[x],), group, me, size, tag=x)
                _wait(reqs)
            keys, values, dkeys, dvalues = held
            del held
        dq, dkeys, dvalues = dq.to(q.dtype), dkeys.to(k.dtype), dvalues.to(v.dtype)
        return dq, dkeys, dvalues, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    gathered: torch.Tensor,
    group: dist.ProcessGroup | None,
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
    plans = ring_plan(positions.tolist(), peers_list, causal, head_dim=k.shape[-1])
    peers = list(gathered.view(size, -1).to(q.device).unbind(0))
    return _RingAttention.apply(q, k, v, positions.to(q.device), peers, plans, group, me, scale)
