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
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from meshwise.errors import CollectiveTimeoutError, TopologyError

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

    def table(self) -> str:
        """A plain-text table: rank -> coordinate -> data rank -> the group along each dim."""
        batch = self.dims_with("batch")
        head = ["rank", *(f"{d}({r})" for d, r in zip(self.dims, self.roles)), "data_rank"]
        head += [f"{d} group" for d in self.dims]
        rows = [head]
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            row = [str(rank), *(str(c[d]) for d in self.dims), str(self.coordinate(rank, batch) if batch else 0)]
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
        return summary + "\n" + "\n".join(lines)


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


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``gpu[003-010,012],cpu1``."""
    m = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return "127.0.0.1"
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise TopologyError(f"environment variable {key}={env[key]!r} is not an integer") from None


def detect_environment(env: Mapping[str, str] | None = None) -> Environment:
    """Read torchrun/elastic, SLURM (srun) or OpenMPI (mpirun) variables; a plain process is world 1."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env.get("MASTER_PORT", "29500"))
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env else "env"
        return Environment(
            launcher,
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            int(env.get("LOCAL_RANK", "0")),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            addr,
            port,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_ADDR" not in env:
            addr = _first_slurm_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        if "MASTER_PORT" not in env:
            port = 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        return Environment(
            "slurm",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            int(env.get("SLURM_LOCALID", "0")),
            int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
            addr,
            port,
        )
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

    def group(self, dims: Dims) -> dist.ProcessGroup:
        """The ProcessGroup of this rank's group along ``dims`` (flattened groups were made at init)."""
        return self.submesh(dims).get_group()  # type: ignore[attr-defined]

    def describe(self) -> str:
        """A table of every rank's coordinate and groups, with this topology's device and backend."""
        head = f"backend {self.backend}, device {self.device.type}, launcher {self.environment.launcher}\n"
        return head + self.layout.table()

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
            elif env.launcher in ("torchrun", "env"):
                # The store outlives a group: a restarted torchrun attempt (--max-restarts) meets the agent's
                # store, and a second init() in one process meets its own, both still holding the old group's
                # gloo addresses. A fresh prefix per attempt and per init keeps a new group from dialling them.
                if _STORE is None:
                    _STORE = next(dist.rendezvous("env://", timeout=timeout))[0]
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
            else:
                dist.init_process_group(
                    backend,
                    init_method=f"tcp://{env.master_addr}:{env.master_port}",
                    rank=env.rank,
                    world_size=env.world_size,
                    timeout=timeout,
                    device_id=device if device.type == "cuda" else None,
                )
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveTimeoutError(
                f"rank {env.rank} could not join the process group of {env.world_size} ranks at "
                f"{env.master_addr}:{env.master_port} within {timeout.total_seconds():.0f}s ({exc}). "
                "Check that every rank was started with the same world size and master address"
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
    _CURRENT = Topology(layout, env, device, backend, timeout, root, bool(debug), run_dir, submeshes)
    _CURRENT._owns_group = owns_group  # type: ignore[attr-defined]
    return _CURRENT


def shutdown() -> None:
    """Leave the process group that :func:`init` made; safe to call twice."""
    global _CURRENT
    topo, _CURRENT = _CURRENT, None
    if topo is not None and getattr(topo, "_owns_group", False) and dist.is_initialized():
        dist.destroy_process_group()
