"""The one door to the private names of torch, pytorch-ignite, torchmetrics, datasets, transformers, PhysicsNeMo
and DeepSpeed that meshwise leans on: one function or constant per name, each saying what the name is and which
public API would replace it.

Nothing else in meshwise touches another package's ``_underscore`` name. ``tests/test_compat.py`` checks every
entry here and fails, naming the name and the package version, when an upgrade removes or changes one; the list,
with what each name is for, is in docs/torch.md ("Private names meshwise leans on").
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DCP_METADATA_PRIVATE_GLOBALS",
    "DCP_SHARD_SUFFIX",
    "LEGACY_REPLICATE_KEY",
    "COMPILED_INNER",
    "checkpoint_module",
    "clear_metric_computed",
    "composable_registry",
    "dcp_shard_prefix",
    "dcp_storage_info",
    "dcp_stream_extensions",
    "deepspeed_compatible_ops",
    "default_store",
    "event_handlers",
    "fake_store",
    "flatten_mesh",
    "flatten_state_dict",
    "foreach_mul_",
    "foreach_norm",
    "gloo_options",
    "handler_parent",
    "hf_class_pp_plan",
    "hf_class_tp_plan",
    "hf_init_weights",
    "ignite_native_model_type",
    "ignite_serial_model",
    "iterable_source_kwargs",
    "manager_global_mesh",
    "mark_ignite_unsynced",
    "metric_defaults",
    "metric_is_synced",
    "metric_reductions",
    "metric_state_copy",
    "numpy_array_globals",
    "parameter_slots",
    "replicate_module_type",
    "replicate_with_fsdp",
    "set_attn_implementation",
    "set_ignite_model",
    "set_manager_mesh",
    "set_manager_process",
    "set_metric_cache",
    "set_metric_synced",
    "set_metric_to_sync",
    "set_options_timeout",
    "shard_function_registry",
    "shard_spec",
    "stop_loader_workers",
    "stored_sharding_shapes",
]

# =========================================================================== torch


def fake_store() -> dist.Store:
    """``torch.testing._internal.distributed.fake_pg.FakeStore``; importing it registers the ``"fake"`` backend
    a dry run joins. No public API: torch ships the fake backend for its own tests only."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def flatten_mesh(mesh: Any, name: str, backend_override: Any = None) -> Any:
    """``DeviceMesh._flatten``: one 1-D mesh (and group) over several dims of ``mesh``, made collectively and kept
    on the root. No public API in torch 2.13 (``fully_shard(dp_mesh_dims=DataParallelMeshDims(...))`` flattens
    inside FSDP only; ``DeviceMesh.from_group`` needs a group made by hand)."""
    return mesh._flatten(name, backend_override=backend_override)


def gloo_options() -> Any:
    """``ProcessGroupGloo._Options()``: gloo's backend options for ``init_device_mesh(backend_override=...)``.
    NCCL's are public (``ProcessGroupNCCL.Options``); gloo's have no public constructor."""
    return dist.ProcessGroupGloo._Options()


def set_options_timeout(options: Any, timeout: datetime.timedelta) -> Any:
    """``Options._timeout``: the timeout carried by backend options (``new_group``/``_flatten`` do not inherit
    ``init_process_group``'s; docs/torch.md, "Timeouts and new groups"). Public: ``dist.new_group(timeout=)``,
    which DeviceMesh does not call with one. Returns ``options``."""
    options._timeout = timeout
    return options


def default_store() -> dist.Store:
    """``distributed_c10d._get_default_store()``: the default group's rendezvous store (the watchdog's reports).
    No public getter; the launcher's store (``dist.TCPStore``) would have to be kept by hand."""
    return dist.distributed_c10d._get_default_store()


def replicate_with_fsdp() -> Callable[..., nn.Module]:
    """``torch.distributed._composable.replicate_with_fsdp.replicate``: DDP's all-reduce on FSDP2's machinery,
    the data-parallel wrapper that composes with tensor parallel. Public replacement: none in torch 2.13 (the
    public ``DistributedDataParallel`` loses DTensor parameters beside TP; docs/torch.md)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


def replicate_module_type() -> type:
    """``torch.distributed._composable.replicate_with_fsdp.ReplicateModule``: the class ``replicate`` mixes into a
    module (a subclass of the public ``torch.distributed.fsdp.FSDPModule``, which alone cannot tell the two apart)."""
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule

    return ReplicateModule


def composable_registry(module: nn.Module) -> dict[str, Any]:
    """``torch.distributed._composable.contract._get_registry``: the composable APIs applied to ``module`` (how
    legacy ``_composable.replicate``, which has no class of its own, is recognised). No public API."""
    from torch.distributed._composable.contract import _get_registry

    return dict(_get_registry(module) or {})


#: The registry key of legacy composable ``replicate`` in :func:`composable_registry`.
LEGACY_REPLICATE_KEY = "replicate"


def checkpoint_module(module: nn.Module) -> nn.Module:
    """``torch.distributed._composable.checkpoint``: recompute ``module``'s activations in backward, keeping its
    parameter names. Public alternatives change the names (``checkpoint_wrapper`` adds a prefix) or work on
    functions (``torch.utils.checkpoint.checkpoint``)."""
    from torch.distributed._composable import checkpoint

    return checkpoint(module)


def foreach_norm(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """``torch._foreach_norm``: each tensor's ``norm_type``-norm in one fused call. Public: one
    ``torch.linalg.vector_norm`` per tensor, or ``torch.nn.utils.get_total_norm`` (the total only)."""
    return list(torch._foreach_norm(list(tensors), norm_type))


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: float) -> None:
    """``torch._foreach_mul_``: multiply every tensor in place by ``factor`` in one fused call. Public: one
    ``Tensor.mul_`` per tensor (``torch.nn.utils.clip_grads_with_norm_`` fixes its own factor)."""
    torch._foreach_mul_(list(tensors), factor)


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """``torch.distributed.checkpoint.filesystem._StorageInfo``: where an item lies in a shard file, the
    ``storage_data`` of each write result, which DCP's ``FileSystemReader`` reads back. No public constructor."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def dcp_shard_prefix(plan: Any) -> str:
    """``SavePlan.storage_data.prefix`` (a ``_StoragePrefix``): the file-name prefix DCP's global plan gave this
    rank's shard. Public only inside ``FileSystemWriter.write_data``."""
    return plan.storage_data.prefix


def dcp_stream_extensions(writer: Any) -> Sequence[Any]:
    """``FileSystemWriter.transforms.extensions`` (``_StorageWriterTransforms``): the stream extensions a writer
    applies to its files (none by default). Public: the ``_extensions`` argument it was built with."""
    return writer.transforms.extensions


DCP_SHARD_SUFFIX = ".distcp"
"""``torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX`` (not in its ``__all__``): a shard file's suffix."""


def flatten_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``torch.distributed.checkpoint._nested_dict.flatten_state_dict``: DCP's dotted keys for a nested state
    dict (the keys its ``.metadata`` holds). Public only inside ``DefaultLoadPlanner.set_up_planner``."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state)[0]


#: ``OptimizedModule._orig_mod``: the module a ``torch.compile`` wrapper runs. No public accessor in torch 2.13.
COMPILED_INNER = "_orig_mod"


def stop_loader_workers(iterator: Any) -> None:
    """``_MultiProcessingDataLoaderIter._shutdown_workers()`` (torchdata's StatefulDataLoader iterator has the same):
    stop a DataLoader iterator's worker processes now, which is what its ``__del__`` does. No public API: torch
    stops them only when the iterator is freed, and an iterator freed by the cycle collector, after its worker
    queues were closed, waits 5 s per worker for workers that never got the stop message. A no-op for an
    iterator without workers."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


# =========================================================================== pytorch-ignite


def ignite_native_model_type() -> type:
    """``ignite.distributed.comp_models.native._NativeDistModel``: ignite's torch.distributed model, subclassed by
    a dry run to give it the planned placement. Public: ``idist.sync()``, which runs the discovery a dry run
    cannot (a gloo ``new_group`` on the fake backend)."""
    from ignite.distributed.comp_models.native import _NativeDistModel

    return _NativeDistModel


def ignite_serial_model() -> Any:
    """``ignite.distributed.comp_models.base._SerialModel()``: ignite's one-process model. Public: none (ignite
    falls back to it only on its own discovery)."""
    from ignite.distributed.comp_models.base import _SerialModel

    return _SerialModel()


def set_ignite_model(model: Any) -> None:
    """``ignite.distributed.utils._set_model(model, temporary=False)``: the model every ``idist`` call uses.
    Public: ``idist.sync()``, which discovers the model itself."""
    from ignite.distributed import utils

    utils._set_model(model, temporary=False)


def mark_ignite_unsynced() -> None:
    """``ignite.distributed.utils._need_to_sync = True``: the next ``idist`` call discovers its model again.
    Public: none (``idist.sync()`` discovers at once, while meshwise's group may still exist)."""
    from ignite.distributed import utils

    utils._need_to_sync = True


def event_handlers(engine: Any) -> list[tuple[Any, Callable[..., Any], tuple, dict]]:
    """``Engine._event_handlers``: every ``(event, handler, args, kwargs)`` registered on ``engine``. ignite 0.5.5
    has no public listing: ``has_event_handler`` needs the handler already in hand."""
    return [(event, h, args, kwargs) for event, hs in engine._event_handlers.items() for h, args, kwargs in hs]


def handler_parent(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper._parent``: the handler an event-filter wrapper of ignite stands for (a weak reference), else
    ``handler`` itself. Not ``__wrapped__``: on a metric's bound method whose function is decorated, that is the bare
    function, without the metric. No public API (``has_event_handler`` reads ``_parent`` itself)."""
    parent = getattr(handler, "_parent", None)
    return parent() if callable(parent) else handler


# =========================================================================== torchmetrics


def metric_defaults(metric: Any) -> dict[str, Any]:
    """``Metric._defaults``: each state's name and default value, as ``add_state`` recorded them. Public:
    ``metric.metric_state`` gives the current values, not the defaults."""
    return metric._defaults


def metric_reductions(metric: Any) -> dict[str, Any]:
    """``Metric._reductions``: each state's reduction function (``dist_reduce_fx``). No public API."""
    return metric._reductions


def metric_state_copy(metric: Any) -> dict[str, Any]:
    """``Metric._copy_state_dict()``: a copy of the current states (what ``sync`` caches). Public:
    ``metric.metric_state`` (the states themselves, not copies)."""
    return metric._copy_state_dict()


def set_metric_cache(metric: Any, cache: dict[str, Any]) -> None:
    """``Metric._cache``: the local states ``unsync()`` restores. Public: ``Metric.sync()`` sets it when it does
    the reduction itself (meshwise reduces in one fused collective instead)."""
    metric._cache = cache


def metric_is_synced(metric: Any) -> bool:
    """``Metric._is_synced``: whether the metric holds synced (global) states. No public getter."""
    return bool(metric._is_synced)


def set_metric_synced(metric: Any, synced: bool) -> None:
    """``Metric._is_synced = synced``: mark the installed states as synced, so ``unsync()`` restores the cache.
    Public: ``Metric.sync()`` (its own reduction)."""
    metric._is_synced = synced


def clear_metric_computed(metric: Any) -> None:
    """``Metric._computed = None``: drop the cached ``compute()`` value. Public: ``reset()``, which also drops the
    states."""
    metric._computed = None


def set_metric_to_sync(metric: Any, flag: bool) -> None:
    """``Metric._to_sync``: whether ``compute()`` syncs. Public: ``sync_on_compute``, copied into ``_to_sync`` at
    construction and after each ``forward`` (meshwise sets both)."""
    metric._to_sync = flag


# =========================================================================== datasets


def iterable_source_kwargs(dataset: Any) -> dict[str, Any]:
    """``datasets.IterableDataset._ex_iterable.kwargs``: the arguments of a stream's source (its file lists).
    No public API."""
    return dict(getattr(getattr(dataset, "_ex_iterable", None), "kwargs", None) or {})


# =========================================================================== transformers


def hf_class_tp_plan(model_class: type) -> dict[str, str]:
    """``PreTrainedModel._tp_plan`` of the class (the head's entries, e.g. ``lm_head``). Public: the instance's
    ``model.tp_plan`` (the whole plan, once transformers built the model)."""
    return dict(getattr(model_class, "_tp_plan", None) or {})


def hf_class_pp_plan(model_class: type) -> dict[str, Any]:
    """``PreTrainedModel._pp_plan`` of the class (the head). Public: the instance's ``model.pp_plan``."""
    return dict(getattr(model_class, "_pp_plan", None) or {})


def hf_init_weights(model: Any) -> Callable[[nn.Module], None] | None:
    """``PreTrainedModel._init_weights``: the model's initialiser of one module (``from_pretrained`` calls it for
    what no file holds, e.g. rotary ``inv_freq``). Public: ``model.init_weights()``, which redoes every module."""
    return getattr(model, "_init_weights", None)


def set_attn_implementation(config: Any, name: str) -> None:
    """``PretrainedConfig._attn_implementation = name``: the attention function every attention module of the
    config calls. Public: ``model.set_attn_implementation(name)`` (checks the name against hub kernels)."""
    config._attn_implementation = name


# =========================================================================== PhysicsNeMo


def set_manager_process(manager_class: type, rank: int, world_size: int, local_rank: int, device: torch.device) -> Any:
    """``DistributedManager._shared_state["_is_initialized"]`` (its Borg state, set before the manager is made)
    and the manager's ``_distributed``, ``_rank``, ``_world_size``, ``_local_rank``, ``_device`` and
    ``_initialization_method``: what ``initialize()`` sets, for a process group made outside it; returns the
    manager. Public: ``DistributedManager.initialize()``, which fails on CPU under a launcher (docs/physicsnemo.md)."""
    manager_class._shared_state["_is_initialized"] = True
    manager = manager_class()
    manager._distributed = True
    manager._rank, manager._world_size, manager._local_rank = rank, world_size, local_rank
    manager._device = device
    manager._initialization_method = "env"
    return manager


def manager_global_mesh(manager: Any) -> Any:
    """``DistributedManager._global_mesh``: the manager's mesh, or None. Public: ``manager.global_mesh``, which
    builds a flat ``("world",)`` mesh when there is none."""
    return getattr(manager, "_global_mesh", None)


def set_manager_mesh(manager: Any, mesh: Any, sizes: dict[str, int]) -> None:
    """``DistributedManager._global_mesh`` and ``_mesh_dims``: give the manager an existing mesh. Public:
    ``manager.initialize_mesh(...)``, which builds a new one."""
    manager._global_mesh = mesh
    manager._mesh_dims = dict(sizes)


def shard_spec(shard_tensor: Any) -> Any:
    """``ShardTensor._spec``: its ``ShardTensorSpec`` (placements, sharding shapes), or None for other tensors.
    Public: ``isinstance(t, ShardTensor)`` plus ``placements``; the sharding shapes have no public reader."""
    return getattr(shard_tensor, "_spec", None)


def stored_sharding_shapes(spec: Any) -> Any:
    """``ShardTensorSpec._sharding_shapes``: the shards' shapes as stored. Public: ``spec.sharding_shapes()``,
    which gathers missing ones (a collective)."""
    return spec._sharding_shapes


def shard_function_registry() -> dict[Any, Any]:
    """``ShardTensor._function_registry``: the torch functions PhysicsNeMo's ShardTensor patches (halo conv, ...).
    No public query of what ``register_custom_ops()`` registered."""
    from physicsnemo.domain_parallel import ShardTensor

    return dict(getattr(ShardTensor, "_function_registry", None) or {})


# =========================================================================== DeepSpeed


def deepspeed_compatible_ops() -> dict[str, bool]:
    """``deepspeed.ops.__compatible_ops__``: DeepSpeed's verdict, probed once per process, of which ops can be built
    here; its CPU backend compiles ``deepspeed_shm_comm`` at ``init_distributed`` when the verdict is True. The dict
    is cached in the module and read again by every builder, so an edit holds for the process. No public switch:
    the probe reads only the platform (the op's ``is_compatible``), no setting or environment variable."""
    import deepspeed.ops

    return deepspeed.ops.__compatible_ops__


# =========================================================================== checkpoints read as data

#: The private names DCP's ``.metadata`` pickle refers to (torch 2.13): ``filesystem._StorageInfo`` (where an item
#: lies in a shard file), ``metadata._MEM_FORMAT_ENCODING`` (a tensor's memory format, as ``TensorProperties``
#: pickles it) and ``serialization._get_layout`` (how a ``torch.layout`` pickles). meshwise's allowlist unpickler
#: admits them by these names, with DCP's public metadata classes. Public replacement: DCP reading its metadata with
#: ``torch.load(weights_only=True)`` and its own allowlist, which torch 2.13 does not do (it uses plain ``pickle``).
DCP_METADATA_PRIVATE_GLOBALS: tuple[tuple[str, str], ...] = (
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
)


def numpy_array_globals() -> list[Any]:
    """``numpy._core.multiarray._reconstruct`` (``numpy.core.multiarray`` before numpy 2), ``numpy.ndarray`` and
    ``numpy.dtype`` (and its numeric dtype classes): what a pickled numpy array names, for
    ``torch.serialization.safe_globals`` (torch's own advice for loading arrays with ``weights_only=True``; the
    array's bytes are data). No public name of the function."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    names = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct")
    kinds = [type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"]  # numpy >= 1.25: one class per dtype
    return [*((rebuild, n) for n in names), np.ndarray, np.dtype, *dict.fromkeys(k for k in kinds if k is not np.dtype)]


def parameter_slots(module: nn.Module) -> dict[str, Any]:
    """``nn.Module._parameters``: the dict ``module.<name>`` reads a parameter from, itself (writes go through). Lets
    a forward hook hand the module a plain tensor computed from a parameter for one forward, as transformers'
    tensor parallel and FSDP2 do. No public API: ``register_parameter`` and ``setattr`` take only
    ``nn.Parameter``s, and ``torch.func.functional_call`` replaces the whole call, not one module's tensors."""
    return module._parameters
