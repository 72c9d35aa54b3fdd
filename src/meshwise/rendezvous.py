"""Joining the world's process group for :func:`meshwise.topology.init`: the device and backend of this rank, the
launcher's rendezvous store (kept for a later init in the process), gloo/NCCL, one process, or torch's fake backend
in a dry run, and a named error when a rank cannot join."""

from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist

from meshwise import compat
from meshwise.environment import Environment
from meshwise.errors import CollectiveTimeoutError

__all__ = ["WIRE_DTYPES", "choose_device", "join_fake_group", "join_process_group"]

WIRE_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
"""The dtypes ranks tell each other as numbers (a dtype's index here) when they agree on shapes before a
collective (metric syncs, pipeline stage inputs): one table, so every layer codes a dtype alike."""

_STORE: dist.Store | None = None  # the launcher's rendezvous store, kept for a later init() in this process
_INITS = 0


def choose_device(env: Environment, backend: str | None) -> tuple[torch.device, str]:
    """CUDA (this rank's local device, bound now) with NCCL when there is one and no other backend is asked for;
    torch's fake backend on the CPU in a dry run."""
    if env.launcher == "dry-run":
        return torch.device("cpu"), "fake"
    if torch.cuda.is_available() and backend in (None, "nccl"):
        device = torch.device("cuda", env.local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return device, backend or ("nccl" if device.type == "cuda" else "gloo")


def _rendezvous_store(env: Environment, timeout: datetime.timedelta) -> dist.Store:
    """The launcher's store under a prefix of its own for this init, and for this attempt where the store is the
    agent's: it outlives a group (a second init() in one process; with the agent's store, a restarted torchrun
    attempt), still holding the old group's gloo addresses. Where each attempt's rank 0 hosts a fresh store (elastic
    `meshwise run`, srun, mpirun) the attempt is left out: torchrun counts restarts per node, and a node that joined
    at a restart (or restarted for another node's failure) has another count than the rest of the same world."""
    global _STORE, _INITS
    if _STORE is None:
        url = (
            "env://"
            if env.launcher in ("torchrun", "env")
            else f"tcp://{env.master_addr}:{env.master_port}?rank={env.rank}&world_size={env.world_size}"
        )
        _STORE = next(dist.rendezvous(url, timeout=timeout))[0]
    attempt = f"attempt-{env.restart_count}/" if env.agent_store else ""
    prefixed = dist.PrefixStore(f"meshwise/{attempt}init-{_INITS}", _STORE)
    _INITS += 1
    return prefixed


def join_process_group(env: Environment, device: torch.device, backend: str, timeout: datetime.timedelta) -> bool:
    """Create the world's process group unless one exists (the program's own); True when this call created it."""
    if dist.is_initialized():
        return False
    try:
        if env.launcher == "dry-run":
            join_fake_group(env, timeout)
        elif env.world_size == 1:
            # One process needs no rendezvous: an in-memory store keeps DeviceMesh, DTensor and DCP working.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                store=_rendezvous_store(env, timeout),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
                # a bound device lets DeviceMesh split NCCL groups in one call per dim, not one per group
                device_id=device if device.type == "cuda" else None,
            )
    except (RuntimeError, dist.DistError) as exc:
        hint = ""
        if re.search(r"remote=\[?127\.", str(exc)):
            # gloo announces the address its hostname resolves to; on many clusters and containers that is
            # 127.0.x.1, which no other node can dial.
            hint = (
                ". A rank announced a loopback address (its hostname resolves to 127.x): set "
                "GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for NCCL) to the network interface the nodes share"
            )
        raise CollectiveTimeoutError(
            f"rank {env.rank} could not join the process group of {env.world_size} ranks at "
            f"{env.master_addr}:{env.master_port} within {timeout.total_seconds():.0f}s ({exc}). "
            f"Check that every rank was started with the same world size and master address{hint}"
        ) from exc
    return True


def join_fake_group(env: Environment, timeout: datetime.timedelta) -> None:
    """Be rank ``env.rank`` of ``env.world_size`` on torch's fake backend (a dry run): nothing is ever sent."""
    dist.init_process_group(
        "fake", store=compat.fake_store(), rank=env.rank, world_size=env.world_size, timeout=timeout
    )
