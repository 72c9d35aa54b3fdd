"""Turn a Hugging Face transformers model's own tensor-parallel plan (``tp_plan="auto"``) into torch ParallelStyles,
after checking that the model's sizes divide by the tensor-parallel size."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from meshwise import compat
from meshwise.errors import ParallelError

__all__ = ["SIZE_FIELDS", "STYLES", "check_divisible", "hf_plan_strings", "hf_tp_plan", "is_hf_model"]

# The config sizes a TP plan cuts: heads (q/k/v columns, o rows), the MLP width, the vocabulary (embedding, lm_head)
SIZE_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def _colwise(gather: bool) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(output_layouts=Replicate()) if gather else ColwiseParallel()


def _rowwise(replicated_input: bool) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(input_layouts=Replicate()) if replicated_input else RowwiseParallel()


# transformers' plan strings (its ALL_PARALLEL_STYLES) and the torch style with the same input/output layouts.
# None: the parameters stay whole on every tensor-parallel rank (data parallel still covers them).
STYLES: dict[str, Callable[[], Any] | None] = {
    "colwise": lambda: _colwise(False),  # Replicate in, Shard(-1) out: the heads / MLP columns split
    "colwise_gather_output": lambda: _colwise(True),  # Replicate out: e.g. lm_head's full logits
    "colwise_rep": lambda: _colwise(True),
    "rowwise": lambda: _rowwise(False),  # Shard(-1) in (the colwise output), all-reduced out
    "rowwise_split_input": lambda: _rowwise(True),  # a replicated input is split here first
    "rowwise_rep": lambda: _rowwise(True),
    "embedding_rowwise": lambda: _rowwise(True),  # vocab-parallel embedding: partial lookups summed
    "embedding_colwise": lambda: _colwise(True),  # hidden-split embedding, gathered
    "replicate": None,
    "replicated_with_grad_allreduce": None,
}


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (it has a config and a base model prefix)."""
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


def hf_plan_strings(model: nn.Module) -> dict[str, str]:
    """The model's own plan, keys relative to ``model``: the instance's ``_tp_plan`` when transformers built it,
    else ``config.base_model_tp_plan`` under the base model's prefix plus the class's ``_tp_plan`` (lm_head)."""
    if not is_hf_model(model):
        raise ParallelError(
            f"tp_plan='auto' reads a Hugging Face model's own plan, but {type(model).__name__} is not a transformers "
            "PreTrainedModel: pass a dict name -> ColwiseParallel()/RowwiseParallel() instead"
        )
    own = getattr(model, "tp_plan", None)
    if own and any(k.startswith(f"{model.base_model_prefix}.") for k in own):
        return dict(own)
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    prefix = model.base_model_prefix
    inner = getattr(model, prefix, None) if prefix else None
    if isinstance(inner, nn.Module) and inner is not model:
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    plan = {**base, **compat.hf_class_tp_plan(type(model))}
    if not plan:
        raise ParallelError(
            f"{type(model).__name__} declares no tensor-parallel plan (config.base_model_tp_plan is empty): pass "
            "tp_plan= as a dict name -> ColwiseParallel()/RowwiseParallel()"
        )
    return plan


def check_divisible(config: Any, tp: int) -> None:
    """Refuse a tensor-parallel size that does not divide the sizes the plan cuts, naming the sizes that work."""
    sizes = {f: getattr(config, f) for f in SIZE_FIELDS if isinstance(getattr(config, f, None), int)}
    bad = {f: n for f, n in sizes.items() if n % tp}
    if bad:
        common = math.gcd(*sizes.values())
        works = [d for d in range(1, common + 1) if common % d == 0]
        raise ParallelError(
            f"tensor parallel over {tp} ranks cannot split "
            + ", ".join(f"{f}={n}" for f, n in bad.items())
            + f" (every rank must hold whole heads and equal slices; sizes: {sizes}): use a tp size among {works}"
        )


def _plan_modules(model: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    from meshwise.parallel.apply import _plan_matches_name

    return [(n, m) for n, m in model.named_modules() if n and _plan_matches_name(n, key)]


def hf_tp_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """The torch plan (name -> ParallelStyle) for ``model``'s own transformers plan over ``tp`` ranks.

    Raises :class:`ParallelError` for sizes that do not divide by ``tp``, a plan string meshwise does not
    translate, an entry naming no module, a module torch cannot shard (e.g. GPT-2's ``Conv1D``), and a
    sharded ``lm_head`` tied to the input embedding.
    """
    strings = hf_plan_strings(model)
    check_divisible(model.config, tp)
    tied = getattr(model.config, "tie_word_embeddings", False)
    plan: dict[str, Any] = {}
    for key, name in strings.items():
        if name not in STYLES:
            raise ParallelError(
                f"{type(model).__name__}'s tp plan gives {key!r} the style {name!r}, which meshwise does not "
                f"translate to a torch ParallelStyle (known: {sorted(STYLES)}): pass tp_plan= as a dict instead"
            )
        modules = _plan_modules(model, key)
        if not modules:
            raise ParallelError(
                f"{type(model).__name__}'s tp plan names {key!r}, which matches no submodule: the plan does not fit "
                "this model; pass tp_plan= as a dict of names from model.named_modules()"
            )
        factory = STYLES[name]
        if factory is None:
            continue
        for mod_name, module in modules:
            if type(module).__name__ == "Conv1D":
                raise ParallelError(
                    f"{mod_name!r} is a transformers Conv1D (GPT-2 style, weight stored [in, out]), which torch's "
                    "ColwiseParallel/RowwiseParallel cannot shard: use a model built from nn.Linear, or tp=1"
                )
            if not isinstance(module, nn.Linear | nn.Embedding):
                raise ParallelError(
                    f"{mod_name!r} is a {type(module).__name__}; torch's {name} style shards only nn.Linear and "
                    "nn.Embedding: pass tp_plan= as a dict without it"
                )
        if tied and any(isinstance(m, nn.Linear) for _, m in modules) and key.split(".")[-1] == "lm_head":
            # one weight in two modules: sharding lm_head's rows would also reshape the embedding it shares
            continue
        plan[key] = factory()
    if tied:
        # a tied embedding keeps its whole weight: sharding it would shard the lm_head that shares it
        for key in [k for k in plan if all(isinstance(m, nn.Embedding) for _, m in _plan_modules(model, k))]:
            del plan[key]
    return plan


# --------------------------------------------------------------------------- context parallel

ATTN_IMPLEMENTATION = "meshwise_cp"  # the name registered with transformers' AttentionInterface


def _meshwise_cp_attention(
    module: nn.Module,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: Any = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention-function signature over meshwise's context-parallel attention.

    The mask transformers built is ignored: meshwise's attention is causal by the tokens' true positions,
    which a split window's local mask cannot express.
    """
    from meshwise.parallel.context import ENTRY_POINT, attention

    attn = getattr(module, ENTRY_POINT, None)
    if attn is None:
        raise ParallelError(
            f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} without meshwise's attention: "
            "call meshwise.parallel.context.context_parallel(model, topo) on the model first"
        )
    if position_ids is None:
        raise ParallelError(
            f"{type(module).__name__} runs under context parallel without position_ids: call the model with "
            "model(input_ids=batch['input'], position_ids=batch['positions'])"
        )
    if dropout:
        raise ParallelError(f"attention dropout {dropout} under context parallel is not supported: set it to 0")
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: each kv head serves `groups` query heads
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = attention(
        query,
        key,
        value,
        position_ids,
        attn.topology,
        dim=attn.dim,
        scale=scaling,
        kind=attn.kind,
        ring_above=attn.ring_above,
    )
    return out.transpose(1, 2).contiguous(), None


def _require_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("labels") is not None:
        # HF shifts labels inside the model, within this rank's chunk of each window: the chunk's last token
        # would be paired with the first of the next chunk it does not hold (2.2e-3 off one process, silently)
        raise ParallelError(
            f"{type(module).__name__} was called with labels= under context parallel, where each rank holds only "
            "chunks of every window and the model's own shift pairs tokens across chunk borders: shift the labels "
            "before the token split (a 'target' field, -100 where nothing is scored), call the model without "
            "labels, and train with loss_weight='labels' on its logits (docs/hf.md)"
        )
    if kwargs.get("position_ids") is None:
        raise ParallelError(
            f"{type(module).__name__} runs under context parallel: each rank holds only part of every window, so "
            "call it with its tokens' global positions, model(input_ids=..., position_ids=batch['positions'])"
        )


def hf_context_parallel(model: nn.Module, attn: Any) -> nn.Module:
    """Route a transformers model's attention through meshwise's context-parallel attention ``attn``.

    Registers :data:`ATTN_IMPLEMENTATION` with transformers' ``AttentionInterface`` (and the sdpa mask for it),
    points the config at it, and gives each attention module the ``context_attention`` entry point.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from meshwise.parallel.context import ENTRY_POINT

    AttentionInterface.register(ATTN_IMPLEMENTATION, _meshwise_cp_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    modules = [
        m
        for m in model.modules()
        if type(m).__module__.startswith("transformers.") and type(m).__name__.endswith("Attention")
    ]
    if not modules:
        raise ParallelError(f"{type(model).__name__} has no transformers attention module to route")
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        compat.set_attn_implementation(config, ATTN_IMPLEMENTATION)
    for m in modules:
        setattr(m, ENTRY_POINT, attn)
    model.register_forward_pre_hook(_require_position_ids, with_kwargs=True)
    return model
