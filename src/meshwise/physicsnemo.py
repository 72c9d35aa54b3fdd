"""PhysicsNeMo interop: adopt DistributedManager's mesh as the topology and convert loaded tiles to/from ShardTensor.

Each call checked, never assumed (docs/physicsnemo.md):

* :func:`initialize_manager` starts ``DistributedManager`` on CPU too (its own ``initialize()`` passes
  ``device_id=cpu`` to ``init_process_group``, which torch rejects with a ``ValueError`` it does not catch);
* :func:`adopt` makes the manager's ``global_mesh`` the meshwise topology (or, when meshwise came first, gives
  the topology's mesh to the manager), so both name the same ranks and groups;
* :func:`to_shard_tensor` / :func:`from_shard_tensor` turn a tile read by ``mesh_dataloader`` with ``Shard``
  parts (uneven, halo stripped) into a ``ShardTensor`` with explicit uneven ``sharding_shapes``, and back,
  without communication;
* :func:`require_shard_ops` refuses to go on when PhysicsNeMo's ShardTensor op patches are off (CPU), where a
  conv on a ShardTensor would silently skip the halo; :func:`register_shard_ops` registers them, on CPU too, with
  exact mean losses (``F.mse_loss``, ...) on uneven ShardTensors;
* :func:`share_gradients` (called by ``parallelize`` through its hook) turns PhysicsNeMo's gradient sums over the
  split dims into this rank's share, so its ShardTensor route and meshwise's halo route train like one process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshwise import compat
from meshwise.data.parts import FieldPart, chunk_bounds
from meshwise.errors import DataError, ParallelError, TopologyError, import_extra
from meshwise.topology import Topology, current, init

__all__ = [
    "adopt",
    "from_shard_tensor",
    "initialize_manager",
    "register_shard_ops",
    "require_shard_ops",
    "share_gradients",
    "share_reductions",
    "to_shard_tensor",
]


def _manager_class() -> Any:
    return import_extra(
        "physicsnemo.distributed",
        "meshwise.physicsnemo",
        "pip install --no-deps nvidia-physicsnemo and pip install 'meshwise[physicsnemo]' (docs/physicsnemo.md)",
    ).DistributedManager


def initialize_manager(*, backend: str | None = None) -> Any:
    """Start (or return) PhysicsNeMo's ``DistributedManager``; works on CPU where its ``initialize()`` fails.

    With CUDA and no process group yet, this is ``DistributedManager.initialize()`` itself. Otherwise the
    process group is joined first (``env://``, ``backend`` default gloo on CPU), or the one that exists
    (e.g. made by ``meshwise.init()``) is used, and the manager's state is filled as its ``setup()`` would,
    minus the second ``init_process_group`` call that would fail.
    """
    manager_cls = _manager_class()
    if manager_cls.is_initialized():
        return manager_cls()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not dist.is_initialized() and (torch.cuda.is_available() or not launched):
        # CUDA: device_id is a CUDA device, which torch accepts. No launcher: PhysicsNeMo's single-process path.
        manager_cls.initialize()
        return manager_cls()
    if not dist.is_initialized():
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(chosen, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if cuda else "cpu")
    manager = compat.set_manager_process(manager_cls, rank, world, local_rank, device)
    import numpy as np

    np.random.seed(seed=rank)  # what DistributedManager.initialize() does after setup
    return manager


def _manager_mesh(manager: Any) -> Any:
    # _global_mesh, not global_mesh: the property would build a flat ("world",) mesh when none exists
    return compat.manager_global_mesh(manager)


def _mesh_sizes(device_mesh: Any) -> dict[str, int]:
    return dict(zip(device_mesh.mesh_dim_names or (), device_mesh.mesh.shape))


def adopt(
    manager: Any = None,
    *,
    roles: Mapping[str, str] | str | None = None,
    mesh: Mapping[str, int] | None = None,
    **init_kwargs: Any,
) -> Topology:
    """The meshwise topology over PhysicsNeMo's ``global_mesh``: same dims, sizes, ranks and groups.

    ``roles`` names the role of dims without a default: ``model_parallel`` (PhysicsNeMo's domain parallel)
    is ``"split"``. ``mesh`` (dim -> size, ``-1`` allowed once) is what the program expects: without a manager
    mesh it is built with ``manager.initialize_mesh``; with one, the sizes must agree. When ``meshwise.init()``
    already ran, its mesh is given to the manager (or checked against the manager's) and the topology is
    returned. ``init_kwargs`` (timeout, debug, ...) go to :func:`meshwise.init`.
    """
    manager_cls = _manager_class()
    if manager is None:
        if not manager_cls.is_initialized():
            raise TopologyError(
                "DistributedManager is not initialised: call meshwise.physicsnemo.initialize_manager() first "
                "(DistributedManager.initialize() fails on CPU; see docs/physicsnemo.md)"
            )
        manager = manager_cls()
    own = _manager_mesh(manager)
    topology = current()
    if topology is not None:
        _register_losses()
        return _give_mesh(manager, topology, own, mesh)
    if own is None:
        if mesh is None:
            raise TopologyError(
                "DistributedManager has no mesh yet: call manager.initialize_mesh((-1, 2), ('data_parallel', "
                "'model_parallel')) first, or pass adopt(mesh={'data_parallel': -1, 'model_parallel': 2})"
            )
        own = manager.initialize_mesh(tuple(mesh.values()), tuple(mesh))
    elif mesh is not None:
        _check_sizes(_mesh_sizes(own), dict(mesh), "the DistributedManager's global_mesh")
    try:
        topology = init(mesh=own, roles=roles, **init_kwargs)
    except TopologyError as exc:
        if "no default role" not in str(exc):
            raise
        hint = "With PhysicsNeMo (model_parallel = domain parallel): meshwise.physicsnemo.adopt(roles=ROLES)"
        raise TopologyError(f"{exc}. {hint.replace('ROLES', repr({'model_parallel': 'split'}))}") from None
    _check_agreement(manager, topology, own)
    _register_losses()  # F.mse_loss & co. on uneven ShardTensors: exact, whoever registered PhysicsNeMo's ops
    return topology


def _check_sizes(theirs: dict[str, int], wanted: dict[str, int], what: str) -> None:
    names_ok = list(theirs) == list(wanted)
    sizes_ok = names_ok and all(w in (-1, theirs[d]) for d, w in wanted.items())
    if not sizes_ok:
        raise TopologyError(
            f"{what} is {theirs} but mesh={wanted} was asked for: make the two agree (the same dims in the same "
            "order and sizes; -1 takes the rest), or drop mesh= to take the manager's as it is"
        )


def _give_mesh(manager: Any, topology: Topology, own: Any, mesh: Mapping[str, int] | None) -> Topology:
    """meshwise.init() came first: the manager gets the topology's mesh, or its own must be the same one."""
    sizes = topology.sizes
    if mesh is not None:
        _check_sizes(dict(sizes), dict(mesh), "the meshwise topology's mesh")
    if own is None:
        compat.set_manager_mesh(manager, topology.mesh, dict(sizes))
    else:
        _check_sizes(dict(sizes), _mesh_sizes(own), "the meshwise topology's mesh")
        if own.mesh.tolist() != topology.mesh.mesh.tolist():
            raise TopologyError(
                f"the DistributedManager's mesh places ranks {own.mesh.tolist()} but meshwise's places "
                f"{topology.mesh.mesh.tolist()}: build one mesh and adopt it (see docs/physicsnemo.md)"
            )
    _check_agreement(manager, topology, _manager_mesh(manager))
    return topology


def _check_agreement(manager: Any, topology: Topology, device_mesh: Any) -> None:
    """Rank, coordinates and group members of each dim: PhysicsNeMo's view equals meshwise's."""
    if manager.rank != topology.rank or manager.world_size != topology.world_size:
        raise TopologyError(
            f"DistributedManager says rank {manager.rank} of {manager.world_size} but meshwise says "
            f"{topology.rank} of {topology.world_size}: start both from the same launcher and process group"
        )
    for dim in device_mesh.mesh_dim_names:
        theirs = dist.get_process_group_ranks(device_mesh.get_group(dim))
        if device_mesh.get_local_rank(dim) != topology.coordinate(dim) or theirs != topology.group_ranks(dim):
            raise TopologyError(
                f"mesh dim {dim!r}: PhysicsNeMo's group is {theirs} but meshwise's is "
                f"{topology.group_ranks(dim)}: adopt the manager's mesh instead of building a second one"
            )


def _part_of(loader_or_part: Any, name: str | None) -> FieldPart:
    if isinstance(loader_or_part, FieldPart):
        return loader_or_part
    parts = getattr(loader_or_part, "parts", None)
    if not isinstance(parts, Mapping):
        raise DataError(
            f"expected a MeshDataLoader or a FieldPart, got {type(loader_or_part).__name__}: pass the loader "
            "that read the batch (with name=) or loader.parts[name]"
        )
    if name not in parts:
        raise DataError(f"name={name!r} is not a field of this loader ({sorted(parts)}): pass name='<field>'")
    return parts[name]


def _layout(part: FieldPart, topology: Topology, batch: int) -> tuple[Any, list[Any], dict[int, list[tuple]], tuple]:
    """Mesh, placements, sharding_shapes and global shape of the ShardTensor of ``part`` (no communication)."""
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    if part.balanced is not None:
        raise DataError(
            f"field {part.name!r} is a balanced part (two chunks of axis {part.balanced[1]}): a ShardTensor "
            "holds one contiguous chunk a rank; use Shard(axis) without balanced=True"
        )
    dims = tuple(d for d, _ in part.placements)
    if not dims or all(a is None for _, a in part.placements):
        raise DataError(
            f"field {part.name!r} is not split over any dim ({topology.layout.dims_text()}): read it with "
            "parts={name: Shard(axis)} on a mesh with a 'split' dim (e.g. roles={'model_parallel': 'split'})"
        )
    mesh = topology.mesh[dims] if len(dims) > 1 else topology.mesh[dims[0]]
    placements = [DReplicate() if a is None else DShard(a + 1) for _, a in part.placements]
    global_shape = (batch, *part.sample_shape)
    mine = [batch, *part.interior_shape]
    shapes: dict[int, list[tuple]] = {}
    for m, (dim, axis) in enumerate(part.placements):
        if axis is None:
            continue
        n, k = part.sample_shape[axis], topology.size(dim)
        rows = []
        for c in range(k):  # rank c along this mesh dim, this rank's coordinates on the others (PhysicsNeMo's rule)
            lo, hi = chunk_bounds(n, k, c)
            shape = list(mine)
            shape[axis + 1] = hi - lo
            rows.append(tuple(shape))
        shapes[m] = rows
    return mesh, placements, shapes, global_shape


def to_shard_tensor(
    batch_field: torch.Tensor, loader_or_part: Any, topology: Topology | None = None, *, name: str | None = None
) -> Any:
    """A loaded batch tile ``[B, *part.shape]`` as a ``ShardTensor`` over the split dims; no communication.

    The halo is stripped (a ShardTensor has no overlap); placements are ``Shard(axis + 1)`` on the dims that
    split the field, ``Replicate()`` elsewhere; ``sharding_shapes`` are given explicitly, uneven tiles included,
    so PhysicsNeMo never gathers shapes. ``loader_or_part`` is the loader (with ``name=``) or its ``FieldPart``.
    """
    from physicsnemo.domain_parallel import ShardTensor

    topology = topology if topology is not None else _current_or_error()
    part = _part_of(loader_or_part, name)
    local = part.strip_halo(batch_field) if part.has_halo else batch_field
    if tuple(local.shape[1:]) != part.interior_shape:
        raise DataError(
            f"field {part.name!r}: expected a batch of tiles [B, {', '.join(map(str, part.shape))}], got "
            f"{list(batch_field.shape)}: pass the tensor the loader yielded for this field"
        )
    mesh, placements, shapes, _ = _layout(part, topology, local.shape[0])
    _register_losses()
    return ShardTensor.from_local(local, mesh, placements, sharding_shapes=shapes)


def from_shard_tensor(
    shard_tensor: Any, loader_or_part: Any, topology: Topology | None = None, *, name: str | None = None
) -> torch.Tensor:
    """This rank's tile (halo stripped) of a ``ShardTensor``, checked against the loader's part; no communication.

    The ShardTensor must sit on the part's split mesh with its placements, global shape and sharding shapes;
    redistribute it first otherwise. Add the halo again with ``meshwise.parallel.halo_exchange``.
    """
    topology = topology if topology is not None else _current_or_error()
    part = _part_of(loader_or_part, name)
    spec = compat.shard_spec(shard_tensor)
    if spec is None or not hasattr(spec, "sharding_shapes"):
        raise DataError(
            f"expected a ShardTensor, got {type(shard_tensor).__name__}: build it with to_shard_tensor(...)"
        )
    batch = shard_tensor.shape[0]
    mesh, placements, shapes, global_shape = _layout(part, topology, batch)
    problems = []
    if shard_tensor.device_mesh.mesh.tolist() != mesh.mesh.tolist():
        problems.append(f"mesh ranks {shard_tensor.device_mesh.mesh.tolist()} != {mesh.mesh.tolist()}")
    if tuple(shard_tensor.placements) != tuple(placements):
        problems.append(f"placements {tuple(shard_tensor.placements)} != {tuple(placements)}")
    if tuple(shard_tensor.shape) != global_shape:
        problems.append(f"global shape {tuple(shard_tensor.shape)} != {global_shape}")
    theirs = compat.stored_sharding_shapes(spec)  # read as stored: sharding_shapes() would gather missing ones
    if not problems and theirs is not None:
        theirs = {m: [tuple(s) for s in v] for m, v in theirs.items()}
        if theirs != shapes:
            problems.append(f"sharding_shapes {theirs} != {shapes}")
    local = shard_tensor.to_local()
    if not problems and tuple(local.shape) != shapes[min(shapes)][topology.coordinate(part.placements[min(shapes)][0])]:
        problems.append(f"local shape {tuple(local.shape)} is not this rank's tile")
    if problems:
        raise DataError(
            f"ShardTensor does not match the tiles of field {part.name!r}: {'; '.join(problems)}: redistribute it "
            f"to placements {tuple(placements)} on the split mesh {mesh.mesh_dim_names} with the loader's "
            "chunk-like tiles (or build it with to_shard_tensor)"
        )
    return local


def _current_or_error() -> Topology:
    topology = current()
    if topology is None:
        raise TopologyError("no meshwise topology: call meshwise.physicsnemo.adopt(...) first, or pass topology=")
    return topology


def require_shard_ops() -> None:
    """Raise unless PhysicsNeMo's ShardTensor op patches (halo conv, ...) are registered in this process.

    ``physicsnemo.domain_parallel`` registers them at import only when CUDA is available. Without them a conv
    on a ``ShardTensor`` runs DTensor's default rule: no halo and ``Replicate`` placements over the local tile,
    a silently wrong result (docs/physicsnemo.md). Call this before computing on ShardTensors.
    """
    import torch.nn.functional as F

    if F.conv2d not in compat.shard_function_registry():
        raise ParallelError(
            "PhysicsNeMo's ShardTensor op patches are not registered (it registers them only when CUDA is "
            "available): a conv on a ShardTensor would skip the halo and return wrong values. Call "
            "meshwise.physicsnemo.register_shard_ops() first (PhysicsNeMo's register_custom_ops(), which on a CPU "
            "build of torch stops at timm), or compute on the local tiles with meshwise.parallel.halo_exchange"
        )


# --------------------------------------------------------------------------- PhysicsNeMo's ops, exact losses

# Losses whose reduction="none" result has the input's shape: made exact on ShardTensors (a sum over every
# cell of the group divided by the global count). PhysicsNeMo's own dispatch averages the tiles' means.
_ELEMENTWISE_LOSSES = (
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
)
# Losses with a class dim, weights or ignored targets: their mean is not a plain cell mean; refused on ShardTensors.
_REFUSED_LOSSES = ("cross_entropy", "nll_loss", "kl_div", "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss")
_EXACT_FORM = (
    "compute it as ((o - t) ** 2).mean() on the ShardTensors (exact over uneven tiles), or on this rank's tiles "
    "(o.to_local()) with reduction='none', summed and divided by the global count; for a metric use "
    "meshwise.metrics.MeshMetric on the tiles"
)


def register_shard_ops() -> list[str]:
    """Register PhysicsNeMo's ShardTensor op patches (also on CPU) and meshwise's exact mean losses.

    First ``physicsnemo.domain_parallel.register_custom_ops()``. Where it stops at an import (on a CPU build of
    torch its kNN patch needs ``physicsnemo.nn`` -> timm -> torchvision, which cannot load: docs/physicsnemo.md),
    each of PhysicsNeMo's patch modules is imported on its own, which registers its ops as
    ``register_custom_ops()`` would; the ones that cannot load are returned (``"knn (...)"``). Then
    ``F.mse_loss``, ``F.l1_loss``, ``F.smooth_l1_loss``, ``F.huber_loss`` and the two binary cross entropies on
    ShardTensors compute the exact mean over every cell (PhysicsNeMo's dispatch averages the tiles' means,
    wrong for uneven tiles), and ``F.cross_entropy``, ``F.nll_loss``, ``F.kl_div``, ... raise ``ParallelError``.
    """
    import importlib
    import pkgutil

    from physicsnemo.domain_parallel import register_custom_ops

    skipped: list[str] = []
    try:
        register_custom_ops()
    except ImportError:
        from physicsnemo.domain_parallel import shard_utils

        names = ["physicsnemo.domain_parallel.custom_ops"]
        names += [f"{shard_utils.__name__}.{m.name}" for m in pkgutil.iter_modules(shard_utils.__path__)]
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                skipped.append(f"{name.rsplit('.', 1)[-1]} ({exc})")
    _register_losses()
    try:
        require_shard_ops()
    except ParallelError:
        raise ParallelError(
            f"PhysicsNeMo's ShardTensor patches did not load ({'; '.join(skipped)}): pip install "
            "'meshwise[physicsnemo]' (termcolor, nvtx, omegaconf, ...; see docs/physicsnemo.md)"
        ) from None
    return skipped


_LOSSES_REGISTERED = []


def _register_losses() -> None:
    """meshwise's loss handlers on ShardTensor, once a process (also from adopt and to_shard_tensor)."""
    import torch.nn.functional as F
    from physicsnemo.domain_parallel import ShardTensor

    if _LOSSES_REGISTERED:
        return
    _LOSSES_REGISTERED.append(True)
    for name in _ELEMENTWISE_LOSSES:
        ShardTensor.register_function_handler(getattr(F, name), _exact_loss)
    for name in _REFUSED_LOSSES:
        ShardTensor.register_function_handler(getattr(F, name), _refused_loss)


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    import inspect

    bound = inspect.signature(func).bind(*args, **(kwargs or {}))
    return dict(bound.arguments)


def _exact_loss(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """``func(input, target, reduction=...)`` on ShardTensors: per cell on each tile, then an exact global reduction."""
    import math

    from physicsnemo.domain_parallel import ShardTensor

    bound = _bind(func, args, kwargs)
    name = func.__name__
    x, t = bound.pop("input"), bound.pop("target")
    if bound.pop("size_average", None) is not None or bound.pop("reduce", None) is not None:
        raise ParallelError(f"F.{name} on ShardTensors: pass reduction= instead of the deprecated size_average/reduce")
    reduction = bound.pop("reduction", "mean")
    spec_x, spec_t = compat.shard_spec(x), compat.shard_spec(t)
    if not (isinstance(x, ShardTensor) and isinstance(t, ShardTensor)):
        raise ParallelError(
            f"F.{name} got a {type(x).__name__} and a {type(t).__name__}: a ShardTensor holds the whole field and a "
            "plain tensor only this rank's tile, so the mean would mix them. Pass both as ShardTensors "
            "(meshwise.physicsnemo.to_shard_tensor), or both as this rank's tiles (output.to_local()); under "
            "create_trainer return output.to_local() from forward= (docs/physicsnemo.md)"
        )
    shapes_x = compat.stored_sharding_shapes(spec_x)
    if (
        tuple(x.placements) != tuple(t.placements)
        or tuple(x.shape) != tuple(t.shape)
        or shapes_x != (compat.stored_sharding_shapes(spec_t))
    ):
        raise ParallelError(
            f"F.{name} on ShardTensors with different shapes or shardings ({tuple(x.shape)} {tuple(x.placements)} "
            f"vs {tuple(t.shape)} {tuple(t.placements)}): redistribute the target like the output"
        )
    local = func(x.to_local(), t.to_local(), reduction="none", **bound)
    per_cell = ShardTensor.from_local(local, x.device_mesh, x.placements, sharding_shapes=shapes_x)
    if reduction == "none":
        return per_cell
    total = per_cell.sum()
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise ParallelError(f"F.{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return total / math.prod(x.shape)  # the global count, a Python number: no float32 factor in backward


def _refused_loss(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    raise ParallelError(
        f"F.{func.__name__} on ShardTensors: PhysicsNeMo's dispatch averages each tile's mean, which is not the mean "
        f"over the field when tiles (or their ignored targets) differ in size: {_EXACT_FORM}"
    )


# --------------------------------------------------------------------------- gradients of the split dims

_SHARED = "meshwise_share"  # marks a PhysicsNeMo reduction node already turned into a mean


def share_gradients(model: nn.Module, topology: Topology | None = None) -> nn.Module:
    """Make every gradient a split rank computes for ``model`` its own share, as meshwise's data parallel expects.

    PhysicsNeMo's ShardTensor ops (conv, linear, attention, ...) sum a replicated tensor's gradient over the
    mesh dims its input is sharded on (``GradReducer``), so every ``model_parallel`` rank holds the whole sum;
    meshwise's halo route leaves each rank its part, and meshwise's data parallel (``parallelize``: mean over
    the batch *and* split dims, the trainer scaling by their size) adds the parts. Reduced again, PhysicsNeMo's
    sums count each part once per split rank (5.6e-2 off at model_parallel=2, 1.6 at 4). After each forward
    this walks the output's autograd graph and turns each such sum into a mean over the same ranks; the data
    parallel mean then gives the sum once, for any mix of the two routes in one model, even in one parameter.
    ``parallelize`` calls it on a mesh with a split dim; call it yourself for a loop that all-reduces the
    gradients over the world (sum) with a loss over the global count. Not for PhysicsNeMo's own recipe
    (DDP over data_parallel only), which relies on the sums. Refuses ShardTensor parameters (``ParallelError``).
    Returns ``model``.
    """
    from meshwise.topology import resolve

    topology = resolve(topology)
    _refuse_sharded_parameters(model)
    if not getattr(model, _SHARED, False):

        def after_forward(module: nn.Module, args: Any, output: Any) -> None:  # None: the output is kept
            share_reductions(output, topology)

        model.register_forward_hook(after_forward)
        setattr(model, _SHARED, True)
    return model


def _refuse_sharded_parameters(model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if compat.shard_spec(p) is not None and not isinstance(p, DTensor):
            raise ParallelError(
                f"parameter {name!r} is a ShardTensor: meshwise's data parallel needs plain parameters, the same on "
                "every rank (PhysicsNeMo's own hybrid recipe keeps weights plain: sync_module_over_mesh). Build the "
                "model with plain tensors and give it ShardTensor inputs"
            )


def share_reductions(output: Any, topology: Topology) -> int:
    """Turn PhysicsNeMo's gradient sums in ``output``'s autograd graph into means; how many were found.

    A node of PhysicsNeMo's ``GradReducer`` carries the spec of the sharded tensor (``ref_spec``) whose mesh
    dims it sums over; each must be a split dim of ``topology`` with the same ranks, else ``ParallelError``.
    """
    stack = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen: set[int] = set()
    found = 0
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        spec = getattr(node, "ref_spec", None)
        if spec is not None and type(node).__name__ == "GradReducerBackward":
            found += 1
            if not getattr(node, _SHARED, False):
                node.register_hook(_mean_over(_reduced_size(spec, topology)))
                setattr(node, _SHARED, True)
        stack.extend(n for n, _ in node.next_functions)
    return found


def _mean_over(size: int) -> Any:
    def hook(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        return tuple(None if g is None else g / size for g in grad_inputs)

    return hook


def _reduced_size(spec: Any, topology: Topology) -> int:
    mesh, size = spec.mesh, 1
    names = mesh.mesh_dim_names or ()
    for i, placement in enumerate(spec.placements):
        if not placement.is_shard():
            continue
        name = names[i] if i < len(names) else f"#{i}"
        ranks = dist.get_process_group_ranks(mesh.get_group(i))
        if name not in topology.split_dims or ranks != topology.group_ranks(name):
            raise ParallelError(
                f"a PhysicsNeMo op sums gradients over mesh dim {name!r} (ranks {ranks}), which is not a split dim "
                f"of the meshwise topology ({topology.layout.dims_text()}): shard ShardTensors only over the split "
                "dims of the adopted mesh (topology.mesh['model_parallel']), so meshwise's data parallel can add "
                "the shares"
            )
        size *= mesh.size(i)
    return size


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _on_parallelize(model: nn.Module, topology: Topology) -> None:
    if topology.split_dims and topology.size(topology.split_dims) > 1:
        share_gradients(model, topology)


def _register_hooks() -> None:
    from meshwise.parallel.placement import on_parallelize

    on_parallelize(_on_parallelize)


_register_hooks()
