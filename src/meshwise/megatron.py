"""Megatron-core interop: adopt ``parallel_state``'s groups as the topology, and make meshwise's clipping and
checkpoints see Megatron's tensor-parallel parameters as the shards they are (docs/megatron.md).

* :func:`adopt` builds the topology from Megatron's own tp/cp/dp/pp groups (any ``order=``), roles tp → replica,
  cp → split, dp → batch, pp → stage; expert parallel is refused with the reason;
* :func:`tensor_parallel_shards` (registered with :func:`meshwise.parallel.clipping.on_shard_count`): a parameter
  Megatron marks ``tensor_model_parallel`` is one of tp distinct shards, so the global gradient norm counts each
  once, where a plain tensor would be taken for a copy (15.66 instead of 21.84 in issue 42's MLP);
* :func:`dcp_shards` (registered with :func:`meshwise.checkpoint.objects.on_dcp_state`): those parameters and their
  optimizer state go to DCP as DTensors sharded along ``partition_dim`` over the tp dim, so a checkpoint holds
  whole named tensors and loads at any tp (and ``meshwise export`` writes them whole);
* :func:`check_parallelize` (registered with :func:`meshwise.parallel.placement.on_parallelize`): FSDP2, replicate
  and DTensor plans would wrap Megatron's shards as whole tensors; refused, naming torch DDP over the batch group.

The core never imports this module: the hooks above load it (importlib) once ``megatron.core`` is imported.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshwise.checkpoint.objects import on_dcp_state
from meshwise.errors import CheckpointError, ParallelError, TopologyError, import_extra
from meshwise.groups import adopt_groups
from meshwise.layout import Dims
from meshwise.parallel.clipping import on_shard_count
from meshwise.parallel.placement import on_parallelize
from meshwise.topology import Topology, current, on_shutdown

__all__ = ["ROLES", "adopt", "check_parallelize", "dcp_shards", "megatron_groups", "tensor_parallel_shards"]

ROLES = {"tp": "replica", "cp": "split", "dp": "batch", "pp": "stage"}
"""The role of each of Megatron's dims: tp ranks hold the same samples (their layers split the weights), cp ranks
parts of each sequence, dp ranks different samples, pp ranks pipeline stages."""


def _parallel_state() -> Any:
    return import_extra(
        "megatron.core.parallel_state",
        "meshwise.megatron",
        "pip install 'meshwise[megatron]' (megatron-core 0.16.1 on Python 3.11; docs/megatron.md)",
    )


def megatron_groups() -> dict[str, dist.ProcessGroup]:
    """Megatron's own groups by meshwise dim name: ``tp`` and ``dp`` always, ``cp`` and ``pp`` when larger than 1.

    Raises :class:`TopologyError` before ``initialize_model_parallel`` and for expert parallel, whose groups are
    carved out of dp for the expert layers only: meshwise would count expert weights as dp copies (and a dense
    gradient reduction over dp would mix different experts), so its clipping and checkpoints would be wrong.
    """
    ps = _parallel_state()
    if not ps.model_parallel_is_initialized():
        raise TopologyError(
            "Megatron's parallel_state is not initialised: call torch.distributed.init_process_group(...) and "
            "megatron.core.parallel_state.initialize_model_parallel(tensor_model_parallel_size=..., ...) first, then "
            "meshwise.megatron.adopt()"
        )
    ep = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    if ep > 1 or (etp is not None and etp != tp):
        raise TopologyError(
            f"Megatron is initialised with expert parallel (expert_model_parallel_size={ep}, "
            f"expert_tensor_parallel_size={etp}, tensor_model_parallel_size={tp}): its expert groups are carved out "
            "of the data-parallel ranks for the expert layers only, so one mesh cannot say what each rank holds; "
            "meshwise would count different experts as data-parallel copies in clipping and checkpoints. Initialise "
            "with expert_model_parallel_size=1 (and expert_tensor_parallel_size equal to tp), or train the MoE "
            "with Megatron's own training loop"
        )
    groups = {"tp": ps.get_tensor_model_parallel_group(), "dp": ps.get_data_parallel_group()}
    if ps.get_context_parallel_world_size() > 1:
        groups["cp"] = ps.get_context_parallel_group()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        groups["pp"] = ps.get_pipeline_model_parallel_group()
    return groups


def adopt(
    *,
    timeout: float | datetime.timedelta | None = None,
    debug: bool | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    extra_groups: Iterable[Dims] | None = None,
) -> Topology:
    """Make Megatron's ``parallel_state`` groups the meshwise topology, in one call (every rank).

    The mesh's dims are ``tp``, ``dp`` (and ``cp``, ``pp`` when larger than 1) in the order their ranks vary under
    Megatron's ``order=`` (``"tp-cp-ep-dp-pp"``: ``("dp", "tp")``; ``"dp-tp-pp"``: ``("tp", "dp")``), each dim's
    group Megatron's own object; roles :data:`ROLES`. ``meshwise.data.mesh_dataloader`` then gives every rank the
    samples of its Megatron data-parallel rank. Other options as :func:`meshwise.groups.adopt_groups`.
    """
    groups = megatron_groups()
    roles = {d: ROLES[d] for d in groups}
    return adopt_groups(groups, roles=roles, timeout=timeout, debug=debug, run_dir=run_dir, extra_groups=extra_groups)


# --------------------------------------------------------------------------- parameters


def _is_tensor_parallel(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


_CHECKED: dict[int, str] = {}  # id(topology) -> its tp dim, once its group is found to be Megatron's


def _forget(topo: Topology) -> None:
    _CHECKED.pop(id(topo), None)  # a later topology may reuse the id


def _tp_dim(topo: Topology) -> str:
    """The topology's replica dim whose groups are Megatron's tp groups; refused when there is none."""
    known = _CHECKED.get(id(topo))
    if known is not None:
        return known
    ps = _parallel_state()
    theirs = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()) if dist.is_initialized() else [0]
    for dim in topo.replica_dims:
        if topo.group_ranks(dim) == theirs:
            _CHECKED[id(topo)] = dim
            return dim
    raise ParallelError(
        f"{topo.label()}: the model has Megatron tensor-parallel parameters, split over Megatron's tp group "
        f"{theirs}, but no replica dim of this mesh ({topo.layout.dims_text()}) is that group, so meshwise cannot "
        "tell which ranks hold which shard (and tp peers may be fed different samples): build the topology from "
        "Megatron's groups with meshwise.megatron.adopt() after parallel_state.initialize_model_parallel(...)"
    )


def tensor_parallel_shards(p: torch.Tensor) -> int:
    """How many distinct shards of one tensor ``p`` is one of: Megatron's tp size for a ``tensor_model_parallel``
    parameter, else 1 (a copy). Refuses what meshwise cannot make equal to one process: sequence-parallel
    parameters (their gradients are partial sums over tp, reduced by Megatron's own finalize step) and expert
    parameters (``allreduce=False``: not reduced over dp)."""
    if getattr(p, "sequence_parallel", False):
        raise ParallelError(
            "the model has a Megatron parameter marked sequence_parallel (config.sequence_parallel=True): its "
            "gradient is this rank's partial sum over tp, which Megatron's own finalize_model_grads reduces and "
            "meshwise's trainer does not. Build the layers with sequence_parallel=False (docs/megatron.md)"
        )
    if getattr(p, "allreduce", True) is False:
        raise ParallelError(
            "the model has a Megatron expert parameter (allreduce=False: each expert-parallel rank holds other "
            "experts): meshwise would average it over dp and count it as a copy. Expert parallel is not supported; "
            "use expert_model_parallel_size=1 (docs/megatron.md)"
        )
    if not _is_tensor_parallel(p):
        return 1
    topo = current()
    if topo is None:
        ps = _parallel_state()
        return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    return topo.sizes[_tp_dim(topo)] if topo.world_size > 1 else 1


def check_parallelize(model: nn.Module, topology: Topology) -> None:
    """``parallelize`` of a model holding Megatron tensor-parallel parameters: refused, naming the road.

    FSDP2 and replicate would make each rank's shard a DTensor over the data-parallel ranks that claims to be the
    whole tensor (its norm and checkpoint then count tp shards as copies), and a DTensor ``tp_plan`` would split
    Megatron's shards again. Megatron's layers already do their tensor-parallel communication: only the gradient
    average over the batch ranks is missing, which torch DDP over the mesh's batch group does.
    """
    named = [n for n, p in model.named_parameters() if _is_tensor_parallel(p)]
    if not named or topology.world_size == 1:
        return
    raise ParallelError(
        f"{topology.label()}: the model holds Megatron tensor-parallel parameters ({named[0]!r}, ...), which "
        "parallelize() would wrap as FSDP2/replicate DTensors or split again with a tp_plan. Megatron's layers do "
        "their own tensor-parallel communication; average the gradients over the batch ranks with torch's DDP "
        "instead: DistributedDataParallel(model, process_group=topo.group(topo.metric_dims)), then "
        "meshwise.create_trainer(ddp_model, ...) (docs/megatron.md)"
    )


# --------------------------------------------------------------------------- checkpoints


def _dtensor(value: torch.Tensor, p: torch.Tensor, mesh: Any, tp: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    dim = int(getattr(p, "partition_dim", 0)) % max(p.ndim, 1)
    if int(getattr(p, "partition_stride", 1)) != 1:
        raise CheckpointError(
            f"a Megatron parameter of shape {tuple(p.shape)} is split with partition_stride="
            f"{p.partition_stride}: its shards interleave, so they are not one slice each of a global tensor and "
            "cannot be saved to reshard; build the layer with stride=1 (docs/megatron.md)"
        )
    shape = list(value.shape)
    shape[dim] *= tp
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(value, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=stride)


def _shards_by_key(module: nn.Module, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state's keys (canonical names, as DCP's state dict has them) of the module's tensor-parallel parameters:
    found by storage, since those values are the parameters' own tensors (detached)."""
    owned = {p.data_ptr(): p for p in module.parameters() if _is_tensor_parallel(p) and p.numel()}
    return {
        k: owned[v.data_ptr()]
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.data_ptr() in owned and v.shape == owned[v.data_ptr()].shape
    }


def dcp_shards(kind: str, module: nn.Module, state: dict[str, Any], to_dcp: bool) -> dict[str, Any]:
    """Megatron's tensor-parallel parameters (and their optimizer state) as DTensors ``Shard(partition_dim)`` over
    the tp dim on the way to DCP (``to_dcp``), and back to this rank's plain shard on the way into the model."""
    from torch.distributed.tensor import DTensor

    if not to_dcp:
        if not any(_is_tensor_parallel(p) for p in module.parameters()):
            return state
        params = _module_keys(module)
        ours = set(params) if kind == "module" else {k for k in state if _optimizer_param(k, params) is not None}
        return {k: v.to_local() if isinstance(v, DTensor) and k in ours else v for k, v in state.items()}
    topo = current()
    if topo is None or topo.world_size == 1 or not any(_is_tensor_parallel(p) for p in module.parameters()):
        return state
    dim = _tp_dim(topo)
    tp = topo.sizes[dim]
    if tp == 1:
        return state
    mesh = topo.submesh(dim)
    if kind == "module":
        params = _shards_by_key(module, state)
        out = {k: _dtensor(v, params[k], mesh, tp) if k in params else v for k, v in state.items()}
    else:
        params = _module_keys(module)
        out = {}
        for key, value in state.items():
            p = _optimizer_param(key, params)
            wrap = p is not None and isinstance(value, torch.Tensor) and value.shape == p.shape and value.ndim
            out[key] = _dtensor(value, p, mesh, tp) if wrap else value
    return out


def _module_keys(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return _shards_by_key(module, get_model_state_dict(module))


def _optimizer_param(key: str, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The parameter a flattened optimizer key (``state.<name>.<field>``) belongs to, if it is a shard."""
    if not key.startswith("state."):
        return None
    rest = key[len("state.") :]
    for name, p in params.items():
        if rest.startswith(name + "."):
            return p
    return None


on_shard_count(tensor_parallel_shards)
on_parallelize(check_parallelize)
on_dcp_state(dcp_shards)
on_shutdown(_forget)
