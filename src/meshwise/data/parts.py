"""Sample parts: which region of each sample a rank loads along the topology's ``split`` dims (``Shard``/``Replicate``).

Parts split like DTensor's ``Shard`` (``torch.chunk``: ``ceil(n / k)`` cells a part, the last parts shorter
or empty). A halo adds up to ``halo`` neighbour cells at each *interior* edge; there are no halo cells beyond
the global border, so the first and last parts are shorter than the interior ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from meshwise.errors import DataError

__all__ = ["FieldPart", "Replicate", "Shard", "as_dtensor", "chunk_bounds", "resolve_part"]


@dataclass(frozen=True)
class Shard:
    """Split axis ``axis`` of each sample (0 = first axis after the sample axis) over a ``split`` dim.

    ``halo`` neighbour cells are added at each interior edge. ``dim`` names the split dim; it may be left out
    when the topology has exactly one split dim. Give a list of ``Shard`` to split a field over several dims.
    """

    axis: int
    halo: int = 0
    dim: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise DataError(f"Shard axis must be an int, got {self.axis!r}")
        if isinstance(self.halo, bool) or not isinstance(self.halo, int) or self.halo < 0:
            raise DataError(f"Shard halo must be an int >= 0, got {self.halo!r}")


@dataclass(frozen=True)
class Replicate:
    """Every split rank loads the whole sample of this field (the default for fields not named in ``parts``)."""


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``n`` cells split into ``parts`` like ``torch.chunk``/DTensor."""
    size = math.ceil(n / parts) if n else 0
    start = min(index * size, n)
    return start, min(start + size, n)


@dataclass(frozen=True)
class FieldPart:
    """Where one field's loaded part sits: per sample axis, the global region read and the interior inside it.

    ``region[a]`` is the slice of the full sample read (halo included); ``interior[a]`` is the slice of the
    loaded part that this rank owns (halo excluded); ``placements`` maps each split dim to the sample axis it
    shards (or ``None``: replicated).
    """

    name: str
    sample_shape: tuple[int, ...]
    region: tuple[slice, ...]
    interior: tuple[slice, ...]
    placements: tuple[tuple[str, int | None], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the loaded part of one sample (halo included)."""
        return tuple(s.stop - s.start for s in self.region)

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


def resolve_part(
    name: str,
    spec: Shard | Replicate | Sequence[Shard] | None,
    sample_shape: Sequence[int],
    split: Mapping[str, tuple[int, int]],
) -> FieldPart:
    """The part of field ``name`` that the rank at ``split`` (dim -> (coordinate, size)) loads."""
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
    if not split:
        raise DataError(
            f"parts[{name!r}] shards axis {shards[0].axis}, but the mesh has no 'split' dim: add one "
            "(e.g. {'dp': -1, 'cp': 2}, or roles={'x': 'split'}) or use Replicate()"
        )
    region = list(full)
    interior = list(full)
    placements = dict.fromkeys(split)
    for shard in shards:
        dim = shard.dim
        if dim is None:
            if len(split) > 1:
                raise DataError(
                    f"parts[{name!r}]: the mesh has several split dims {tuple(split)}; say which one with "
                    f"Shard({shard.axis}, dim=...) for each"
                )
            dim = next(iter(split))
        if dim not in split:
            raise DataError(f"parts[{name!r}]: Shard dim {dim!r} is not a split dim of the mesh {tuple(split)}")
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
        if shard.halo:
            smallest = min(b - a for a, b in (chunk_bounds(n, size, i) for i in range(size)))
            if shard.halo >= smallest:
                raise DataError(
                    f"parts[{name!r}]: halo {shard.halo} >= the smallest part ({smallest} of {n} cells on axis {axis} "
                    f"split {size} ways over {dim!r}): use a halo < {smallest} or fewer {dim!r} ranks"
                )
        start, stop = chunk_bounds(n, size, coord)
        lo, hi = max(0, start - shard.halo), min(n, stop + shard.halo)
        region[axis] = slice(lo, hi)
        interior[axis] = slice(start - lo, stop - lo)
        placements[dim] = axis
    return FieldPart(name, sample_shape, tuple(region), tuple(interior), tuple(placements.items()))


def as_dtensor(batch_field: torch.Tensor, part: FieldPart, topology, strip_halo: bool = True):
    """Wrap a loaded batch part ``[B, *part.shape]`` as a DTensor over the split dims, without communication.

    The mesh is ``topology.mesh[split dims]``; placements are ``Shard(axis + 1)`` on the dims that split the
    field and ``Replicate()`` elsewhere. The halo is stripped first (a DTensor has no overlap), so the global
    shape is ``[B, *sample_shape]`` and uneven parts are declared through ``from_local``'s ``shape``/``stride``.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    if not strip_halo and part.has_halo:
        raise DataError(
            f"field {part.name!r} carries a halo; a DTensor cannot hold overlapping parts: use strip_halo=True"
        )
    local = part.strip_halo(batch_field) if part.has_halo else batch_field
    dims = tuple(d for d, _ in part.placements)
    if not dims:
        raise DataError("as_dtensor needs a mesh with a 'split' dim; this topology has none")
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
