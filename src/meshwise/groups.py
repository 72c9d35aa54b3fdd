"""Adopting process groups a program already made (Megatron-core's ``parallel_state``, DeepSpeed's topology): the
mesh is built from the named groups in whatever rank order they were made, checked, and adopted as the topology.

It sits just below :mod:`meshwise.topology` (it calls :func:`meshwise.topology.init` with the mesh it builds);
the topology does not import it. Integrations (``meshwise.megatron``, ``meshwise.deepspeed``) read their
package's groups and call :func:`adopt_groups`.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshwise.errors import TopologyError
from meshwise.layout import Dims
from meshwise.topology import Topology, init

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GroupGrid", "adopt_groups", "group_grid", "mesh_from_groups"]

NamedGroups = Mapping[str, "dist.ProcessGroup"] | Sequence[tuple[str, "dist.ProcessGroup"]]


class GroupGrid:
    """Where every rank sits in the grid the named groups make: ``dims`` (fastest-varying last, so rank ``r`` is
    at row-major position ``r``), ``sizes``, and ``grid`` (the rank tensor in that order)."""

    def __init__(self, dims: tuple[str, ...], sizes: tuple[int, ...], grid: torch.Tensor) -> None:
        self.dims, self.sizes, self.grid = dims, sizes, grid

    def __repr__(self) -> str:
        return f"GroupGrid({', '.join(f'{d}={s}' for d, s in zip(self.dims, self.sizes))})"


def _named(groups: NamedGroups) -> list[tuple[str, Any]]:
    items = list(groups.items()) if isinstance(groups, Mapping) else [tuple(item) for item in groups]
    if not items:
        raise TopologyError("no process groups given: pass {dim name: ProcessGroup}, e.g. {'dp': dp_group, ...}")
    names = [n for n, _ in items]
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad or len(set(names)) != len(names):
        raise TopologyError(f"the group names {names} must be distinct non-empty strings: one name per mesh dim")
    for name, group in items:
        if not isinstance(group, dist.ProcessGroup):
            raise TopologyError(
                f"group {name!r} is a {type(group).__name__}, not a torch.distributed ProcessGroup: pass the group "
                "objects your framework made (e.g. parallel_state.get_tensor_model_parallel_group())"
            )
    return items


def _text(names: Sequence[str], ranks: Sequence[Sequence[int]]) -> str:
    return ", ".join(f"{n} {list(r)}" for n, r in zip(names, ranks))


def group_grid(groups: NamedGroups) -> GroupGrid:
    """Read the grid the named groups lay the world's ranks on, in the dim order that makes it row-major.

    Collective: every rank of the world calls it with its own groups under the same names (one
    ``all_gather_object`` of each rank's group members). The groups must tile the world as a grid: each rank's
    coordinate along a dim is its index in that dim's group, every coordinate is held by one rank, and each group
    is the line of the grid through its ranks. Megatron's ``order="tp-cp-ep-dp-pp"`` (tp fastest) gives
    ``("pp", "dp", "cp", "tp")``, ``order="dp-tp-pp"`` gives ``("pp", "tp", "dp")``. A :class:`TopologyError`,
    on every rank alike, names the groups that do not.
    """
    items = _named(groups)
    names = [n for n, _ in items]
    if not dist.is_initialized():
        raise TopologyError("adopting process groups needs torch.distributed initialised: these groups have no world")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [dist.get_process_group_ranks(g) for _, g in items]
    everyone: list[Any] = [None] * world
    if world == 1:
        everyone = [mine]
    else:
        dist.all_gather_object(everyone, mine)
    problem = _grid_problem(names, everyone, world)
    if isinstance(problem, str):
        raise TopologyError(f"rank {rank}: {problem}")
    return problem


def _grid_problem(names: list[str], everyone: list[list[list[int]]], world: int) -> GroupGrid | str:
    """The grid of everyone's groups, or what is wrong with them (the same verdict on every rank)."""
    sizes = [len(g) for g in everyone[0]]
    for r, groups in enumerate(everyone):
        if [len(g) for g in groups] != sizes:
            return (
                f"the groups differ in size across ranks (rank 0: {_text(names, everyone[0])}; rank {r}: "
                f"{_text(names, groups)}): each name must stand for one partition of the world into equal groups"
            )
        missing = [n for n, g in zip(names, groups) if r not in g]
        if missing:
            return f"rank {r} is not a member of its own {missing} group ({_text(names, groups)})"
    if math.prod(sizes) != world:
        return (
            f"the groups {dict(zip(names, sizes))} hold {math.prod(sizes)} ranks as a grid, but the world has {world}: "
            "pass one group for every parallel dim (sizes multiplying to the world size)"
        )
    coords = [tuple(g.index(r) for g in groups) for r, groups in enumerate(everyone)]
    at = {c: r for r, c in enumerate(coords)}
    if len(at) != world:
        r, s = next((r, s) for r in range(world) for s in range(r) if coords[r] == coords[s])
        return (
            f"ranks {s} and {r} hold the same place in every group ({_text(names, everyone[r])}): the groups do "
            "not tell them apart, so they do not span the world as a grid"
        )
    for r, groups in enumerate(everyone):
        for d, group in enumerate(groups):
            line = [at[coords[r][:d] + (i,) + coords[r][d + 1 :]] for i in range(sizes[d])]
            if line != group:
                return (
                    f"rank {r}'s {names[d]} group is {group}, but the other groups place the ranks so that its "
                    f"{names[d]} line is {line}: the groups are not the lines of one grid"
                )
    unit = [at[tuple(int(i == d) for i in range(len(names)))] if sizes[d] > 1 else 0 for d in range(len(names))]
    order = sorted(range(len(names)), key=lambda d: (sizes[d] > 1, -unit[d]))  # size-1 dims first, slowest next
    walked = [
        at[tuple(c[order.index(d)] for d in range(len(names)))]
        for c in itertools.product(*(range(sizes[d]) for d in order))
    ]
    if walked != list(range(world)):
        return (
            f"the groups ({_text(names, everyone[0])} on rank 0) place the ranks in no row-major order of any dim "
            "order (rank r must sit at position r, as torchrun/Megatron/DeepSpeed number them): meshwise's data "
            "ranks and groups could not agree with them"
        )
    grid = torch.tensor(walked, dtype=torch.int).reshape([sizes[d] for d in order])
    return GroupGrid(tuple(names[d] for d in order), tuple(sizes[d] for d in order), grid)


def mesh_from_groups(groups: NamedGroups, *, device_type: str | None = None) -> DeviceMesh:
    """A DeviceMesh over the world whose dims are the named groups themselves (no new group is made), ordered so
    that it is row-major (:func:`group_grid`): the mesh ``meshwise.init(mesh)`` adopts. Collective.

    ``device_type`` defaults to ``"cuda"`` for NCCL groups, else ``"cpu"``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    items = dict(_named(groups))
    layout = group_grid(items)
    if device_type is None:
        backend = str(dist.get_backend(next(iter(items.values()))))
        device_type = "cuda" if "nccl" in backend else "cpu"
    return DeviceMesh.from_group(
        [items[d] for d in layout.dims], device_type, mesh=layout.grid, mesh_dim_names=layout.dims
    )


def adopt_groups(
    groups: NamedGroups,
    *,
    roles: Mapping[str, str] | str | None = None,
    timeout: float | datetime.timedelta | None = None,
    debug: bool | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    extra_groups: Iterable[Dims] | None = None,
    device_type: str | None = None,
) -> Topology:
    """Make the program's own process groups the topology, in one call: ``{dim name: ProcessGroup}``.

    The mesh is built from the groups (:func:`mesh_from_groups`: its dims in the order their ranks vary, slowest
    first, whatever order they were made or named in), then adopted by :func:`meshwise.init` with ``roles`` (each
    dim without a default role needs one). Each dim's group is the object given (``topo.group("tp") is tp_group``);
    meshwise makes only the flattened groups of several dims it uses (batch, metric, replica), carrying
    ``timeout``. ``extra_groups`` is init's ``groups=`` (more selections to flatten). Every rank calls it.
    """
    mesh = mesh_from_groups(groups, device_type=device_type)
    return init(mesh, roles=roles, timeout=timeout, debug=debug, run_dir=run_dir, groups=extra_groups)
