"""Model parallelism over the topology: TP plans (also Hugging Face models' own) and FSDP2 placed by roles, pipeline
stages, global-norm clipping, halo exchange."""

from __future__ import annotations

from meshwise.lazy import lazy_attributes

# torch.distributed's tensor-parallel modules load only when a name is first used
_LAZY = {
    "parallelize": "meshwise.parallel.placement",
    "clip_grad_norm": "meshwise.parallel.clipping",
    "check_data_parallel": "meshwise.parallel.data_parallel",
    "reshard": "meshwise.parallel.data_parallel",
    "halo_exchange": "meshwise.parallel.halo",
    "node_halo_exchange": "meshwise.parallel.node_halo",
    "PipelineModel": "meshwise.parallel.stages",
    "pipeline_of": "meshwise.parallel.stages",
    "pipeline_units": "meshwise.parallel.stages",
    "stage_cuts": "meshwise.parallel.stages",
    "context_parallel": "meshwise.parallel.context",
    "check_attention_routed": "meshwise.parallel.context",
    "hf_tp_plan": "meshwise.hf.plans",
    "memory_per_rank": "meshwise.parallel.precision",
    "Precision": "meshwise.parallel.precision",
}

__all__ = list(_LAZY)


__getattr__ = lazy_attributes(__name__, _LAZY)
