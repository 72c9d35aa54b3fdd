"""The pure arithmetic of a mesh: dims, sizes and roles, which ranks sit where, and advice on node placement.

Nothing here starts a process or touches ``torch.distributed``, so it also plans meshes for machines you
do not have (``meshwise describe``).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshwise.errors import TopologyError

__all__ = [
    "AMBIGUOUS_NAMES",
    "DEFAULT_ROLES",
    "ROLES",
    "Dims",
    "Layout",
    "check_rank_grid",
    "dims_crossing_nodes",
    "parse_mesh",
    "parse_roles",
    "placement_warnings",
]

ROLES = ("batch", "split", "replica", "stage")

#: Default role of well-known mesh dimension names; any other name needs an explicit role.
DEFAULT_ROLES: dict[str, str] = {
    **dict.fromkeys(("dp", "ddp", "data_parallel", "dp_replicate", "dp_shard", "fsdp"), "batch"),
    **dict.fromkeys(("cp", "context_parallel", "domain", "spatial"), "split"),
    **dict.fromkeys(("tp", "tensor_parallel"), "replica"),
    **dict.fromkeys(("pp", "pipeline"), "stage"),
}

# Each reading: (role, where the name means it, what each rank of the dim then holds).
_MODEL = (
    ("replica", "Megatron-LM/fairscale-style tensor parallel", "the same samples"),
    ("split", "PhysicsNeMo spatial/domain parallel", "a part of every sample"),
)
_SEQUENCE = (
    ("split", "sequence parallel as a dim of its own (DeepSpeed Ulysses, ring attention)", "a part of every sequence"),
    ("replica", "Megatron-style sequence parallel on the tensor-parallel group", "whole samples, as tensor parallel"),
)
_EXPERT = (
    ("batch", "expert parallel carved out of data parallel (DeepSpeed-MoE, Megatron-core)", "different samples"),
    ("replica", "experts sharded over ranks that see the same tokens", "the same samples, as tensor parallel"),
)
#: Names that mean different things in different ecosystems: no default role, and a mesh using one without
#: ``roles=`` is an error that shows every reading: (role, where the name means it, what each rank holds).
AMBIGUOUS_NAMES: dict[str, tuple[tuple[str, str, str], ...]] = {
    **dict.fromkeys(("model_parallel", "mp", "model"), _MODEL),
    **dict.fromkeys(("sp", "sequence_parallel"), _SEQUENCE),
    **dict.fromkeys(("ep", "expert_parallel"), _EXPERT),
    "replicate": (
        ("batch", "torch HSDP's ('replicate', 'shard') mesh", "different samples (replicated parameters)"),
        ("replica", "a dim whose ranks hold the same samples and outputs", "the same samples"),
    ),
    "shard": (
        ("batch", "torch FSDP/HSDP's shard dim", "different samples (sharded parameters)"),
        ("split", "sharded samples (domain decomposition)", "a part of every sample"),
    ),
}

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
        raise TopologyError(
            f"mesh must be a non-empty mapping name -> size, a 'dp=-1,tp=2' string or (to meshwise.init) a "
            f"DeviceMesh with dim names, got {mesh!r}"
        )
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


def _missing_roles_message(spec: Mapping[str, int], missing: Sequence[str]) -> str:
    """One message for every dim without a role: each ambiguous name with its readings, then the one-line fix."""
    lines = []
    for name in missing:
        readings = AMBIGUOUS_NAMES.get(name)
        if readings is None:
            lines.append(f"mesh dim {name!r} has no default role")
            continue
        said = ", ".join(f"{role!r} in {where} (each rank holds {holds})" for role, where, holds in readings)
        lines.append(f"mesh dim {name!r} has no default role because the name means different things: {said}")
    first = missing[0]
    if len(missing) == 1 and first in AMBIGUOUS_NAMES:
        fix = " or ".join(f"roles={{{first!r}: {role!r}}}" for role, _, _ in AMBIGUOUS_NAMES[first])
    else:
        fix = "roles={" + ", ".join(f"{n!r}: ..." for n in missing) + "}"
    return (
        "; ".join(lines)
        + f". Say what the ranks along {'it' if len(missing) == 1 else 'each'} hold: meshwise.init(..., {fix}) "
        + f"(or --roles {first}=...), roles being {', '.join(ROLES)} (mesh {dict(spec)}; names with a default "
        + f"role: {', '.join(sorted(DEFAULT_ROLES))})"
    )


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
        resolved_roles = [explicit.get(name, DEFAULT_ROLES.get(name)) for name in spec]
        missing = [name for name, role in zip(spec, resolved_roles) if role is None]
        if missing:
            raise TopologyError(_missing_roles_message(spec, missing))
        for name, role in zip(spec, resolved_roles):
            if role not in ROLES:
                raise TopologyError(f"role {role!r} of mesh dim {name!r} is unknown: use one of {ROLES}")
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

    def dims_text(self) -> str:
        """``dp=2 (batch), tp=2 (replica)``: every dim with its size and role, as error messages list them."""
        return ", ".join(f"{d}={s} ({r})" for d, s, r in zip(self.dims, self.sizes, self.roles))

    def dims_with(self, *roles: str) -> tuple[str, ...]:
        """The dims holding any of ``roles``, in mesh order."""
        return tuple(d for d, r in zip(self.dims, self.roles) if r in roles)

    def role(self, dim: str) -> str:
        return self.roles[self.index(dim)]

    def index(self, dim: str) -> int:
        try:
            return self.dims.index(dim)
        except ValueError:
            raise TopologyError(f"mesh has no dim {dim!r}: its dims are {self.dims_text()}") from None

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
        stage = self.dims_with("stage")
        if stage:  # each rank's stage is its coordinate in the pp(stage) column
            summary += f"; stage dims {stage} ({self.size(stage)} pipeline stages)"
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

    def summary(self, nodes: Sequence[int] | None = None, node_names: Sequence[str] | None = None) -> str:
        """What :meth:`table` says without a row per rank, for large worlds: one line per dim's groups."""
        lines = [f"mesh {self.dims_text()}, world {self.world_size} (a row per rank: describe(all_ranks=True))"]
        for i, (dim, size) in enumerate(zip(self.dims, self.sizes)):
            stride = math.prod(self.sizes[i + 1 :])
            ranks = f"0-{size - 1}" if stride == 1 else f"0,{stride},...,{stride * (size - 1)}"
            count = self.world_size // size
            lines.append(f"  {dim} groups: {count} of {size} ranks, {stride} apart (the first: {ranks})")
        if nodes is not None:
            nodes = _check_nodes(self, nodes)
            names = list(node_names or [])
            lines.append(
                f"  {len(set(nodes))} node(s) ({names[0] if names else 'node 0'}, ...); dims whose groups cross "
                f"nodes: {dims_crossing_nodes(self, nodes) or '-'}"
            )
            lines += [f"warning: {w}" for w in placement_warnings(self, nodes)]
        return "\n".join(lines)


def check_rank_grid(layout: Layout, grid: Sequence) -> None:
    """Refuse a DeviceMesh's rank grid (``mesh.mesh.tolist()``) that is not ``layout``'s row-major order.

    Every coordinate, group order and data rank meshwise derives assumes rank ``r`` sits at the row-major
    position ``r`` over ``layout.dims`` (what ``init_device_mesh`` builds). A mesh built from another rank
    tensor would make meshwise and the mesh disagree on which rank holds which tile: a
    :class:`TopologyError` instead, naming the dim order that would match when a transposition is all it is.
    """
    shape = tuple(len(level) for level in _grid_levels(grid, len(layout.dims)))
    if shape != layout.sizes:
        raise TopologyError(
            f"the DeviceMesh's rank grid has shape {list(shape)} but its dims are {layout.dims_text()} over a world "
            f"of {layout.world_size}: pass the root mesh over every rank, not a slice"
        )
    cells = _grid_cells(grid, len(layout.dims))
    if cells == list(range(layout.world_size)):
        return
    lookup = {tuple(c): r for c, r in zip(itertools.product(*map(range, layout.sizes)), cells)}
    matches = []
    for order in itertools.permutations(range(len(layout.dims))):
        sizes = [layout.sizes[i] for i in order]
        walked = []
        for c in itertools.product(*map(range, sizes)):
            position = [0] * len(order)
            for i, value in zip(order, c):
                position[i] = value
            walked.append(lookup[tuple(position)])
        if walked == list(range(layout.world_size)):
            matches.append(tuple(layout.dims[i] for i in order))
    hint = (
        f"Its ranks are init_device_mesh's order for the dims as {matches[0]}: build it as init_device_mesh(device, "
        f"{tuple(layout.sizes[layout.index(d)] for d in matches[0])}, mesh_dim_names={matches[0]}) and slice "
        "by name as before (a mesh made with DeviceMesh.from_group: pass the groups in that dim order)"
        if matches
        else "Build it with init_device_mesh(device, sizes, mesh_dim_names=...)"
    )
    # a program that brought process groups (Megatron's, DeepSpeed's) needs no mesh call of its own
    hint += ". With process groups of your own, meshwise.groups.adopt_groups({name: group, ...}) orders them itself"
    shown = grid if layout.world_size <= 16 else "..."
    raise TopologyError(
        f"the DeviceMesh over {layout.dims_text()} does not place rank r at row-major position r (its rank grid is "
        f"{shown}); meshwise's coordinates, groups and data ranks would disagree with the mesh's. {hint}"
    )


def _grid_levels(grid: Sequence, depth: int) -> list[Sequence]:
    """The first row at each nesting level of a rank grid (its shape, one level at a time)."""
    levels, level = [], grid
    for _ in range(depth):
        if not isinstance(level, Sequence) or isinstance(level, str):
            break
        levels.append(level)
        level = level[0] if level else None
    return levels


def _grid_cells(grid: Sequence, depth: int) -> list[int]:
    """The ranks of a nested rank grid, row-major."""
    if depth == 0:
        return [int(grid)]  # type: ignore[call-overload]
    return [r for row in grid for r in _grid_cells(row, depth - 1)]


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
    first (outermost) would keep those groups inside a node, and for each ``stage`` dim that crosses nodes
    needlessly: while a batch dim crosses them anyway, and declaring the batch dims first keeps the stage
    groups inside a node without pushing a replica or split dim out.

    ``nodes[r]`` is the node of global rank ``r``. Launchers number ranks node by node and the mesh's last
    dim varies fastest, so the last dims land inside a node: tensor-parallel all-reduces (every layer) and
    halo exchanges belong there, while a batch dim's gradient reduction (once a step) can cross the network.
    A pipeline's point-to-point sends are light (one activation per micro-batch and boundary), so a stage
    dim crossing nodes to keep every other dim inside one is the usual layout and is not warned about.

    ``nodes`` is where the ranks really run (:func:`meshwise.init` learns it from ``SLURM_NODEID``, torchrun's
    ``GROUP_RANK`` or the hostname), not where they would run numbered node by node: when the launcher placed them
    otherwise (``srun -m cyclic``, or uneven tasks per node as ``srun -N 2 -n 4`` may give: 3 + 1) and a
    ``replica`` or ``split`` dim's groups cross nodes that ranks numbered node by node, as many on each node,
    would keep inside one, the advice names the srun options that do that (``-m block``,
    ``--ntasks-per-node``), with the batch-first order too where that is also needed.
    Pure arithmetic: :func:`meshwise.init` warns with these messages (:class:`PlacementWarning`) on rank 0.
    """
    nodes = _check_nodes(layout, nodes)
    return _order_warnings(layout, nodes) + _launch_warnings(layout, nodes)


def _order_warnings(layout: Layout, nodes: list[int]) -> list[str]:
    """The advice of :func:`placement_warnings` on the order of the dims, for the ranks where they are."""
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
    return messages + _stage_warnings(layout, reordered, nodes, spec)


def _stage_warnings(layout: Layout, reordered: Layout, nodes: Sequence[int], spec: str) -> list[str]:
    """Stage dims whose p2p crosses nodes although a batch dim crosses them anyway and the batch-first
    order ``reordered`` keeps the stage groups inside a node at no cost to replica or split dims."""
    batch = layout.dims_with("batch")
    chatty = layout.dims_with("replica", "split")
    if not any(_spans_nodes(layout, d, nodes) for d in batch) or any(
        _spans_nodes(reordered, d, nodes) and not _spans_nodes(layout, d, nodes) for d in chatty
    ):
        return []  # the stage dim's crossing keeps the batch (or a chattier) dim inside the nodes: wanted
    messages = []
    for dim in layout.dims_with("stage"):
        if not _spans_nodes(layout, dim, nodes) or _spans_nodes(reordered, dim, nodes):
            continue
        groups = layout.groups(dim)
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
        messages.append(
            f"mesh dim {dim!r} (stage) crosses nodes: its groups {shown} "
            f"send every micro-batch's activations and gradients over the network, while batch dim(s) "
            f"{list(batch)} cross nodes anyway. Declare the batch dims first, mesh '{spec}' (same roles), and each "
            f"{dim!r} group stays on one node (a warning only: the pipeline's sends are light)"
        )
    return messages


def _block_nodes(counts: Sequence[int]) -> list[int]:
    """Ranks numbered node by node: ``counts[n]`` ranks on node ``n``."""
    return [n for n, count in enumerate(counts) for _ in range(count)]


def _launch_warnings(layout: Layout, nodes: list[int]) -> list[str]:
    """Replica and split dims that cross nodes because of where the launcher put the ranks (not node by node, or
    uneven counts), when node-by-node numbering (with the same counts, else as many on each node) would keep them
    inside a node: the srun options that do it. Only dims whose crossing the dims' order cannot fix alone."""
    node_ids = sorted(set(nodes))
    if len(node_ids) < 2:
        return []
    counts = [nodes.count(n) for n in node_ids]
    candidates: list[tuple[list[int], str]] = []
    if nodes != _block_nodes(counts):
        candidates.append((_block_nodes(counts), "-m block"))
    if len(set(counts)) > 1 and layout.world_size % len(counts) == 0:
        even = layout.world_size // len(counts)
        option = f"--ntasks-per-node={even}" + (" -m block" if nodes != _block_nodes(counts) else "")
        candidates.append((_block_nodes([even] * len(counts)), option))
    if not candidates:
        return []  # numbered node by node, as many on each node: the order of the dims is the only advice
    batch = layout.dims_with("batch")
    order = [*batch, *(d for d in layout.dims if d not in batch)]
    reordered = Layout(
        tuple(order), tuple(layout.sizes[layout.index(d)] for d in order), tuple(layout.role(d) for d in order)
    )
    spec = ",".join(f"{d}={reordered.sizes[i]}" for i, d in enumerate(order))
    messages = []
    for dim in layout.dims_with("replica", "split"):
        if not _spans_nodes(layout, dim, nodes) or (batch and not _spans_nodes(reordered, dim, nodes)):
            continue  # inside the nodes, or the order of the dims alone fixes it (the order advice says so)
        fix = None
        for placed, option in candidates:
            if not _spans_nodes(layout, dim, placed):
                fix = f"start the job with srun {option}"
                break
            if batch and reordered.dims != layout.dims and not _spans_nodes(reordered, dim, placed):
                fix = f"start the job with srun {option} and declare the batch dims first, mesh '{spec}'"
                break
        if fix is None:
            continue
        role = layout.role(dim)
        groups = layout.groups(dim)
        shown = " ".join(
            "[" + ",".join(map(str, g)) + "] (nodes " + ",".join(str(nodes[r]) for r in g) + ")" for g in groups[:4]
        ) + (" ..." if len(groups) > 4 else "")
        placement = ", ".join(
            f"node {n}: ranks {_ranks_text([r for r, m in enumerate(nodes) if m == n])}" for n in node_ids
        )
        how = [] if nodes == _block_nodes(counts) else ["not numbered node by node"]
        how += ["not as many on each node"] if len(set(counts)) > 1 else []
        messages.append(
            f"mesh dim {dim!r} ({role}) crosses nodes because of where the launcher placed the ranks ({placement}; "
            f"{' and '.join(how)}): its groups "
            f"{shown}, so its collectives ({'every layer' if role == 'replica' else 'every halo exchange'}) go over "
            f"the network. To keep each {dim!r} group on one node, {fix} (ranks numbered node by node, as "
            "many on each node, as torchrun does)"
        )
    return messages
