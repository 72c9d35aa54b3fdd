"""The launch environment: where this process sits, read once from the launcher's variables.

This is the only module that reads launcher variables (``RANK``, ``WORLD_SIZE``, ``SLURM_*``, ``OMPI_*``,
``MASTER_*``, ``GROUP_RANK``, ``TORCHELASTIC_*``): torchrun, SLURM's srun (with its node lists and task
counts) and OpenMPI's mpirun; and ``MESHWISE_DRY_RUN``, which ``meshwise run --dry-run`` sets to make this
one process stand for any rank of a planned world (docs/dryrun.md).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from meshwise.errors import TopologyError

__all__ = [
    "DRY_RUN_VARIABLE",
    "DryRunSpec",
    "Environment",
    "SlurmJob",
    "detect_environment",
    "dry_run_spec",
    "expand_nodelist",
    "parse_tasks_per_node",
    "slurm_job",
    "slurm_srun_step",
    "srun_advice",
    "slurm_master_addr",
    "slurm_master_port",
]


@dataclass(frozen=True)
class Environment:
    """Where this process sits, read once from the launcher's variables."""

    launcher: str  # "torchrun", "slurm", "mpi", "dry-run" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    # The launcher's index of this process's node (torchrun GROUP_RANK, SLURM_NODEID); None when it gives
    # none, and then the hostname tells nodes apart. Two torchrun "nodes" on one machine share a hostname.
    node_rank: int | None = None
    # torchrun's restart attempt (TORCHELASTIC_RESTART_COUNT, after --max-restarts): each attempt joins a fresh
    # group through the same store, so init keys its store prefix on it.
    restart_count: int = 0
    # torchrun's --rdzv-id (TORCHELASTIC_RUN_ID): the job an elastic run's worlds belong to; None elsewhere.
    run_id: str | None = None
    # Whether the world's store is the agent's, which outlives a restart (TORCHELASTIC_USE_AGENT_STORE=True); else
    # each attempt's rank 0 hosts a fresh one (torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, srun, mpirun).
    agent_store: bool = False


DRY_RUN_VARIABLE = "MESHWISE_DRY_RUN"  # "rank=R,world=N,nproc=P,steps=K", set by meshwise run --dry-run


@dataclass(frozen=True)
class DryRunSpec:
    """The planned process this one stands for in a dry run, and how many trainer steps to run."""

    rank: int
    world_size: int
    nproc_per_node: int
    steps: int

    def text(self) -> str:
        return f"rank={self.rank},world={self.world_size},nproc={self.nproc_per_node},steps={self.steps}"


def dry_run_spec(env: Mapping[str, str] | None = None) -> DryRunSpec | None:
    """The ``MESHWISE_DRY_RUN`` plan, checked as a real launch checks its ranks; None when it is not set."""
    env = os.environ if env is None else env
    value = env.get(DRY_RUN_VARIABLE)
    if not value:
        return None
    try:
        fields = dict(item.split("=", 1) for item in value.split(","))
        rank, world = int(fields["rank"]), int(fields["world"])
        nproc, steps = int(fields.get("nproc", world)), int(fields.get("steps", 2))
    except (KeyError, ValueError):
        raise TopologyError(
            f"{DRY_RUN_VARIABLE}={value!r} is not a dry-run plan: start it with meshwise run --dry-run --world-size N "
            "--rank R [--nproc-per-node P] script.py, or set it as 'rank=R,world=N,nproc=P,steps=K'"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise TopologyError(
            f"dry-run rank {rank} is outside the world of {world} ranks: pass --rank between 0 and {max(world - 1, 0)}"
        )
    if nproc < 1 or world % nproc:
        raise TopologyError(
            f"--nproc-per-node {nproc} does not divide the world size {world}: a launch places the same number of "
            "processes on every node; pass a divisor of the world size"
        )
    if steps < 1:
        raise TopologyError(f"a dry run runs at least one trainer step, got steps={steps}: pass --dry-run-steps >= 1")
    return DryRunSpec(rank, world, nproc, steps)


# SLURM writes node lists in its hostlist syntax; these are the characters of a host name outside brackets.
_HOST_TEXT = re.compile(r"[A-Za-z0-9._-]+")
_MAX_HOSTS = 1_000_000  # more than any cluster has: a range past this is a typo, not an allocation


def _nodelist_error(variable: str, value: str, reason: str) -> TopologyError:
    return TopologyError(
        f"{variable}={value!r} is not a SLURM node list ({reason}). SLURM writes lists such as "
        "'gpu[003-010,012],cpu1': pass the variable as srun/sbatch set it, or export MASTER_ADDR "
        "(the first node's address) and MASTER_PORT so that meshwise does not need the list"
    )


def _split_top_level(text: str, variable: str, value: str) -> list[str]:
    """Split at the commas outside brackets; brackets must pair up and not nest."""
    items, current, depth = [], [], 0
    for ch in text:
        if ch == "[":
            if depth:
                raise _nodelist_error(variable, value, "nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _nodelist_error(variable, value, "']' without '['")
            depth = 0
        elif ch == "," and not depth:
            items.append("".join(current))
            current = []
            continue
        current.append(ch)
    if depth:
        raise _nodelist_error(variable, value, "'[' without ']'")
    items.append("".join(current))
    return items


def _expand_brackets(body: str, variable: str, value: str) -> list[str]:
    """``003-005,012`` -> ['003', '004', '005', '012']: the width of a range's start is kept (zero padding)."""
    out: list[str] = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise _nodelist_error(variable, value, f"range {item!r} in '[{body}]' is not N or N-M")
        low, high = m.group(1), m.group(2)
        if high is None:
            out.append(low)
            continue
        if int(high) < int(low):
            raise _nodelist_error(variable, value, f"range {item!r} runs backwards")
        if int(high) - int(low) >= _MAX_HOSTS:
            raise _nodelist_error(variable, value, f"range {item!r} holds more than {_MAX_HOSTS} hosts")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


def expand_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Every host of a SLURM node list, in SLURM's order.

    ``gpu[003-004,012],cpu1`` -> ``['gpu003', 'gpu004', 'gpu012', 'cpu1']``; several bracket groups in one
    name expand as a product (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2). Anything else raises a
    :class:`TopologyError` naming ``variable`` and the value.
    """
    value = nodelist
    text = nodelist.strip()
    if not text:
        raise _nodelist_error(variable, value, "it is empty")
    hosts: list[str] = []
    for expr in _split_top_level(text, variable, value):
        if not expr:
            raise _nodelist_error(variable, value, "an empty host between commas")
        pieces: list[list[str]] = []
        position = 0
        for m in re.finditer(r"\[([^\[\]]*)\]", expr):
            literal = expr[position : m.start()]
            if literal:
                if not _HOST_TEXT.fullmatch(literal):
                    raise _nodelist_error(variable, value, f"host {expr!r} has characters outside [A-Za-z0-9._-]")
                pieces.append([literal])
            pieces.append(_expand_brackets(m.group(1), variable, value))
            position = m.end()
        tail = expr[position:]
        if tail:
            if not _HOST_TEXT.fullmatch(tail):
                raise _nodelist_error(variable, value, f"host {expr!r} has characters outside [A-Za-z0-9._-]")
            pieces.append([tail])
        if math.prod(len(p) for p in pieces) + len(hosts) > _MAX_HOSTS:
            raise _nodelist_error(variable, value, f"it holds more than {_MAX_HOSTS} hosts")
        hosts.extend("".join(parts) for parts in itertools.product(*pieces))
    return hosts


def parse_tasks_per_node(value: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Tasks on each node, from SLURM's compressed form: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in value.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise TopologyError(
                f"{variable}={value!r} is not a SLURM task count: SLURM writes it as counts per node such as "
                "'4' or '2(x3),1' (2 tasks on each of 3 nodes, then 1); pass it as srun set it, or unset it"
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _first_var(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set (and not empty)."""
    return next((n for n in names if env.get(n)), None)


def slurm_master_addr(env: Mapping[str, str] | None = None) -> str:
    """The first node of this SLURM step (rank 0 runs there): ``MASTER_ADDR`` if exported, else the node list."""
    env = os.environ if env is None else env
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    # A step's own list first: `srun -N 2` inside a larger allocation runs on a subset of the job's nodes.
    variable = _first_var(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if variable is None:
        raise TopologyError(
            "SLURM gave no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST) and MASTER_ADDR "
            "is not set: run under srun inside an allocation, or export MASTER_ADDR=<first node> and MASTER_PORT"
        )
    return expand_nodelist(env[variable], variable)[0]


def slurm_master_port(env: Mapping[str, str] | None = None) -> int:
    """``MASTER_PORT`` if exported, else a port derived from the job id, so two jobs on one node differ."""
    env = os.environ if env is None else env
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT")
    return 20000 + (_int(env, "SLURM_JOB_ID") if env.get("SLURM_JOB_ID") else 0) % 20000


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job step this process runs in: what ``meshwise run`` needs to rendezvous its nodes."""

    job_id: str
    num_nodes: int
    node_rank: int


def slurm_job(env: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The SLURM step around this process (``SLURM_JOB_ID``, node count, ``SLURM_NODEID``), or None outside SLURM."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    # The step's own count first: `srun -N 2` may run on part of a larger allocation.
    variable = _first_var(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nodes = _int(env, variable) if variable else 1
    node = _int(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else 0
    return SlurmJob(env["SLURM_JOB_ID"], nodes, node)


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise TopologyError(
            f"environment variable {key}={env[key]!r} is not an integer: set it to a whole number or unset it"
        ) from None


# Step ids SLURM gives what srun did not start: the batch script, the external step, salloc's interactive step.
_NOT_SRUN_STEPS = {"batch", "extern", "interactive", "4294967290", "4294967293", "4294967294", "4294967295"}


def slurm_srun_step(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a task of an ``srun`` step: srun sets ``SLURM_STEP_ID`` (0, 1, ...) for each task;
    the batch script of ``sbatch`` (which also sees ``SLURM_PROCID=0`` and the allocation's ``SLURM_NTASKS``) and
    ``salloc``'s shell have none, or a special one (batch, extern, interactive)."""
    env = os.environ if env is None else env
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    return bool(step) and step.lower() not in _NOT_SRUN_STEPS


def srun_advice(env: Mapping[str, str], argv: list[str] | None = None, meshwise_run: bool = False) -> str:
    """The srun line that starts this command (``argv``, default ``sys.argv``) on every task of the allocation in
    ``env`` (``srun -N 2 -n 4 python train.py ...``), or with ``meshwise_run`` once per node
    (``srun --ntasks-per-node=1 meshwise run ...``: ``argv`` is then meshwise run's arguments)."""
    argv = list(sys.argv if argv is None else argv)
    nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or "1"
    node_option = f"-N {nodes} " if nodes != "1" else ""
    if meshwise_run:
        return f"srun {node_option}--ntasks-per-node=1 " + shlex.join(["meshwise", "run", *argv])
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "N"
    script = argv[0] if argv and argv[0] not in ("", "-c", "-m") else "train.py"
    return f"srun {node_option}-n {tasks} " + shlex.join(["python", script, *argv[1:]])


def _not_srun_error(env: Mapping[str, str]) -> TopologyError:
    tasks = _int(env, "SLURM_NTASKS")
    nodes = _int(env, "SLURM_NNODES") if env.get("SLURM_NNODES") else 1
    per_node = tasks // nodes if nodes and tasks % nodes == 0 else "K"
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "train.py"
    return TopologyError(
        f"this process sees SLURM job {env.get('SLURM_JOB_ID', '?')}'s allocation of {tasks} tasks "
        f"(SLURM_NTASKS={tasks}) but srun did not start it (no SLURM_STEP_ID: it is the batch script itself), so as "
        f"rank {env.get('SLURM_PROCID')} of {tasks} it would wait for {tasks - 1} ranks that never start. Start one "
        f"task per rank with srun: `{srun_advice(env)}`, or one meshwise run per node: `srun "
        f"{f'-N {nodes} ' if nodes > 1 else ''}--ntasks-per-node=1 meshwise run --nproc-per-node {per_node} "
        f"{shlex.quote(script)} ...`"
    )


def _slurm_environment(env: Mapping[str, str]) -> Environment:
    """``srun python train.py``: one task per rank, no torchrun."""
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    node = _int(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else None
    local_rank = _int(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID") else 0
    variable = _first_var(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    if variable is not None:
        counts = parse_tasks_per_node(env[variable], variable)
        local_world = counts[node] if node is not None and node < len(counts) else counts[0]
    else:
        nnodes = _int(env, "SLURM_NNODES") if env.get("SLURM_NNODES") else 1
        local_world = world // nnodes if nnodes and world % nnodes == 0 else 1
    if not 0 <= rank < world:
        raise TopologyError(
            f"SLURM_PROCID={rank} is outside SLURM_NTASKS={world}: start the script with srun, which sets both"
        )
    return Environment(
        "slurm", rank, world, local_rank, local_world, slurm_master_addr(env), slurm_master_port(env), node
    )


def detect_environment(env: Mapping[str, str] | None = None) -> Environment:
    """Read torchrun/elastic, SLURM (srun) or OpenMPI (mpirun) variables; a plain process is world 1.

    torchrun's variables win over SLURM's, so ``srun meshwise run ...`` (torchrun inside an allocation)
    is read as torchrun. A process that sees an allocation of several tasks but is no task of srun (``python
    train.py`` in a batch script: ``SLURM_PROCID=0``, no ``SLURM_STEP_ID``) is a :class:`TopologyError` at once,
    naming the srun line, instead of rank 0 waiting for ranks that never start. Under srun alone the master
    address is the step's first node (from the node list, parsed strictly) and the port comes from the job id,
    unless ``MASTER_ADDR``/``MASTER_PORT`` are exported.
    """
    env = os.environ if env is None else env
    dry = dry_run_spec(env)
    if dry is not None:  # wins over every launcher: this process plays one rank of a world that is not there
        p = dry.nproc_per_node
        return Environment("dry-run", dry.rank, dry.world_size, dry.rank % p, p, "dry-run", 0, dry.rank // p)
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else 29500
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env else "env"
        return Environment(
            launcher,
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else 0,
            _int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else _int(env, "WORLD_SIZE"),
            addr,
            port,
            _int(env, "GROUP_RANK") if env.get("GROUP_RANK") else None,
            _int(env, "TORCHELASTIC_RESTART_COUNT") if env.get("TORCHELASTIC_RESTART_COUNT") else 0,
            env.get("TORCHELASTIC_RUN_ID") or None,
            env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if slurm_srun_step(env):
            return _slurm_environment(env)
        # Not a task of srun: the batch script (SLURM_PROCID=0 of the allocation's SLURM_NTASKS) would wait for
        # ranks that never start. mpirun inside the allocation brings its own variables; one task is one process.
        if "OMPI_COMM_WORLD_RANK" not in env and _int(env, "SLURM_NTASKS") > 1:
            raise _not_srun_error(env)
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        size, local = _int(env, "OMPI_COMM_WORLD_SIZE"), int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        if "MASTER_ADDR" not in env and local != size:
            raise TopologyError(
                "mpirun across several nodes needs MASTER_ADDR (and MASTER_PORT): export the first node's "
                "address, e.g. mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500 ..."
            )
        return Environment(
            "mpi",
            _int(env, "OMPI_COMM_WORLD_RANK"),
            size,
            int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
            local,
            addr,
            port,
        )
    return Environment("none", 0, 1, 0, 1, addr, port)
