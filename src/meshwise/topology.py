"""The declared parallel topology: mesh dims, sizes and roles, the launch environment, the DeviceMesh and its groups.

This is the only module that reads launcher variables (``RANK``, ``SLURM_PROCID``, ...).
Everything else receives a :class:`Topology` and derives what it needs from roles.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import re
import socket
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from meshwise.errors import CollectiveTimeoutError, PlacementWarning, TopologyError

ROLES = ("batch", "split", "replica", "stage")

#: Default role of well-known mesh dimension names (DESIGN.md).
DEFAULT_ROLES: dict[str, str] = {
    **dict.fromkeys(("dp", "ddp", "data_parallel", "dp_replicate", "dp_shard", "fsdp"), "batch"),
    **dict.fromkeys(("cp", "sp", "context_parallel", "domain", "spatial"), "split"),
    **dict.fromkeys(("tp", "tensor_parallel", "model_parallel"), "replica"),
    **dict.fromkeys(("pp", "pipeline"), "stage"),
}

DEFAULT_TIMEOUT_S = 600.0
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Dims = str | Sequence[str]


# --------------------------------------------------------------------------- mesh specification


def parse_mesh(mesh: Mapping[str, int] | str | None) -> dict[str, int]:
    """Parse ``{"dp": -1, "tp": 2}``, ``"dp=-1,tp=2"`` or ``None`` (read ``MESHWISE_MESH``, else ``dp=-1``)."""
    if mesh is None:
        mesh = os.environ.get("MESHWISE_MESH") or "dp=-1"
    if isinstance(mesh, str):
        items: list[tuple[str, int]] = []
        for part in filter(None, (p.strip() for p in mesh.split(","))):
            name, sep, value = part.partition("=")
            try:
                if not sep:
                    raise ValueError
                items.append((name.strip(), int(value)))
            except ValueError:
                raise TopologyError(
                    f"cannot read mesh entry {part!r} in {mesh!r}: write name=size pairs separated by "
                    "commas, e.g. 'dp=-1,tp=2'"
                ) from None
        names = [n for n, _ in items]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise TopologyError(f"mesh {mesh!r} names dim(s) {duplicates} more than once: give each dim one size")
        mesh = dict(items)
    if not isinstance(mesh, Mapping) or not mesh:
        raise TopologyError(f"mesh must be a non-empty mapping name -> size or a 'dp=-1,tp=2' string, got {mesh!r}")
    out: dict[str, int] = {}
    for name, size in mesh.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise TopologyError(f"mesh dim name {name!r} is not an identifier: use letters, digits and '_'")
        if isinstance(size, bool) or not isinstance(size, int):
            raise TopologyError(f"size of mesh dim {name!r} must be an int, got {size!r}")
        out[name] = size
    return out


def parse_roles(roles: Mapping[str, str] | str | None) -> dict[str, str]:
    """Parse ``{"x": "split"}`` or ``"x=split,y=replica"`` (or ``MESHWISE_ROLES`` when ``None``)."""
    if roles is None:
        roles = os.environ.get("MESHWISE_ROLES") or {}
    if isinstance(roles, str):
        pairs = [p.split("=", 1) for p in filter(None, (p.strip() for p in roles.split(",")))]
        if any(len(p) != 2 for p in pairs):
            raise TopologyError(f"cannot read roles {roles!r}: write name=role pairs, e.g. 'space=split'")
        roles = {k.strip(): v.strip() for k, v in pairs}
    return dict(roles)


@dataclass(frozen=True)
class Layout:
    """The pure arithmetic of a mesh: dims, sizes and roles, and which ranks sit where.

    Ranks are laid out row-major over ``dims`` (the last dim varies fastest), as DeviceMesh does.
    Nothing here starts a process, so it also plans meshes for machines you do not have.
    """

    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    roles: tuple[str, ...]

    @classmethod
    def resolve(
        cls,
        mesh: Mapping[str, int] | str | None,
        world_size: int,
        roles: Mapping[str, str] | str | None = None,
    ) -> Layout:
        """Validate a mesh spec against ``world_size``, infer the one ``-1`` size and assign roles."""
        spec = parse_mesh(mesh)
        explicit = parse_roles(roles)
        unknown_dims = sorted(set(explicit) - set(spec))
        if unknown_dims:
            raise TopologyError(f"roles given for dim(s) {unknown_dims} that are not in the mesh {spec}: remove them")
        resolved_roles = []
        for name in spec:
            role = explicit.get(name, DEFAULT_ROLES.get(name))
            if role is None:
                raise TopologyError(
                    f"mesh dim {name!r} has no default role: pass roles={{{name!r}: ...}} with one of {ROLES} "
                    f"(known names: {', '.join(sorted(DEFAULT_ROLES))})"
                )
            if role not in ROLES:
                raise TopologyError(f"role {role!r} of mesh dim {name!r} is unknown: use one of {ROLES}")
            resolved_roles.append(role)
        stages = [n for n, r in zip(spec, resolved_roles) if r == "stage"]
        if len(stages) > 1:
            raise TopologyError(f"mesh has several 'stage' dims {stages}: declare one pipeline dim")

        inferred = [n for n, s in spec.items() if s == -1]
        if len(inferred) > 1:
            raise TopologyError(f"mesh {spec} has -1 for {inferred}: only one size may be inferred; fix the others")
        bad = {n: s for n, s in spec.items() if s == 0 or s < -1}
        if bad:
            raise TopologyError(f"mesh sizes must be positive (or one -1 to infer), got {bad}")
        fixed = math.prod(s for s in spec.values() if s != -1)
        if inferred:
            if world_size % fixed:
                raise TopologyError(
                    f"world size {world_size} is not divisible by the fixed sizes of mesh {spec} "
                    f"(product {fixed}): launch a multiple of {fixed} processes or change the sizes"
                )
            spec[inferred[0]] = world_size // fixed
        elif fixed != world_size:
            raise TopologyError(
                f"mesh {spec} holds {fixed} ranks but the world size is {world_size}: make the product of the "
                f"sizes equal {world_size}, put -1 on one dim, or launch {fixed} processes"
            )
        return cls(tuple(spec), tuple(spec.values()), tuple(resolved_roles))

    # ---- derived views
    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def dims_with(self, *roles: str) -> tuple[str, ...]:
        """The dims holding any of ``roles``, in mesh order."""
        return tuple(d for d, r in zip(self.dims, self.roles) if r in roles)

    def role(self, dim: str) -> str:
        return self.roles[self.index(dim)]

    def index(self, dim: str) -> int:
        try:
            return self.dims.index(dim)
        except ValueError:
            raise TopologyError(f"mesh has no dim {dim!r}: its dims are {self.dims}") from None

    def normalize(self, dims: Dims) -> tuple[str, ...]:
        """Dims as a tuple in mesh order; a string is one dim name."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        for d in names:
            self.index(d)
        if len(set(names)) != len(names):
            raise TopologyError(f"dims {names} repeat a name")
        return tuple(sorted(names, key=self.index))

    def size(self, dims: Dims) -> int:
        return math.prod(self.sizes[self.index(d)] for d in self.normalize(dims))

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every dim."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside the world of {self.world_size}")
        out = {}
        for dim, size in reversed(list(zip(self.dims, self.sizes))):
            rank, out[dim] = divmod(rank, size)
        return {d: out[d] for d in self.dims}

    def coordinate(self, rank: int, dims: Dims) -> int:
        """Index of ``rank`` along ``dims`` flattened row-major (mesh order)."""
        coords = self.coordinates(rank)
        index = 0
        for d in self.normalize(dims):
            index = index * self.sizes[self.index(d)] + coords[d]
        return index

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for d, s in zip(self.dims, self.sizes):
            rank = rank * s + coords[d]
        return rank

    def groups(self, dims: Dims) -> list[list[int]]:
        """Every group of ranks that differ only along ``dims``, each ordered by coordinate over ``dims``."""
        names = self.normalize(dims)
        others = [d for d in self.dims if d not in names]
        out = []
        for fixed in itertools.product(*(range(self.sizes[self.index(d)]) for d in others)):
            base = dict(zip(others, fixed))
            ranks = []
            for varying in itertools.product(*(range(self.sizes[self.index(d)]) for d in names)):
                ranks.append(self.rank_of({**base, **dict(zip(names, varying))}))
            out.append(ranks)
        return out

    def group_ranks(self, rank: int, dims: Dims) -> list[int]:
        """The ranks in ``rank``'s group along ``dims``, ordered by coordinate over ``dims``."""
        names = self.normalize(dims)
        base = self.coordinates(rank)
        return [
            self.rank_of({**base, **dict(zip(names, varying))})
            for varying in itertools.product(*(range(self.sizes[self.index(d)]) for d in names))
        ]

    def table(self, nodes: Sequence[int] | None = None, node_names: Sequence[str] | None = None) -> str:
        """A plain-text table: rank -> coordinate -> data rank -> the group along each dim.

        With ``nodes`` (each rank's node index) it adds a node column, says which dims' groups cross
        nodes, and ends with any :func:`placement_warnings`.
        """
        if nodes is not None:
            nodes = _check_nodes(self, nodes)
        batch = self.dims_with("batch")
        head = ["rank", *(["node"] if nodes is not None else [])]
        head += [*(f"{d}({r})" for d, r in zip(self.dims, self.roles)), "data_rank"]
        head += [f"{d} group" for d in self.dims]
        rows = [head]
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            row = [str(rank), *([str(nodes[rank])] if nodes is not None else [])]
            row += [*(str(c[d]) for d in self.dims), str(self.coordinate(rank, batch) if batch else 0)]
            row += [",".join(map(str, self.group_ranks(rank, d))) for d in self.dims]
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        mesh = " x ".join(f"{d}={s}" for d, s in zip(self.dims, self.sizes))
        summary = (
            f"mesh {mesh} (world {self.world_size}); data dims {batch or '-'} "
            f"(data size {self.size(batch) if batch else 1}); metric dims {self.dims_with('batch', 'split') or '-'}; "
            f"replica dims {self.dims_with('replica') or '-'}"
        )
        if nodes is None:
            return summary + "\n" + "\n".join(lines)
        names = list(node_names or [])
        per_node = []
        for node in sorted(set(nodes)):
            name = f" ({names[node]})" if node < len(names) else ""
            per_node.append(f"node {node}{name}: ranks {_ranks_text([r for r, n in enumerate(nodes) if n == node])}")
        crossing = dims_crossing_nodes(self, nodes)
        summary += (
            f"\n{len(set(nodes))} node(s): {'; '.join(per_node)}; dims whose groups cross nodes: {crossing or '-'}"
        )
        advice = [f"warning: {w}" for w in placement_warnings(self, nodes)]
        return "\n".join([summary, *lines, *advice])


# --------------------------------------------------------------------------- placement on nodes


def _check_nodes(layout: Layout, nodes: Sequence[int]) -> list[int]:
    out = [int(n) for n in nodes]
    if len(out) != layout.world_size:
        raise TopologyError(
            f"{len(out)} node indices given for a mesh of {layout.world_size} ranks: give one node index per rank"
        )
    return out


def _ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(ranks), key=lambda pair: pair[1] - pair[0]):
        block = [r for _, r in run]
        parts.append(str(block[0]) if len(block) == 1 else f"{block[0]}-{block[-1]}")
    return ",".join(parts)


def _spans_nodes(layout: Layout, dim: str, nodes: Sequence[int]) -> bool:
    return any(len({nodes[r] for r in group}) > 1 for group in layout.groups(dim))


def dims_crossing_nodes(layout: Layout, nodes: Sequence[int]) -> tuple[str, ...]:
    """The dims whose groups hold ranks of more than one node (``nodes[r]`` is rank ``r``'s node)."""
    nodes = _check_nodes(layout, nodes)
    return tuple(d for d in layout.dims if _spans_nodes(layout, d, nodes))


def placement_warnings(layout: Layout, nodes: Sequence[int]) -> list[str]:
    """Advice for each ``replica`` or ``split`` dim whose groups cross nodes when declaring the ``batch`` dims
    first (outermost) would keep those groups inside a node.

    ``nodes[r]`` is the node of global rank ``r``. Launchers number ranks node by node and the mesh's last
    dim varies fastest, so the last dims land inside a node: tensor-parallel all-reduces (every layer) and
    halo exchanges belong there, while a batch dim's gradient reduction (once a step) can cross the network.
    Pure arithmetic: :func:`meshwise.init` warns with these messages (:class:`PlacementWarning`) on rank 0.
    """
    nodes = _check_nodes(layout, nodes)
    batch = layout.dims_with("batch")
    if not batch or len(set(nodes)) < 2:
        return []
    order = [*batch, *(d for d in layout.dims if d not in batch)]
    if tuple(order) == layout.dims:
        return []  # batch dims already outermost: no reordering of this kind does better
    reordered = Layout(
        tuple(order), tuple(layout.sizes[layout.index(d)] for d in order), tuple(layout.role(d) for d in order)
    )
    spec = ",".join(f"{d}={reordered.sizes[i]}" for i, d in enumerate(order))
    messages = []
    for dim in layout.dims_with("replica", "split"):
        if not _spans_nodes(layout, dim, nodes) or _spans_nodes(reordered, dim, nodes):
            continue
        role = layout.role(dim)
        groups = layout.groups(dim)
        reach = max(len({nodes[r] for r in g}) for g in groups)
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
        messages.append(
            f"mesh dim {dim!r} ({role}) crosses nodes: its groups {shown} reach up to {reach} nodes, so its "
            f"collectives ({'every layer' if role == 'replica' else 'every halo exchange'}) go over the network, "
            f"while batch dim(s) {list(batch)} could cross them instead (fewer, larger transfers). "
            f"Declare the batch dims first, mesh '{spec}' (same roles), and each {dim!r} group stays on one node"
        )
    return messages


# --------------------------------------------------------------------------- launch environment


@dataclass(frozen=True)
class Environment:
    """Where this process sits, read once from the launcher's variables."""

    launcher: str  # "torchrun", "slurm", "mpi" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    # The launcher's index of this process's node (torchrun GROUP_RANK, SLURM_NODEID); None when it gives
    # none, and then the hostname tells nodes apart. Two torchrun "nodes" on one machine share a hostname.
    node_rank: int | None = None


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
    is read as torchrun. Under srun alone the master address is the step's first node (from the node
    list, parsed strictly) and the port comes from the job id, unless ``MASTER_ADDR``/``MASTER_PORT``
    are exported.
    """
    env = os.environ if env is None else env
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
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm_environment(env)
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


# --------------------------------------------------------------------------- the topology


def _dims_key(dims: tuple[str, ...]) -> str:
    return "_".join(dims)


@dataclass(eq=False)
class Topology:
    """The one object handed around: the layout, this rank's place in it, the DeviceMesh and its groups.

    Build it with :func:`meshwise.init`; every query is derived from roles, never from dim order.
    """

    layout: Layout
    environment: Environment
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    debug: bool = False  # fingerprint every collective on a topology group before it runs (meshwise.debug)
    run_dir: Path = Path("runs")  # where hang reports (every rank's stacks) are written
    _submeshes: dict[tuple[str, ...], object] = field(default_factory=dict, repr=False)
    _group_ranks: dict[tuple[str, ...], list[int]] = field(default_factory=dict, repr=False)
    # Each global rank's node index (numbered in rank order) and each node's hostname, learnt once at init.
    # Empty when the Topology was built by hand: every rank then counts as node 0.
    node_of_rank: tuple[int, ...] = ()
    node_names: tuple[str, ...] = ()

    # ---- basic facts
    @property
    def dims(self) -> tuple[str, ...]:
        return self.layout.dims

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.layout.dims, self.layout.sizes))

    @property
    def roles(self) -> dict[str, str]:
        return dict(zip(self.layout.dims, self.layout.roles))

    @property
    def rank(self) -> int:
        return self.environment.rank

    @property
    def world_size(self) -> int:
        return self.environment.world_size

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank

    @property
    def nodes(self) -> tuple[int, ...]:
        """Node index of every global rank (``nodes[r]``), numbered 0.. in rank order."""
        return self.node_of_rank or (0,) * self.layout.world_size

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.nodes[self.rank]

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def dims_with(self, *roles: str) -> tuple[str, ...]:
        """Dims whose role is one of ``roles``, in mesh order."""
        for r in roles:
            if r not in ROLES:
                raise TopologyError(f"unknown role {r!r}: use one of {ROLES}")
        return self.layout.dims_with(*roles)

    @property
    def batch_dims(self) -> tuple[str, ...]:
        return self.layout.dims_with("batch")

    @property
    def split_dims(self) -> tuple[str, ...]:
        return self.layout.dims_with("split")

    @property
    def replica_dims(self) -> tuple[str, ...]:
        return self.layout.dims_with("replica")

    @property
    def stage_dims(self) -> tuple[str, ...]:
        return self.layout.dims_with("stage")

    @property
    def metric_dims(self) -> tuple[str, ...]:
        """Dims a metric or loss sums over: ``batch`` + ``split``."""
        return self.layout.dims_with("batch", "split")

    # ---- coordinates
    def size(self, dims: Dims) -> int:
        """Number of ranks along ``dims`` (one name or several); an empty selection has size 1."""
        return self.layout.size(dims)

    def coordinate(self, dims: Dims) -> int:
        """This rank's index along ``dims``, several dims flattened row-major in mesh order."""
        return self.layout.coordinate(self.rank, dims)

    def coordinates(self) -> dict[str, int]:
        return self.layout.coordinates(self.rank)

    @property
    def data_rank(self) -> int:
        """Index of this rank's sample stream: the coordinate over all ``batch`` dims."""
        return self.layout.coordinate(self.rank, self.batch_dims)

    @property
    def data_size(self) -> int:
        """Number of distinct sample streams: the product of the ``batch`` dim sizes."""
        return self.layout.size(self.batch_dims)

    @property
    def is_last_stage(self) -> bool:
        stage = self.stage_dims
        return not stage or self.coordinate(stage) == self.size(stage) - 1

    @property
    def is_first_stage(self) -> bool:
        stage = self.stage_dims
        return not stage or self.coordinate(stage) == 0

    def is_leader(self, dims: Dims | None = None) -> bool:
        """Global rank 0 when ``dims`` is None, else the rank at index 0 of its group along ``dims``."""
        if dims is None:
            return self.rank == 0
        return self.coordinate(dims) == 0

    def group_ranks(self, dims: Dims) -> list[int]:
        """Global ranks of this rank's group along ``dims``, ordered by coordinate (cached: used every step)."""
        key = self.layout.normalize(dims)
        if key not in self._group_ranks:
            self._group_ranks[key] = self.layout.group_ranks(self.rank, key)
        return list(self._group_ranks[key])

    def label(self) -> str:
        """``rank 3 (dp=1, tp=1)``: how logs and errors name this process."""
        coords = ", ".join(f"{d}={c}" for d, c in self.coordinates().items())
        return f"rank {self.rank} ({coords})"

    # ---- mesh and groups
    def submesh(self, dims: Dims) -> object:
        """The DeviceMesh over ``dims`` (one dim, or several flattened into one dim; created at init)."""
        key = self.layout.normalize(dims)
        if not key:
            raise TopologyError("submesh() needs at least one dim; an empty selection has no mesh")
        try:
            return self._submeshes[key]
        except KeyError:
            raise TopologyError(f"no mesh for dims {key}: this topology's dims are {self.dims}") from None

    @property
    def group_dims(self) -> tuple[tuple[str, ...], ...]:
        """Every dim selection that has a group (made at init), each a tuple in mesh order."""
        return tuple(self._submeshes)

    def group(self, dims: Dims) -> dist.ProcessGroup:
        """The ProcessGroup of this rank's group along ``dims`` (flattened groups were made at init)."""
        return self.submesh(dims).get_group()  # type: ignore[attr-defined]

    def describe(self) -> str:
        """A table of every rank's coordinate and groups, with this topology's device and backend."""
        head = f"backend {self.backend}, device {self.device.type}, launcher {self.environment.launcher}\n"
        return head + self.layout.table(self.nodes, self.node_names)

    def barrier(self) -> None:
        dist.barrier()

    def __repr__(self) -> str:
        mesh = ", ".join(f"{d}={s}:{r}" for d, s, r in zip(self.layout.dims, self.layout.sizes, self.layout.roles))
        return f"Topology({mesh}; {self.label()}, {self.device})"


_CURRENT: Topology | None = None
_STORE: dist.Store | None = None  # the launcher's rendezvous store, kept for a later init() in this process
_INITS = 0


def current() -> Topology | None:
    """The topology made by :func:`init` in this process, or ``None``."""
    return _CURRENT


def resolve(topology: Topology | None = None) -> Topology:
    """The one route to the topology for every layer: ``topology`` if given, else the current one.

    Raises :class:`TopologyError` when neither exists.
    """
    if topology is not None:
        return topology
    if _CURRENT is None:
        raise TopologyError("no topology: call meshwise.init(...) first, or pass topology=")
    return _CURRENT


def _options(backend: str, timeout: datetime.timedelta):
    """Backend options that carry the timeout: DeviceMesh's new groups otherwise get torch's 30-minute default."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return backend
    opts._timeout = timeout
    return (backend, opts)


def _outside_meshwise() -> int:
    """The ``stacklevel`` that makes a warning raised by this function's caller point at the user's code."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _exchange_nodes(env: Environment) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Every rank's node, learnt with one all-gather on the world at init (never on a hot path).

    A node is the launcher's node index where it gives one (torchrun ``GROUP_RANK``, ``SLURM_NODEID``):
    two torchrun "nodes" on one machine share a hostname. Otherwise the hostname names the node.
    """
    mine = (env.node_rank, socket.gethostname())
    if env.world_size == 1:
        everyone = [mine]
    else:
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, mine)
    keys = [("launcher", node) if node is not None else ("host", host) for node, host in everyone]
    index: dict[tuple, int] = {}
    names: list[str] = []
    for key, (_, host) in zip(keys, everyone):
        if key not in index:
            index[key] = len(index)
            names.append(host)
    return tuple(index[k] for k in keys), tuple(names)


def init(
    mesh: Mapping[str, int] | str | None = None,
    *,
    roles: Mapping[str, str] | str | None = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    debug: bool | None = None,
    run_dir: str | os.PathLike[str] | None = None,
) -> Topology:
    """Join the process group and build the declared mesh; returns the :class:`Topology`.

    ``mesh`` is ``{"dp": -1, "tp": 2}``, ``"dp=-1,tp=2"``, or ``None`` to read ``MESHWISE_MESH``
    (default ``dp=-1``). ``timeout`` (seconds, default ``MESHWISE_TIMEOUT`` or 600) bounds the
    rendezvous and every collective of every group meshwise creates. ``debug`` (default
    ``MESHWISE_DEBUG``) compares a fingerprint of every collective on a topology group across the
    group before it runs (:mod:`meshwise.debug`); ``run_dir`` (default ``MESHWISE_RUN_DIR`` or
    ``runs``) receives hang reports. Under a launcher (torchrun, srun, mpirun) every process must
    call this with the same arguments.

    Each rank's node is learnt here (one all-gather); when a ``replica`` or ``split`` dim crosses nodes
    although declaring the ``batch`` dims first would keep it inside one, rank 0 warns with a
    :class:`PlacementWarning` naming the dim.
    """
    global _CURRENT, _STORE, _INITS
    if _CURRENT is not None:
        raise TopologyError("meshwise.init() was already called in this process: call meshwise.shutdown() first")
    env = detect_environment()
    layout = Layout.resolve(mesh, env.world_size, roles)
    if timeout is None:
        timeout = float(os.environ.get("MESHWISE_TIMEOUT", DEFAULT_TIMEOUT_S))
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if debug is None:
        debug = os.environ.get("MESHWISE_DEBUG", "").lower() in ("1", "true", "yes", "on")
    run_dir = Path(run_dir if run_dir is not None else os.environ.get("MESHWISE_RUN_DIR", "runs"))

    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    if use_cuda:
        device = torch.device("cuda", env.local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")

    owns_group = not dist.is_initialized()
    if owns_group:
        try:
            if env.world_size == 1:
                # One process needs no rendezvous: an in-memory store keeps DeviceMesh, DTensor and DCP working.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                # The store outlives a group: a restarted torchrun attempt (--max-restarts) meets the agent's
                # store, and a second init() in one process meets its own, both still holding the old group's
                # gloo addresses. A fresh prefix per attempt and per init keeps a new group from dialling them.
                # srun and mpirun have no agent: rank 0 of the first init hosts the store at the master address.
                if _STORE is None:
                    url = (
                        "env://"
                        if env.launcher in ("torchrun", "env")
                        else f"tcp://{env.master_addr}:{env.master_port}?rank={env.rank}&world_size={env.world_size}"
                    )
                    _STORE = next(dist.rendezvous(url, timeout=timeout))[0]
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                prefixed = dist.PrefixStore(f"meshwise/attempt-{attempt}/init-{_INITS}", _STORE)
                _INITS += 1
                dist.init_process_group(
                    backend,
                    store=prefixed,
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
    elif dist.get_world_size() != env.world_size:
        raise TopologyError(
            f"a process group of {dist.get_world_size()} ranks already exists but the launcher says "
            f"{env.world_size}: let meshwise.init() create the process group"
        )

    from torch.distributed.device_mesh import init_device_mesh

    override = _options(backend, timeout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing flattened dims warns about a future deprecation
        root = init_device_mesh(
            device.type,
            layout.sizes,
            mesh_dim_names=layout.dims,
            backend_override={d: override for d in layout.dims},
        )
        submeshes: dict[tuple[str, ...], object] = {(d,): root[d] for d in layout.dims}
        # Every multi-dim selection is flattened now, collectively on all ranks, never lazily on a subset.
        for n in range(2, len(layout.dims) + 1):
            for combo in itertools.combinations(layout.dims, n):
                submeshes[combo] = root[combo]._flatten(_dims_key(combo), backend_override=override)
    nodes, node_names = _exchange_nodes(env)
    _CURRENT = Topology(layout, env, device, backend, timeout, root, bool(debug), run_dir, submeshes)
    _CURRENT.node_of_rank, _CURRENT.node_names = nodes, node_names
    if env.rank == 0:  # the same advice on every rank: one copy is enough
        for message in placement_warnings(layout, nodes):
            warnings.warn(message, PlacementWarning, stacklevel=_outside_meshwise())
    _CURRENT._owns_group = owns_group  # type: ignore[attr-defined]
    return _CURRENT


def shutdown() -> None:
    """Leave the process group that :func:`init` made; safe to call twice."""
    global _CURRENT
    topo, _CURRENT = _CURRENT, None
    if topo is not None and getattr(topo, "_owns_group", False) and dist.is_initialized():
        dist.destroy_process_group()
