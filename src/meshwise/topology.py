"""The declared parallel topology of a run: :func:`init` builds the :class:`Topology` (the DeviceMesh and its
groups) that every layer reaches through :func:`resolve`, and :func:`shutdown` leaves it.

The mesh arithmetic lives in :mod:`meshwise.layout`, the launcher's variables are read in
:mod:`meshwise.environment` and the world's process group is joined in :mod:`meshwise.rendezvous`; layers above
(the debug watchdog, the dry run's recorder in :mod:`meshwise.dryrun`) register work for init and shutdown with
:func:`on_init` and :func:`on_shutdown`: this module imports none of them.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshwise import compat
from meshwise.environment import Environment, detect_environment
from meshwise.errors import PlacementWarning, TopologyError
from meshwise.layout import ROLES, Dims, Layout, check_rank_grid, placement_warnings
from meshwise.rendezvous import choose_device, join_process_group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Dims",
    "Topology",
    "current",
    "group_selections",
    "init",
    "on_init",
    "on_shutdown",
    "resolve",
    "shutdown",
]

DEFAULT_TIMEOUT_S = 600.0


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
    mesh: DeviceMesh  # the root mesh: built by init, or the program's own (adopted)
    debug: bool = False  # fingerprint every collective on a topology group before it runs (meshwise.debug)
    run_dir: Path = Path("runs")  # where hang reports (every rank's stacks) are written
    # The DeviceMesh of every dim selection that has a group (see group_dims), made collectively at init.
    _submeshes: dict[tuple[str, ...], object] = field(default_factory=dict, repr=False)
    # Each global rank's node index (numbered in rank order) and each node's hostname, learnt once at init.
    # Empty when the Topology was built by hand: every rank then counts as node 0.
    node_of_rank: tuple[int, ...] = ()
    node_names: tuple[str, ...] = ()
    # Whether init created the process group, so shutdown() destroys it; a group that existed before is left alone.
    owns_group: bool = False
    _group_ranks: dict[tuple[str, ...], list[int]] = field(default_factory=dict, init=False, repr=False)

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
        if any(r not in ROLES for r in roles):
            raise TopologyError(f"unknown role in {roles}: use one of {ROLES}")
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
        """The DeviceMesh over ``dims``: one dim, or several flattened into one dim (one of :attr:`group_dims`)."""
        key = self.layout.normalize(dims)
        if not key:
            raise TopologyError("submesh() needs at least one dim; an empty selection has no mesh")
        if key in self._submeshes:
            return self._submeshes[key]
        if len(key) == 1 or not self._submeshes:
            raise TopologyError(
                f"no mesh for dims {key}: this Topology was built by hand; make it with meshwise.init(...)"
            )
        raise TopologyError(
            f"no group for dims {key}: meshwise.init makes each dim's group and those of the batch, metric, "
            f"replica and all dims (here {self.group_dims}); pass meshwise.init(..., groups=[{key!r}]) to make it"
        )

    @property
    def group_dims(self) -> tuple[tuple[str, ...], ...]:
        """Every dim selection that has a group (made at init), each a tuple in mesh order."""
        return tuple(self._submeshes)

    def group(self, dims: Dims) -> dist.ProcessGroup:
        """The ProcessGroup of this rank's group along ``dims`` (flattened groups were made at init)."""
        return self.submesh(dims).get_group()  # type: ignore[attr-defined]

    def describe(self, all_ranks: bool | None = None) -> str:
        """Device, backend and the layout: a row per rank up to 64 ranks (or ``all_ranks``), else a line per dim."""
        head = f"backend {self.backend}, device {self.device.type}, launcher {self.environment.launcher}\n"
        rows = self.world_size <= 64 if all_ranks is None else all_ranks
        return head + (self.layout.table if rows else self.layout.summary)(self.nodes, self.node_names)

    def barrier(self) -> None:
        dist.barrier()

    def __repr__(self) -> str:
        mesh = ", ".join(f"{d}={s}:{r}" for d, s, r in zip(self.layout.dims, self.layout.sizes, self.layout.roles))
        return f"Topology({mesh}; {self.label()}, {self.device})"


_CURRENT: Topology | None = None
_ON_INIT: list[Callable[[Topology], None]] = []
_ON_SHUTDOWN: list[Callable[[Topology], None]] = []


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


def on_init(hook: Callable[[Topology], None]) -> None:
    """Run ``hook(topology)`` at the end of every :func:`init`, in registration order (a second registration of
    the same hook is ignored): how a layer above (the watchdog, the dry run) joins init unimported."""
    if hook not in _ON_INIT:
        _ON_INIT.append(hook)


def on_shutdown(hook: Callable[[Topology], None]) -> None:
    """Run ``hook(topology)`` at the start of :func:`shutdown`, while the process group still exists, in
    registration order; only when a topology exists. A second registration of the same hook is ignored.
    """
    if hook not in _ON_SHUTDOWN:
        _ON_SHUTDOWN.append(hook)


def init(
    mesh: Mapping[str, int] | str | DeviceMesh | None = None,
    *,
    roles: Mapping[str, str] | str | None = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    debug: bool | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    groups: Iterable[Dims] | None = None,
) -> Topology:
    """Join the process group and build the declared mesh, or adopt the user's; returns the :class:`Topology`.

    ``mesh`` is ``{"dp": -1, "tp": 2}``, ``"dp=-1,tp=2"``, ``None`` to read ``MESHWISE_MESH`` (default
    ``dp=-1``), or a ``DeviceMesh`` the program already built: its dims, sizes, order, device and groups are
    adopted (``roles`` still names the role of any dim without a default), after checking that its ranks sit
    where meshwise's arithmetic puts them. ``timeout`` (seconds, default ``MESHWISE_TIMEOUT`` or 600) bounds the
    rendezvous and every collective of every group meshwise creates. ``debug`` (default ``MESHWISE_DEBUG``)
    compares a fingerprint of every collective on a topology group across the group before it runs
    (:mod:`meshwise.debug`); ``run_dir`` (default ``MESHWISE_RUN_DIR`` or ``runs``) receives hang reports. Under a
    launcher every process must call this with the same arguments. A process group that already exists is joined
    as it is, once its rank and size are checked against the launcher's.

    Groups are made here, on every rank, for each dim and the batch, metric (batch + split), replica and all dims;
    ``groups=[("cp", "tp"), ...]`` names any other selection to make. Each rank's node is learnt here (one
    all-gather); when a ``replica`` or ``split`` dim crosses nodes although declaring the ``batch`` dims first
    would keep it inside one, rank 0 warns with a :class:`PlacementWarning`. :func:`on_init` hooks run last.
    """
    global _CURRENT
    if _CURRENT is not None:
        raise TopologyError("meshwise.init() was already called in this process: call meshwise.shutdown() first")
    env = detect_environment()
    if dist.is_initialized():
        env = _agree_with_process_group(env)
    timeout, debug, run_dir = _settings(timeout, debug, run_dir)
    adopted = _device_mesh_or_none(mesh)
    if adopted is None:
        layout = Layout.resolve(mesh, env.world_size, roles)  # type: ignore[arg-type]
        _check_launcher_mesh(mesh, layout, env.world_size, roles)
        selections = group_selections(layout, groups)
        device, backend = choose_device(env, backend)
        owns_group = join_process_group(env, device, backend, timeout)
        root = _build_mesh(layout, device, backend, timeout)
    else:
        layout, device, backend = _adopt_mesh(adopted, env, roles, backend)
        selections = group_selections(layout, groups)
        owns_group, root = False, adopted
    submeshes = _make_groups(root, selections, backend, timeout, adopted is not None)
    nodes, names = _exchange_nodes(env)
    _CURRENT = Topology(
        layout, env, device, backend, timeout, root, debug, run_dir, submeshes, nodes, names, owns_group
    )
    if env.rank == 0:  # the same advice on every rank: one copy is enough
        for message in placement_warnings(layout, nodes):
            warnings.warn(message, PlacementWarning, stacklevel=_outside_meshwise())
    for hook in list(_ON_INIT):
        hook(_CURRENT)
    return _CURRENT


def _check_launcher_mesh(mesh: object, layout: Layout, world_size: int, roles: object) -> None:
    """A mesh given in code that differs from the launcher's (``meshwise run --mesh``, exported as
    ``MESHWISE_MESH``) is an error naming both: one of them would be silently ignored."""
    launched = os.environ.get("MESHWISE_MESH")
    if mesh is None or not launched:
        return
    try:
        theirs: Layout | None = Layout.resolve(launched, world_size, roles)  # type: ignore[arg-type]
    except TopologyError:
        theirs = None
    if theirs is not None and (theirs.dims, theirs.sizes) == (layout.dims, layout.sizes):
        return
    code = ",".join(f"{d}={s}" for d, s in zip(layout.dims, layout.sizes))
    raise TopologyError(
        f"meshwise.init() was given the mesh {code} but the launcher's is {launched} (meshwise run --mesh, "
        f"or MESHWISE_MESH): give the mesh in one place: call meshwise.init() without a mesh to take the "
        f"launcher's, or launch with --mesh {code}"
    )


def shutdown() -> None:
    """Run the :func:`on_shutdown` hooks, then leave the process group that :func:`init` made; safe to call twice."""
    global _CURRENT
    topo = _CURRENT
    if topo is None:
        return
    try:
        for hook in list(_ON_SHUTDOWN):
            hook(topo)
    finally:
        _CURRENT = None
        if topo.owns_group and dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- the steps of init


def group_selections(layout: Layout, extra: Iterable[Dims] | None = None) -> list[tuple[str, ...]]:
    """The dim selections :func:`init` makes groups for, each a tuple in mesh order, without repeats.

    Each single dim; the batch, metric (batch + split), replica and all dims when they hold two or more
    dims (what meshwise's layers use); then every selection in ``extra``. Flattening every combination
    instead would make 2^k - k - 1 groups for k dims.
    """
    wanted: list[tuple[str, ...]] = [(d,) for d in layout.dims]
    for dims in (
        layout.dims_with("batch"),
        layout.dims_with("batch", "split"),
        layout.dims_with("replica"),
        layout.dims,
    ):
        if len(dims) >= 2:
            wanted.append(dims)
    if isinstance(extra, str):
        raise TopologyError(
            f"groups={extra!r} is one string: pass a list of dim selections, e.g. groups=[({extra!r}, ...)]"
        )
    for selection in extra or ():
        try:
            key = layout.normalize(selection)
        except (TopologyError, TypeError) as exc:
            raise TopologyError(
                f"groups entry {selection!r} is not a selection of mesh dims ({exc}): name dims of {layout.dims}, "
                f"e.g. groups=[{layout.dims[-2:]!r}]"
            ) from None
        if not key:
            raise TopologyError(f"groups entry {selection!r} is empty: name at least one dim of {layout.dims}")
        wanted.append(key)
    return list(dict.fromkeys(wanted))


def _settings(
    timeout: float | datetime.timedelta | None, debug: bool | None, run_dir: str | os.PathLike[str] | None
) -> tuple[datetime.timedelta, bool, Path]:
    """init's options, each defaulting to its ``MESHWISE_*`` variable (set by ``meshwise run``)."""
    if timeout is None:
        timeout = float(os.environ.get("MESHWISE_TIMEOUT", DEFAULT_TIMEOUT_S))
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if debug is None:
        debug = os.environ.get("MESHWISE_DEBUG", "").lower() in ("1", "true", "yes", "on")
    run_dir = Path(run_dir if run_dir is not None else os.environ.get("MESHWISE_RUN_DIR", "runs"))
    return timeout, bool(debug), run_dir


def planned_nodes(env: Environment) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Every rank's node as a launcher numbers them (node by node), asking no one: a dry run's placement."""
    per_node = max(env.local_world_size, 1)
    count = -(-env.world_size // per_node)
    return tuple(r // per_node for r in range(env.world_size)), tuple(f"node{n}" for n in range(count))


def _backend_options(backend: str, timeout: datetime.timedelta) -> object:
    """Backend options that carry the timeout (``dist.new_group`` does not inherit it: docs/torch.md)."""
    if backend == "gloo":
        opts = compat.gloo_options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return backend
    return (backend, compat.set_options_timeout(opts, timeout))


def _build_mesh(layout: Layout, device: torch.device, backend: str, timeout: datetime.timedelta) -> DeviceMesh:
    """The root DeviceMesh of ``layout``, each dim's group carrying the timeout."""
    from torch.distributed.device_mesh import init_device_mesh

    override = _backend_options(backend, timeout)
    return init_device_mesh(
        device.type, layout.sizes, mesh_dim_names=layout.dims, backend_override={d: override for d in layout.dims}
    )


def _make_groups(
    root: DeviceMesh, selections: list[tuple[str, ...]], backend: str, timeout: datetime.timedelta, adopted: bool
) -> dict[tuple[str, ...], DeviceMesh]:
    """The submesh of every selection, flattened now, collectively on all ranks (never lazily on a subset:
    a group that some ranks create and others do not hangs). torch reuses a flattened mesh of the same name
    on ``root``, and, on an adopted mesh, the default group for all dims when given no backend options."""
    override = _backend_options(backend, timeout)
    submeshes: dict[tuple[str, ...], DeviceMesh] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing flattened dims warns about a future deprecation
        for dims in selections:
            if len(dims) == 1:
                submeshes[dims] = root[dims[0]]
                continue
            whole = adopted and len(dims) == root.ndim
            submeshes[dims] = compat.flatten_mesh(root[dims], "_".join(dims), None if whole else override)
    return submeshes


def _device_mesh_or_none(mesh: object) -> DeviceMesh | None:
    """``mesh`` when it is a DeviceMesh (to adopt), else None (a spec for Layout.resolve)."""
    if mesh is None or isinstance(mesh, (str, Mapping)):
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return mesh if isinstance(mesh, DeviceMesh) else None


def _agree_with_process_group(env: Environment) -> Environment:
    """The environment of a process group the program created itself, checked against the launcher's: without
    launcher variables the group is the only word on rank and size; with them, both must say the same."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if env.launcher == "none" and world > 1:
        return replace(env, launcher="torch.distributed", rank=rank, world_size=world, local_world_size=world)
    if (env.rank, env.world_size) != (rank, world):
        raise TopologyError(
            f"torch.distributed says this is rank {rank} of {world} but the launcher's variables say rank "
            f"{env.rank} of {env.world_size} ({env.launcher}): start the program with the launcher whose group it "
            "joined, or let meshwise.init() create the process group"
        )
    return env


def _adopt_mesh(
    mesh: DeviceMesh, env: Environment, roles: Mapping[str, str] | str | None, backend: str | None
) -> tuple[Layout, torch.device, str]:
    """The layout, device and backend of a DeviceMesh the program built, each checked, never assumed."""
    names = mesh.mesh_dim_names
    if not names:
        raise TopologyError(
            "meshwise.init(mesh=...) got a DeviceMesh without dim names: build it with init_device_mesh(device, "
            "sizes, mesh_dim_names=('dp', 'tp')) so that every dim can have a role"
        )
    grid = mesh.mesh
    if grid.numel() != env.world_size:
        raise TopologyError(
            f"meshwise.init(mesh=...) got a DeviceMesh over {grid.numel()} of the world's {env.world_size} ranks "
            f"(dims {names}, sizes {tuple(grid.shape)}): pass the root mesh, over every rank, not a slice of it"
        )
    layout = Layout.resolve(dict(zip(names, grid.shape)), env.world_size, roles)
    check_rank_grid(layout, grid.tolist())
    ours = layout.coordinates(env.rank)
    theirs = {d: mesh.get_local_rank(d) for d in names}
    if mesh.get_rank() != env.rank or theirs != ours:
        raise TopologyError(
            f"the DeviceMesh puts rank {mesh.get_rank()} at {theirs} but meshwise puts rank {env.rank} at {ours}: "
            "build the mesh with init_device_mesh over the default process group"
        )
    theirs_backend = dist.get_backend(mesh.get_group(names[0]))
    if backend is not None and backend != theirs_backend:
        raise TopologyError(
            f"backend={backend!r} but the DeviceMesh's groups use {theirs_backend!r}: drop backend= (an adopted "
            "mesh keeps its own)"
        )
    kind = mesh.device_type
    device = torch.device(kind) if kind == "cpu" else torch.device(kind, torch.get_device_module(kind).current_device())
    return layout, device, theirs_backend


def _exchange_nodes(env: Environment) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Every rank's node, learnt with one all-gather on the world at init (never on a hot path): the launcher's
    node index where it gives one (``GROUP_RANK``, ``SLURM_NODEID``: two torchrun "nodes" on one machine share
    a hostname), else the hostname."""
    if env.launcher == "dry-run":  # the planned placement: no one to ask, and no O(world) exchange
        return planned_nodes(env)
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


def _outside_meshwise() -> int:
    """The ``stacklevel`` that makes a warning raised by this function's caller point at the user's code."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level
