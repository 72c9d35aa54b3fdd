"""DeepSpeed interop: adopt a DeepSpeed engine's own groups as the topology, drive it from an ignite Engine with
meshwise's loader and metrics, and stop the meshwise roads that would train or save it wrongly (docs/deepspeed.md).

DeepSpeed keeps what it owns: forward, ``engine.backward(loss)``, ``engine.step()`` (its optimizer, ZeRO's
partitions, gradient averaging over its data group, clipping), ``PipelineEngine.train_batch`` and its checkpoints.
meshwise takes the rest: the topology made from DeepSpeed's groups, the loader (each sample once over the data
ranks, a global cursor), the metrics and evaluator, logs and progress.

* :func:`skip_shm_build` avoids the shared-memory op DeepSpeed compiles on CPU at ``init_distributed`` (about 2
  minutes on 2 cores, cached afterwards) and uses only for its inference all-reduce;
* :func:`adopt` builds the topology from an engine's groups: ``data`` → batch, ``pipe`` → stage, ``model`` →
  replica, each dim's group DeepSpeed's own object (:func:`meshwise.groups.adopt_groups`);
* :func:`check_engine` (called by ``on_mesh(engine, model=...)``) accepts an engine whose data group is the
  topology's batch group; :func:`refuse_trainer` (``create_trainer``) and :func:`refuse_checkpoint`
  (``Checkpointer``) name DeepSpeed's own road instead of training or saving it unlike one process;
* :func:`pipeline_forward` evaluates a ``PipelineEngine`` in ``create_evaluator``; :func:`global_loss` is a ZeRO
  step's loss over the global batch.

The core never imports this module: those hooks load it (importlib) once ``deepspeed`` is imported.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshwise import compat
from meshwise.debug import guarded
from meshwise.errors import CheckpointError, ParallelError, TopologyError, import_extra
from meshwise.groups import adopt_groups
from meshwise.layout import Dims
from meshwise.topology import Topology, resolve

__all__ = [
    "ROLES",
    "SHM_OP",
    "adopt",
    "check_engine",
    "deepspeed_groups",
    "global_loss",
    "is_engine",
    "pipeline_forward",
    "refuse_checkpoint",
    "refuse_trainer",
    "skip_shm_build",
]

ROLES = {"data": "batch", "pipe": "stage", "model": "replica"}
"""The role of each axis of DeepSpeed's ``ProcessTopology``: data ranks hold different samples, pipe ranks the
stages of one pipeline, model ranks (Megatron-style tensor slicing) the same samples."""

SHM_OP = "deepspeed_shm_comm"
"""The op DeepSpeed's CPU backend compiles at ``init_distributed`` (``ShareMemCommBuilder``)."""

_ROAD = (
    "drive it from your own ignite Engine: def train_step(e, batch): loss = engine(batch['input']) ...; "
    "engine.backward(loss); engine.step() (a PipelineEngine: engine.train_batch(iter(micro_batches))), with "
    "meshwise.deepspeed.adopt(engine) for the topology, meshwise.data.mesh_dataloader for the batches, "
    "meshwise.engine.on_mesh(trainer, topo, model=engine) and meshwise.create_evaluator for the metrics "
    "(docs/deepspeed.md)"
)


def _deepspeed() -> Any:
    return import_extra("deepspeed", "meshwise.deepspeed", "pip install 'meshwise[deepspeed]' (docs/deepspeed.md)")


def skip_shm_build() -> bool:
    """Stop DeepSpeed's CPU backend from compiling its shared-memory op; call before ``deepspeed.init_distributed``
    (or ``deepspeed.initialize``). Returns whether the op was to be built.

    DeepSpeed 0.19's ``TorchBackend`` builds ``deepspeed_shm_comm`` (a C++ extension, about 2 minutes on 2 cores the
    first time, then cached in ``~/.cache/torch_extensions``) whenever its probe marks the op compatible, which on
    Linux it always does. The op serves only ``inference_all_reduce`` (AutoTP's ``LinearAllreduce``), which without
    it falls back to the process group's ``all_reduce``: the same sums, without the shared-memory fast path.
    Training collectives (ZeRO, the pipeline, gradient averaging) never use it.
    """
    ops = compat.deepspeed_compatible_ops()
    was = bool(ops.get(SHM_OP, False))
    ops[SHM_OP] = False
    return was


# --------------------------------------------------------------------------- the topology


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``DeepSpeedEngine`` (``PipelineEngine`` included)."""
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:
        return False
    return isinstance(obj, DeepSpeedEngine)


def _grid_of(source: Any) -> Any:
    """The ``PipelineParallelGrid`` of an engine or the grid itself, else None."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    if isinstance(source, PipelineParallelGrid):
        return source
    for candidate in (getattr(source, "grid", None), getattr(source, "mpu", None)):
        if isinstance(candidate, PipelineParallelGrid):
            return candidate
    return None


def deepspeed_groups(source: Any) -> dict[str, dist.ProcessGroup]:
    """DeepSpeed's own groups by axis name: ``data`` always, ``pipe`` and ``model`` when larger than 1.

    ``source`` is the engine ``deepspeed.initialize`` returned (a ``PipelineEngine``'s grid, or a plain engine's
    data-parallel group over the world) or a ``PipelineParallelGrid``. Refused with :class:`TopologyError`: an
    engine with another ``mpu`` (a Megatron ``parallel_state``: adopt that with ``meshwise.megatron.adopt()``),
    Ulysses sequence parallel and MoE expert parallel, whose groups one mesh of roles cannot describe.
    """
    _deepspeed()
    grid = _grid_of(source)
    if grid is not None:
        topology = grid.topology()
        axes = topology.get_axis_names()
        unknown = [a for a in axes if a not in ROLES]
        if unknown:
            raise TopologyError(
                f"the DeepSpeed topology has axes {axes}; meshwise.deepspeed knows {sorted(ROLES)} (those of "
                "PipeDataParallelTopology and PipeModelDataParallelTopology): adopt other groups with "
                "meshwise.groups.adopt_groups({name: group}, roles={name: role})"
            )
        by_axis = {
            "data": grid.get_data_parallel_group(),
            "pipe": grid.get_pipe_parallel_group(),
            "model": grid.get_slice_parallel_group(),
        }
        return {a: by_axis[a] for a in axes if a == "data" or topology.get_dim(a) > 1}
    if not is_engine(source):
        raise TopologyError(
            f"meshwise.deepspeed.adopt() takes the engine deepspeed.initialize() returned or a PipelineParallelGrid, "
            f"got {type(source).__name__}"
        )
    if getattr(source, "mpu", None) is not None:
        raise TopologyError(
            f"this DeepSpeed engine was given mpu={type(source.mpu).__name__}, whose groups meshwise.deepspeed does "
            "not read: with Megatron-core's parallel_state use meshwise.megatron.adopt(), else "
            "meshwise.groups.adopt_groups({name: group}, roles=...)"
        )
    if getattr(source, "sequence_parallel_size", 1) > 1:
        raise TopologyError(
            f"this DeepSpeed engine runs Ulysses sequence parallel (size {source.sequence_parallel_size}): its ranks "
            "hold parts of each sequence and reduce gradients over a sequence-data group meshwise.deepspeed does not "
            "adopt; train it with DeepSpeed's own loop"
        )
    if getattr(source, "has_moe_layers", False):
        raise TopologyError(
            "this DeepSpeed engine has MoE layers: their expert groups are carved out of the data-parallel ranks for "
            "the expert layers only, so one mesh cannot say what each rank holds; train it with DeepSpeed's own loop"
        )
    return {"data": source.data_parallel_group}


def adopt(
    source: Any,
    *,
    timeout: float | datetime.timedelta | None = None,
    debug: bool | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    extra_groups: Iterable[Dims] | None = None,
) -> Topology:
    """Make a DeepSpeed engine's groups the meshwise topology, in one call (every rank).

    The mesh's dims are DeepSpeed's axis names (``data``, and ``pipe``/``model`` when larger than 1), in the order
    their ranks vary (``PipeModelDataParallelTopology``: ``("pipe", "data", "model")``), each dim's group DeepSpeed's
    own object, roles :data:`ROLES`: ``mesh_dataloader`` then gives every rank the samples of its DeepSpeed data
    rank, and the stages of one pipeline the same samples. Other options as :func:`meshwise.groups.adopt_groups`.
    """
    groups = deepspeed_groups(source)
    roles = {axis: ROLES[axis] for axis in groups}
    return adopt_groups(groups, roles=roles, timeout=timeout, debug=debug, run_dir=run_dir, extra_groups=extra_groups)


# --------------------------------------------------------------------------- the roads meshwise checks


def _data_ranks(engine: Any) -> list[int]:
    grid = _grid_of(engine)
    group = grid.get_data_parallel_group() if grid is not None else engine.data_parallel_group
    return dist.get_process_group_ranks(group) if dist.is_initialized() else [0]


def check_engine(model: Any, topology: Topology | None = None) -> bool:
    """Whether ``model`` is a DeepSpeed engine that trains right on ``topology``; False for any other model.

    DeepSpeed averages its gradients over its own data group, so that group must be the topology's batch group:
    else data ranks meshwise feeds different samples would be averaged as copies, or copies of the same samples
    taken for different ones. Raises :class:`ParallelError` naming both groups and :func:`adopt`.
    """
    if not is_engine(model):
        return False
    topo = resolve(topology)
    theirs = _data_ranks(model)
    ours = topo.group_ranks(topo.batch_dims) if topo.batch_dims else [topo.rank]
    if theirs != ours:
        raise ParallelError(
            f"{topo.label()}: this DeepSpeed engine averages gradients over its data group {theirs}, but this mesh's "
            f"batch ranks ({topo.layout.dims_text()}) are {ours}, so meshwise's loader would feed the engine's "
            "data ranks other samples than it averages: build the topology from the engine with "
            "meshwise.deepspeed.adopt(engine)"
        )
    return True


def refuse_trainer(model: Any, optimizer: Any = None) -> None:
    """Refuse a DeepSpeed engine (or its optimizer) given to ``meshwise.create_trainer``, naming the road.

    ``create_trainer``'s step calls ``loss.backward()``, averages and clips gradients itself and steps a torch
    optimizer: beside DeepSpeed's own ``backward``/``step`` (ZeRO's partitioned reduction, its loss scaling, its
    gradient accumulation boundary) the update would be averaged twice or not at all.
    """
    owner = "model" if is_engine(model) else "optimizer" if _is_deepspeed_optimizer(optimizer) else None
    if owner is None:
        return
    raise ParallelError(
        f"create_trainer() got a DeepSpeed {'engine' if owner == 'model' else 'optimizer'} as {owner}: DeepSpeed "
        "runs its own backward and optimizer step (ZeRO partitions, gradient averaging, clipping from its config), "
        f"which create_trainer's step would repeat or skip; {_ROAD}"
    )


def _is_deepspeed_optimizer(optimizer: Any) -> bool:
    try:
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    except ImportError:
        return False
    return isinstance(optimizer, DeepSpeedOptimizer)


def refuse_checkpoint(name: str, obj: Any) -> None:
    """Refuse a DeepSpeed engine or optimizer given to meshwise's ``Checkpointer``, naming DeepSpeed's own.

    A ``DeepSpeedEngine`` is a module whose optimizer state lives in ZeRO's flat partitions (each data rank holds
    its slice), which DCP would take for the module's replicated state or miss; the ZeRO optimizer's
    ``state_dict`` is this rank's partition, which a small-state save would keep from one rank only.
    """
    if not (is_engine(obj) or _is_deepspeed_optimizer(obj)):
        return
    raise CheckpointError(
        f"cannot checkpoint {name}={type(obj).__name__} with meshwise's Checkpointer: DeepSpeed keeps its model "
        "and ZeRO-partitioned optimizer in its own checkpoints. Save with engine.save_checkpoint(folder, "
        "client_state={'loader': loader.state_dict(), 'trainer': trainer.state_dict()}) on every rank and resume "
        "with _, client_state = engine.load_checkpoint(folder), then loader.load_state_dict(client_state['loader']) "
        "and trainer.load_state_dict(client_state['trainer']) (docs/deepspeed.md)"
    )


# --------------------------------------------------------------------------- steps a user's script calls


def global_loss(loss: torch.Tensor, topology: Topology | None = None) -> float:
    """The mean loss over the global batch, the same on every rank: this rank's mean loss averaged over the batch
    dims (one all-reduce), as DeepSpeed averages gradients, every data rank holding as many rows
    (``mesh_dataloader(mode="train")``). A ``PipelineEngine``'s ``train_batch`` returns that already."""
    topo = resolve(topology)
    value = loss.detach().double().reshape(1).clone()
    size = topo.size(topo.batch_dims)
    if size > 1:
        with guarded(topo, topo.batch_dims, "deepspeed global loss", tensor=value):
            dist.all_reduce(value, group=topo.group(topo.batch_dims))
    return float(value) / size


def pipeline_forward(input_key: str = "input", target_key: str = "target") -> Any:
    """A ``forward=`` for ``meshwise.create_evaluator(pipeline_engine, ...)``: the local batch as one micro-batch
    through ``engine.eval_batch(..., return_logits=True)``; the last stage gets the logits, the others None
    (meshwise's metrics update on the last stage only). The activation shapes are reset before and after on every
    stage, since an evaluation batch may differ in rows from a training micro-batch and DeepSpeed caches them."""

    def forward(engine: Any, batch: Mapping[str, Any]) -> Any:
        engine.reset_activation_shape()
        micro = (batch[input_key], batch[target_key])
        _, logits = engine.eval_batch(iter([micro]), return_logits=True, num_micro_batches=1)
        engine.reset_activation_shape()
        return logits

    return forward
