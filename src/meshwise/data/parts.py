"""Sample parts: which region of each sample a rank loads along the topology's ``split`` dims (``Shard``/``Replicate``).

Parts split like DTensor's ``Shard`` (``torch.chunk``: ``ceil(n / k)`` cells a part, the last parts shorter
or empty). A halo adds up to ``halo`` neighbour cells at each *interior* edge; there are no halo cells beyond
the global border, so the first and last parts are shorter than the interior ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshwise import compat
from meshwise.errors import DataError
from meshwise.topology import Topology, resolve

__all__ = [
    "FieldPart",
    "PartSpec",
    "Replicate",
    "Shard",
    "as_dtensor",
    "as_parts",
    "balanced_bounds",
    "chunk_bounds",
    "from_placements",
    "largest_halo",
    "parts_of",
    "resolve_part",
]


@dataclass(frozen=True)
class Shard:
    """Split axis ``axis`` of each sample (0 = first axis after the sample axis) over a ``split`` dim.

    ``halo`` neighbour cells are added at each interior edge. ``dim`` names the split dim; it may be left out
    when the topology has exactly one split dim. Give a list of ``Shard`` to split a field over several dims.
    ``balanced=True`` (token windows under causal attention): the axis is cut into ``2k`` equal chunks and rank
    ``i`` of ``k`` loads chunks ``i`` and ``2k-1-i``, so every rank computes the same share of a causal attention;
    the batch then carries ``positions`` (see :func:`balanced_bounds`).
    """

    axis: int
    halo: int = 0
    dim: str | None = None
    balanced: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise DataError(f"Shard axis must be an int, got {self.axis!r}")
        if isinstance(self.halo, bool) or not isinstance(self.halo, int) or self.halo < 0:
            raise DataError(f"Shard halo must be an int >= 0, got {self.halo!r}")
        if self.balanced and self.halo:
            raise DataError(
                f"Shard(axis={self.axis}, halo={self.halo}, balanced=True): a balanced part is two chunks of the "
                "axis, with no halo; attention reaches the other ranks' tokens itself (meshwise.parallel.attention)"
            )


@dataclass(frozen=True)
class Replicate:
    """Every split rank loads the whole sample of this field (the default for fields not named in ``parts``)."""


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``n`` cells split into ``parts`` like ``torch.chunk``/DTensor."""
    size = math.ceil(n / parts) if n else 0
    start = min(index * size, n)
    return start, min(start + size, n)


def balanced_bounds(n: int, parts: int, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[start, stop)`` chunks that rank ``index`` of ``parts`` loads of ``n`` cells cut into ``2*parts``.

    Chunk ``index`` and chunk ``2*parts-1-index``: under a causal mask chunk ``c`` attends to ``c+1`` chunks, so
    every rank attends to ``2*parts+1`` chunks' worth of keys. ``n`` must divide by ``2*parts``.
    """
    if n % (2 * parts):
        raise DataError(
            f"{n} cells cannot be cut into {2 * parts} equal chunks for a balanced split over {parts} ranks: use a "
            f"window length divisible by {2 * parts} (e.g. {n - n % (2 * parts) or 2 * parts}) or a different "
            "split size"
        )
    size = n // (2 * parts)
    first, second = index, 2 * parts - 1 - index
    return (first * size, (first + 1) * size), (second * size, (second + 1) * size)


@dataclass(frozen=True)
class FieldPart:
    """Where one field's loaded part sits: per sample axis, the global region read and the interior inside it.

    ``region[a]`` is the slice of the full sample read (halo included); ``interior[a]`` is the slice of the
    loaded part that this rank owns (halo excluded); ``placements`` maps each split dim to the sample axis it
    shards (or ``None``: replicated). A balanced part (``Shard(..., balanced=True)``) is read as the regions of
    ``pieces``, joined along sample axis ``balanced[1]`` (``balanced = (dim, axis)``); ``region`` is its first piece.
    """

    name: str
    sample_shape: tuple[int, ...]
    region: tuple[slice, ...]
    interior: tuple[slice, ...]
    placements: tuple[tuple[str, int | None], ...]
    pieces: tuple[tuple[slice, ...], ...] = ()
    balanced: tuple[str, int] | None = None

    @property
    def regions(self) -> tuple[tuple[slice, ...], ...]:
        """The regions of the full sample that are read, in the order they are joined."""
        return self.pieces or (self.region,)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the loaded part of one sample (halo included)."""
        shape = [s.stop - s.start for s in self.region]
        if self.balanced is not None:
            axis = self.balanced[1]
            shape[axis] = sum(r[axis].stop - r[axis].start for r in self.pieces)
        return tuple(shape)

    def positions(self) -> torch.Tensor | None:
        """Global indices (int64) along the balanced axis of the cells this part holds, in order; else ``None``."""
        if self.balanced is None:
            return None
        axis = self.balanced[1]
        return torch.cat([torch.arange(r[axis].start, r[axis].stop) for r in self.pieces])

    @property
    def interior_shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.interior)

    @property
    def has_halo(self) -> bool:
        return self.interior_shape != self.shape

    def strip_halo(self, batch_field: torch.Tensor) -> torch.Tensor:
        """The interior of a batched part ``[B, *shape]`` (a view, no copy)."""
        if tuple(batch_field.shape[1:]) != self.shape:
            raise DataError(
                f"field {self.name!r}: expected a batch of parts of shape [B, {', '.join(map(str, self.shape))}], "
                f"got {list(batch_field.shape)}: pass the tensor the loader yielded for this field"
            )
        return batch_field[(slice(None), *self.interior)]


def _tile_lengths(n: int, parts: int) -> list[int]:
    return [b - a for a, b in (chunk_bounds(n, parts, i) for i in range(parts))]


def largest_halo(n: int, parts: int) -> int:
    """The largest halo allowed on ``n`` cells split ``parts`` ways: the smallest tile's length.

    ``meshwise.parallel.halo_exchange`` allows the same largest halo (every tile must hold ``>= halo`` cells).
    """
    return min(_tile_lengths(n, parts))


def _mesh_text(mesh: str) -> str:
    return f" (mesh dims: {mesh})" if mesh else ""


def _split_dim(name: str, shard: Shard, split: Mapping[str, tuple[int, int]], mesh: str) -> str:
    """The split dim a ``Shard`` names (or the only one); a ``DataError`` that lists the mesh's dims otherwise."""
    if not split:
        raise DataError(
            f"parts[{name!r}] shards axis {shard.axis}, but the mesh has no 'split' dim{_mesh_text(mesh)}: add one "
            "(e.g. {'dp': -1, 'cp': 2}), declare roles={'<dim>': 'split'} for the dim whose ranks hold parts of "
            "the same samples, or use Replicate()"
        )
    dim = shard.dim
    if dim is None:
        if len(split) > 1:
            raise DataError(
                f"parts[{name!r}]: the mesh has several split dims {tuple(split)}; say which one with "
                f"Shard({shard.axis}, dim=...) for each"
            )
        return next(iter(split))
    if dim not in split:
        raise DataError(
            f"parts[{name!r}]: Shard dim {dim!r} is not a split dim of the mesh "
            f"({mesh or 'split dims: ' + ', '.join(split)}): "
            f"name a split dim, or declare roles={{{dim!r}: 'split'}} if its ranks hold parts of the same samples"
        )
    return dim


def _check_tiles(name: str, shard: Shard, dim: str, axis: int, n: int, size: int) -> None:
    """Every rank along ``dim`` gets at least one cell and at least ``halo`` cells (same verdict on every rank)."""
    lengths = _tile_lengths(n, size)
    if min(lengths) == 0:
        fit = max(k for k in range(1, size + 1) if min(_tile_lengths(n, k)) > 0)
        raise DataError(
            f"parts[{name!r}]: axis {axis} has {n} cells split {size} ways over {dim!r}: tiles of {lengths} cells, "
            f"so some {dim!r} ranks would get zero cells; use at most {fit} {dim!r} ranks, a larger field, or "
            f"shard another axis"
        )
    if shard.halo > min(lengths):
        raise DataError(
            f"parts[{name!r}]: halo {shard.halo} > the smallest tile ({min(lengths)} of {n} cells on axis {axis} "
            f"split {size} ways over {dim!r}); the largest halo is {min(lengths)} (as for halo_exchange): use a "
            f"smaller halo or fewer {dim!r} ranks"
        )


def resolve_part(
    name: str,
    spec: Shard | Replicate | Sequence[Shard] | None,
    sample_shape: Sequence[int],
    split: Mapping[str, tuple[int, int]],
    mesh: str = "",
) -> FieldPart:
    """The part of field ``name`` that the rank at ``split`` (dim -> (coordinate, size)) loads.

    ``mesh`` (``topology.layout.dims_text()``) is quoted by errors about a missing split dim.
    """
    sample_shape = tuple(int(s) for s in sample_shape)
    full = tuple(slice(0, n) for n in sample_shape)
    if spec is None or isinstance(spec, Replicate):
        return FieldPart(name, sample_shape, full, full, tuple((d, None) for d in split))
    shards = [spec] if isinstance(spec, Shard) else list(spec)
    if not shards or not all(isinstance(s, Shard) for s in shards):
        raise DataError(
            f"parts[{name!r}] = {spec!r}: give Shard(axis, halo=...), Replicate(), "
            "or a list of Shard (one per split dim)"
        )
    region = list(full)
    interior = list(full)
    placements = dict.fromkeys(split)
    balanced = None
    for shard in shards:
        dim = _split_dim(name, shard, split, mesh)
        if placements[dim] is not None:
            raise DataError(f"parts[{name!r}] shards over split dim {dim!r} twice: give one Shard per split dim")
        ndim = len(sample_shape)
        axis = shard.axis + ndim if shard.axis < 0 else shard.axis
        if not 0 <= axis < ndim:
            raise DataError(
                f"parts[{name!r}]: Shard axis {shard.axis} is out of range for samples of shape {list(sample_shape)} "
                f"({ndim} axes; axis 0 is the first axis after the sample axis)"
            )
        if any(a == axis for a in placements.values()):
            raise DataError(f"parts[{name!r}] shards sample axis {axis} over two split dims: use one dim per axis")
        coord, size = split[dim]
        n = sample_shape[axis]
        if shard.balanced:
            if balanced is not None:
                raise DataError(f"parts[{name!r}]: give balanced=True to one Shard of a field, not several")
            try:
                bounds = balanced_bounds(n, size, coord)
            except DataError as exc:
                raise DataError(f"parts[{name!r}], axis {axis} over {dim!r}: {exc}") from None
            balanced = (dim, axis, bounds)
            placements[dim] = axis
            continue
        _check_tiles(name, shard, dim, axis, n, size)
        start, stop = chunk_bounds(n, size, coord)
        lo, hi = max(0, start - shard.halo), min(n, stop + shard.halo)
        region[axis] = slice(lo, hi)
        interior[axis] = slice(start - lo, stop - lo)
        placements[dim] = axis
    if balanced is None:
        return FieldPart(name, sample_shape, tuple(region), tuple(interior), tuple(placements.items()))
    dim, axis, bounds = balanced
    pieces = tuple(tuple(slice(a, b) if i == axis else r for i, r in enumerate(region)) for a, b in bounds)
    interior[axis] = slice(0, sum(b - a for a, b in bounds))
    return FieldPart(name, sample_shape, pieces[0], tuple(interior), tuple(placements.items()), pieces, (dim, axis))


PartSpec = Shard | Replicate | Sequence[Shard]


def from_placements(
    mesh: Any, placements: Sequence[Any], topology: Topology | None = None, *, halo: int | Mapping[str, int] = 0
) -> list[Shard] | Replicate:
    """Sample parts from the DTensor placements of a batched input ``[B, *sample]`` over ``mesh``.

    ``mesh`` is a DeviceMesh with dim names or a sequence of names of the topology's dims, one per placement.
    ``Shard(d)`` on a ``split`` dim becomes ``Shard(d - 1, dim=...)`` (tensor axis 0 is the batch); on a
    ``batch`` dim only ``Shard(0)`` agrees with the sampler; ``Replicate()`` is allowed on ``split``,
    ``replica`` and ``stage`` dims. ``halo`` (an int, or dim -> int) is added to each ``Shard``: the cells the
    model's first layer needs from the neighbours. The tiles equal ``distribute_tensor(batch, mesh,
    placements).to_local()``, uneven splits included.
    """
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    topology = resolve(topology)
    names = mesh if isinstance(mesh, (list, tuple, str)) else getattr(mesh, "mesh_dim_names", None)
    names = (names,) if isinstance(names, str) else tuple(names or ())
    placements = tuple(placements)
    mesh_text = topology.layout.dims_text()
    if not names or len(names) != len(placements):
        raise DataError(
            f"from_placements: {len(placements)} placements for mesh dims {names or 'with no names'}: give one "
            f"placement per named mesh dim (mesh dims: {mesh_text})"
        )
    shards = []
    for dim, p in zip(names, placements):
        role = topology.roles.get(dim)
        where = f"placement {type(p).__name__} ({p}) on mesh dim {dim!r}"
        if role is None:
            raise DataError(f"from_placements: {where}: the topology has no dim {dim!r} (mesh dims: {mesh_text})")
        if type(p) is DReplicate and role != "batch":
            continue
        if type(p) is not DShard:
            raise DataError(
                f"from_placements: {where} (role {role!r}): an input is given as Shard(d) on split dims, Shard(0) on "
                f"batch dims, Replicate() elsewhere (mesh dims: {mesh_text})"
            )
        if role == "batch":
            if p.dim != 0:
                raise DataError(
                    f"from_placements: {where} (role 'batch'): batch dims give ranks different samples, so only "
                    f"Shard(0) fits; to split cells declare roles={{{dim!r}: 'split'}} (mesh dims: {mesh_text})"
                )
            continue
        if role != "split":
            raise DataError(
                f"from_placements: {where} has role {role!r}: its ranks read the same samples whole, so a Shard on "
                f"it would leave every tile wrong; if its ranks hold parts of the same samples, declare "
                f"roles={{{dim!r}: 'split'}} (mesh dims: {mesh_text})"
            )
        if p.dim == 0:
            raise DataError(
                f"from_placements: {where}: tensor axis 0 is the batch, which the sampler splits over batch dims; "
                f"shard a sample axis (Shard(d) with d >= 1)"
            )
        h = halo.get(dim, 0) if isinstance(halo, Mapping) else halo
        shards.append(Shard(p.dim - 1 if p.dim > 0 else p.dim, halo=h, dim=dim))
    return shards or Replicate()


def parts_of(model: Any, topology: Topology | None = None) -> dict[str, PartSpec]:
    """The sample parts a model asks for: its ``input_parts`` (an attribute, property or method with no argument).

    ``input_parts`` maps field -> ``Shard``/``Replicate``/list of ``Shard``, or ``(mesh, placements)`` /
    ``(mesh, placements, halo)`` DTensor placements (see :func:`from_placements`). Wrappers that keep the model
    in ``.module`` (DDP) or ``._orig_mod`` (``torch.compile``) are looked through.
    """
    inner = model
    while not hasattr(inner, "input_parts") and (hasattr(inner, "module") or hasattr(inner, compat.COMPILED_INNER)):
        inner = getattr(inner, "module", None) or getattr(inner, compat.COMPILED_INNER)
    spec = getattr(inner, "input_parts", None)
    if spec is None:
        raise DataError(
            f"{type(model).__name__} states no input_parts: give the model an attribute or property input_parts = "
            "{field: Shard(axis, halo=...) | Replicate() | (mesh, placements)}, or pass parts={...} to the loader"
        )
    return as_parts(spec() if callable(spec) else spec, topology)


def as_parts(parts: Any, topology: Topology | None = None) -> dict[str, PartSpec]:
    """``parts`` as given to ``mesh_dataloader`` (a mapping, or a model with ``input_parts``) as meshwise specs."""
    if parts is None:
        return {}
    if not isinstance(parts, Mapping):
        return parts_of(parts, topology)
    out: dict[str, PartSpec] = {}
    for name, spec in parts.items():
        if isinstance(spec, tuple) and len(spec) in (2, 3) and not isinstance(spec[0], Shard):
            spec = from_placements(spec[0], spec[1], topology, halo=spec[2] if len(spec) == 3 else 0)
        out[name] = spec
    return out


def as_dtensor(batch_field: torch.Tensor, part: FieldPart, topology, strip_halo: bool = True):
    """Wrap a loaded batch part ``[B, *part.shape]`` as a DTensor over the split dims, without communication.

    The mesh is ``topology.mesh[split dims]``; placements are ``Shard(axis + 1)`` on the dims that split the
    field and ``Replicate()`` elsewhere. The halo is stripped first (a DTensor has no overlap), so the global
    shape is ``[B, *sample_shape]`` and uneven parts are declared through ``from_local``'s ``shape``/``stride``.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    if part.balanced is not None:
        raise DataError(
            f"field {part.name!r} is a balanced part (two chunks of axis {part.balanced[1]}): a DTensor Shard "
            "holds one contiguous chunk a rank; use the part as it is, with batch['positions']"
        )
    if not strip_halo and part.has_halo:
        raise DataError(
            f"field {part.name!r} carries a halo; a DTensor cannot hold overlapping parts: use strip_halo=True"
        )
    local = part.strip_halo(batch_field) if part.has_halo else batch_field
    dims = tuple(d for d, _ in part.placements)
    if not dims:
        raise DataError(
            f"as_dtensor needs a mesh with a 'split' dim; this one has none ({topology.layout.dims_text()}): "
            "declare roles={'<dim>': 'split'} for the dim whose ranks hold parts of the same samples"
        )
    mesh = topology.mesh[dims] if len(dims) > 1 else topology.mesh[dims[0]]
    placements = [DReplicate() if a is None else DShard(a + 1) for _, a in part.placements]
    shape = (batch_field.shape[0], *part.sample_shape)
    stride = _contiguous_stride(shape)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))
