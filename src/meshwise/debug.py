"""Collective fingerprints and hang reports that name the mesh dims, their roles, the step and the missing ranks.

Wrap a collective in :func:`guarded`: each rank leaves an arrival mark (with a fingerprint of the
op, shape and dtype) in the process group's store before it enters. When the collective fails —
a timeout on gloo/NCCL — the error lists which ranks of the group never arrived, and which arrived
with a different op or shape. With ``MESHWISE_DEBUG=1`` (or ``check=True``) the fingerprints are
compared *before* the collective, so a shape mismatch is an error instead of a gloo abort.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from meshwise.errors import CollectiveTimeoutError
from meshwise.topology import Dims, Topology

_SEQ: dict[tuple[str, ...], int] = {}
_KEEP = 16  # marks older than this many calls on a group are deleted: every member has long passed them


def debug_enabled() -> bool:
    """True when ``MESHWISE_DEBUG`` is set to a true value."""
    return os.environ.get("MESHWISE_DEBUG", "").lower() in ("1", "true", "yes", "on")


def fingerprint(op: str, tensor: torch.Tensor | None = None, step: int | None = None) -> str:
    """``all_reduce float32[4,8] step 12``: what a rank is about to do."""
    shape = "" if tensor is None else f" {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
    return f"{op}{shape}" + ("" if step is None else f" step {step}")


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _key(dims: tuple[str, ...], ranks: Sequence[int], seq: int, rank: int) -> str:
    return f"meshwise/guard/{'_'.join(dims)}/{ranks[0]}/{seq}/{rank}"


def _where(topo: Topology, dims: tuple[str, ...], ranks: Sequence[int]) -> str:
    roles = ", ".join(f"{d} ({topo.roles[d]})" for d in dims)
    return f"over {roles}, group of ranks {list(ranks)}"


def _report(store: dist.Store, keys: dict[int, str], mine: str) -> tuple[list[int], dict[int, str]]:
    """Ranks without a mark, and ranks whose mark differs; if the store itself is gone, say so instead."""
    missing, different = [], {}
    try:
        for rank, key in keys.items():
            if not store.check([key]):
                missing.append(rank)
                continue
            theirs = store.get(key).decode()
            if theirs != mine:
                different[rank] = theirs
    except (RuntimeError, dist.DistError) as exc:  # the store's host (rank 0) has exited
        return [], {-1: f"unknown: the store could not be asked ({type(exc).__name__})"}
    return missing, different


@contextmanager
def guarded(
    topo: Topology,
    dims: Dims,
    op: str,
    *,
    tensor: torch.Tensor | None = None,
    step: int | None = None,
    check: bool | None = None,
) -> Iterator[None]:
    """Run the collective in the ``with`` body on ``topo.group(dims)`` with a named failure.

    ``op``, ``tensor`` and ``step`` form the fingerprint. On failure raises
    :class:`~meshwise.errors.CollectiveTimeoutError` naming the dims, their roles, the step, the
    ranks that did not arrive and the ranks that arrived with another fingerprint.
    """
    names = topo.layout.normalize(dims)
    ranks = topo.group_ranks(names)
    if len(ranks) == 1:
        yield
        return
    store = _store()
    group_key = (*names, str(ranks[0]))
    seq = _SEQ.get(group_key, 0)
    _SEQ[group_key] = seq + 1
    mine = fingerprint(op, tensor, step)
    keys = {r: _key(names, ranks, seq, r) for r in ranks}
    store.set(keys[topo.rank], mine)
    if seq >= _KEEP:
        store.delete_key(_key(names, ranks, seq - _KEEP, topo.rank))
    at = "" if step is None else f" at step {step}"
    if debug_enabled() if check is None else check:
        try:
            store.wait(list(keys.values()), topo.timeout)
        except (RuntimeError, dist.DistError):
            pass  # reported below with the ranks that are missing
        missing, different = _report(store, keys, mine)
        if missing or different:
            raise CollectiveTimeoutError(_message(topo, names, ranks, mine, at, missing, different, before=True))
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        missing, different = _report(store, keys, mine)
        if not missing and not different:
            raise  # every rank came with the same call: nothing to add (e.g. an error in the user's model)
        raise CollectiveTimeoutError(_message(topo, names, ranks, mine, at, missing, different, cause=exc)) from exc


def _message(
    topo: Topology,
    names: tuple[str, ...],
    ranks: Sequence[int],
    mine: str,
    at: str,
    missing: list[int],
    different: dict[int, str],
    before: bool = False,
    cause: BaseException | None = None,
) -> str:
    seconds = topo.timeout.total_seconds()
    parts = [f"{topo.label()}: {mine!r} {_where(topo, names, ranks)}{at} "]
    parts.append("cannot start" if before else f"failed ({type(cause).__name__}: {str(cause).splitlines()[0]})")
    if missing:
        parts.append(f"; ranks {missing} did not arrive within {seconds:.0f}s")
    if different:
        parts.append("; ranks called something else: " + ", ".join(f"{r}: {fp!r}" for r, fp in different.items()))
    parts.append(
        ". Every rank of the group must make the same collectives in the same order: look for a rank that "
        "skipped a step, left the loop early or holds a tensor of another shape"
    )
    return "".join(parts)
