"""Every causal-LM family of the installed transformers, built tiny in float64: the auto mapping's model types,
one shrunken config each (the size fields the config has, set so that tp=2 divides them), the seeded model, the
data every road trains on and the one-process run each road is compared against."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH, T, STEPS, LR, EPS, VOCAB, LAYERS = 4, 8, 2, 1e-2, 1e-6, 64, 2
MAX_PARAMS = 2_000_000  # a config whose size fields were not all found stays large: skipped, not run
# EPS: AdamW divides by sqrt(v) + eps; 1e-6 keeps it from turning 1e-18 summation-order noise into 1e-2 steps

SIZES: dict[str, Any] = {  # every name a config may give these sizes; only the fields a config has are set
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "n_embed", "embed_dim", "model_dim"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim"), 64),
    **dict.fromkeys(("encoder_layers",), LAYERS),
    **dict.fromkeys(("encoder_attention_heads",), 4),
    **dict.fromkeys(("encoder_ffn_dim",), 64),
    "head_dim": 8,
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"), 64),
    "tie_word_embeddings": False,  # untied everywhere: a pipeline cut refuses tied embeddings
    "is_decoder": True,  # encoder families' causal-LM heads
    # mixtures of experts
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "moe_k"), 2),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size"), 16),
    **dict.fromkeys(("shared_expert_intermediate_size",), 32),
    "n_group": 1,
    "topk_group": 1,
    # latent attention (DeepSeek and kin)
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    # state-space and linear-attention families
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size"), 8),
    **dict.fromkeys(("mamba_n_heads", "linear_num_value_heads", "linear_num_key_heads", "linear_num_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 8),
    "time_step_rank": 4,
    "sliding_window": 4096,  # longer than every window: no band the all-gather would have to know about
    "rotary_dim": 4,  # GPT-J, CodeGen: rotary on part of each 8-wide head
    "attention_types": [[["global", "local"], LAYERS // 2]],  # GPT-Neo: one global and one local layer
    **dict.fromkeys(("index_head_dim",), 8),
    **dict.fromkeys(("index_n_heads",), 4),
    "moe_top_k": 2,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
PARTS = ("attn_config", "ffn_config")  # sub-configs of one text model (MPT, DBRX), shrunk like the rest
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")


def causal_lm_types() -> dict[str, str]:
    """``model_type -> class name`` of the installed transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def tiny_config(model_type: str) -> Any:
    """The family's config with every size field it has shrunk, dropouts 0 and token ids inside the vocabulary.
    Raises ``Skip`` where the config cannot be made a small text-only one."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    subs = getattr(cls, "sub_configs", None) or {}
    other = sorted(set(subs) - set(PARTS))
    if other:
        raise Skip(f"composite config ({', '.join(other)}): not a text-only causal LM config")
    kwargs = _shrunk(cls)
    for name in subs:
        kwargs[name] = subs[name](**_shrunk(subs[name]))
    return cls(**kwargs)


def _shrunk(cls: Any) -> dict[str, Any]:
    """The keyword arguments that shrink config class ``cls``: the size fields it has, per-layer lists cut to
    LAYERS entries, dropouts 0, token ids inside the vocabulary."""
    fields = cls().to_dict()
    known = set(fields) | set(getattr(cls, "attribute_map", {}) or {})
    kwargs = {k: v for k, v in SIZES.items() if k in known}
    if "qk_rope_head_dim" in known:
        kwargs.pop("head_dim", None)  # latent attention: its heads are qk_nope + qk_rope wide
    layers = next((fields[k] for k in LAYER_COUNTS if isinstance(fields.get(k), int)), None)
    for key, value in fields.items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key.endswith("_drop")):
            kwargs[key] = 0.0
        if key in TOKEN_IDS and isinstance(value, int) and value >= VOCAB:
            kwargs[key] = min(VOCAB - 1, 2)
        if key in kwargs or not isinstance(value, list) or not value:
            continue
        if key == "layer_types" or (layers and len(value) == layers):
            kwargs[key] = _per_layer(value)
        elif key.endswith("_layers") and all(isinstance(i, int) for i in value):
            kwargs[key] = [i for i in value if i < LAYERS]  # layer numbers
    if "first_k_dense_replace" in known:
        kwargs["first_k_dense_replace"] = 1  # one dense layer, one sparse
    return kwargs


def _per_layer(value: list) -> list:
    """A per-layer list cut to LAYERS entries that keeps each kind it has, as far as LAYERS allows (a hybrid's
    first layers may all be linear attention)."""
    kinds = list(dict.fromkeys(v for v in value if isinstance(v, str)))
    if len(kinds) < 2:
        return value[:LAYERS]
    return (kinds + value)[:LAYERS]


class Skip(Exception):
    """The family is not run: its reason is the message."""


def build(model_type: str, seed: int = 0) -> nn.Module:
    """The family's causal LM from its tiny config, in float64, the same weights on every rank (``seed``)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with torch.device("meta"):
        count = sum(p.numel() for p in _from_config(AutoModelForCausalLM, config).parameters())
    if count > MAX_PARAMS:
        raise Skip(f"the tiny config still has {count:,} parameters (a size field sweep does not know)")
    torch.manual_seed(seed)
    return _from_config(AutoModelForCausalLM, config).to(torch.float64)


def _from_config(auto: Any, config: Any) -> nn.Module:
    try:  # float64 experts on CPU: transformers' grouped kernels do not take it
        return auto.from_config(config, experts_implementation="eager")
    except (TypeError, ValueError):
        return auto.from_config(config)


def windows() -> list[torch.Tensor]:
    """STEPS global batches of BATCH token windows of T + 1 tokens (input = [:, :-1], target = [:, 1:])."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (BATCH, T + 1), generator=g) for _ in range(STEPS)]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def logits_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def one_process(model_type: str) -> dict[str, torch.Tensor]:
    """The reference: the whole global batches in one process, AdamW, STEPS steps; the trained parameters."""
    model = build(model_type)
    if "position_ids" not in inspect.signature(model.forward).parameters:
        pass  # the context-parallel road reports it
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for w in windows():
        loss = loss_fn(logits_of(model(input_ids=w[:, :-1])), w[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
