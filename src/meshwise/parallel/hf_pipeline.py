"""Pipeline stages of a Hugging Face decoder-only model (``LlamaForCausalLM`` and kin): the pieces a cut may
separate (``model.embed_tokens``, ``model.layers.0`` ... ``model.norm``, ``lm_head``) and the stage module
that runs its share of them, keeping the full model's parameter names."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from meshwise import compat
from meshwise.errors import ParallelError
from meshwise.parallel.hf import is_hf_model

__all__ = ["HFDecoderStage", "hf_decoder_parts", "hf_default_cuts", "hf_stage", "hf_units"]


def _part_names(model: nn.Module) -> tuple[str, str, str, str, str] | None:
    """(base prefix, embeddings, layers, norm, head) of a decoder-only model, or None if it is not one.

    The names come from ``config.base_model_pp_plan`` (transformers' pipeline plan: embed, layers, norm, in
    order) and the class's ``_pp_plan`` (the head), so a model that names its pieces differently still cuts.
    """
    if not is_hf_model(model):
        return None
    prefix = model.base_model_prefix
    base = getattr(model, prefix, None) if prefix else None
    plan = dict(getattr(model.config, "base_model_pp_plan", None) or {})
    heads = list(compat.hf_class_pp_plan(type(model)))
    if not isinstance(base, nn.Module) or base is model or len(plan) != 3 or len(heads) != 1:
        return None
    embed, layers, norm = plan
    if not isinstance(getattr(base, layers, None), nn.ModuleList):
        return None
    return prefix, embed, layers, norm, heads[0]


def hf_decoder_parts(model: nn.Module) -> tuple[str, str, str, str, str] | None:
    """:func:`_part_names` of ``model``; a model whose pieces a stage cannot hold apart raises."""
    parts = _part_names(model)
    if parts is not None and getattr(model.config, "tie_word_embeddings", False):
        prefix, embed, _, _, head = parts
        raise ParallelError(
            f"{type(model).__name__} ties {head}.weight to {prefix}.{embed}.weight, but pipeline stages put the "
            "embeddings on the first stage and the head on the last, so the tied weight would split into two "
            "copies: build the model with tie_word_embeddings=False (config) to cut it into stages"
        )
    return parts


def hf_units(model: nn.Module) -> list[str]:
    """The pieces of a decoder-only model a cut may separate, in order (``model.layers.k`` one per layer)."""
    prefix, embed, layers, norm, head = hf_decoder_parts(model)  # type: ignore[misc]
    blocks = [f"{prefix}.{layers}.{k}" for k, _ in getattr(model, prefix).get_submodule(layers).named_children()]
    return [f"{prefix}.{embed}", *blocks, f"{prefix}.{norm}", head]


def hf_default_cuts(model: nn.Module, stages: int) -> list[str]:
    """The decoder layers cut into ``stages`` equal runs: embeddings go first, norm and head last."""
    prefix, _, layers, _, _ = hf_decoder_parts(model)  # type: ignore[misc]
    blocks = [u for u in hf_units(model) if u.startswith(f"{prefix}.{layers}.")]
    if stages > len(blocks):
        raise ParallelError(
            f"{stages} pipeline stages but {type(model).__name__} has {len(blocks)} decoder layers to share out: "
            "use fewer stages (a smaller pp, or fewer stages_per_rank) or a model with more layers"
        )
    return [blocks[i * len(blocks) // stages] for i in range(1, stages)]


class HFDecoderStage(nn.Module):
    """One pipeline stage of a decoder-only model: a pruned copy of it, under the full model's names.

    ``forward`` takes input ids on the first stage (hidden states on the others) and returns hidden states,
    or logits on the last stage. Every stage recomputes the rotary position embeddings from the positions
    ``0 .. T-1`` (cheap, and nothing but hidden states travels between stages) and the causal mask.
    """

    def __init__(self, model: nn.Module, keep: set[str], parts: tuple[str, str, str, str, str]) -> None:
        super().__init__()
        prefix, embed, layers, norm, head = parts
        self.parts = parts
        stage = copy.deepcopy(model)
        base = getattr(stage, prefix)
        block_list = base.get_submodule(layers)
        for key in [k for k, _ in block_list.named_children() if f"{prefix}.{layers}.{k}" not in keep]:
            delattr(block_list, key)  # del list[i] would renumber the layers that follow (and their names)
        for name in (embed, norm):
            if f"{prefix}.{name}" not in keep:
                setattr(base, name, None)
        # children under the full model's names: parameters read as "model.layers.2.mlp.up_proj.weight"
        self.add_module(prefix, base)
        self.add_module(head, getattr(stage, head) if head in keep else None)

    def pieces(self) -> list[tuple[str, nn.Module]]:
        """(full name, module) of each piece this stage holds, rotary embeddings included."""
        prefix, embed, layers, norm, head = self.parts
        base = getattr(self, prefix)
        out = [(f"{prefix}.{n}", m) for n, m in base.named_children() if m is not None and n != layers]
        out += [(f"{prefix}.{layers}.{k}", m) for k, m in base.get_submodule(layers).named_children()]
        if getattr(self, head) is not None:
            out.append((head, getattr(self, head)))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        prefix, embed, layers, norm, head = self.parts
        base = getattr(self, prefix)
        hidden = getattr(base, embed)(x) if getattr(base, embed) is not None else x
        rows, length = hidden.shape[:2]
        positions = torch.arange(length, device=hidden.device).unsqueeze(0).expand(rows, -1)
        mask = create_causal_mask(
            config=base.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
        )
        rope = base.rotary_emb(hidden, position_ids=positions) if hasattr(base, "rotary_emb") else None
        kw: dict[str, Any] = {"attention_mask": mask, "position_ids": positions, "position_embeddings": rope}
        for layer in base.get_submodule(layers):
            hidden = layer(hidden, **kw)
        if getattr(base, norm) is not None:
            hidden = getattr(base, norm)(hidden)
        return hidden if getattr(self, head) is None else getattr(self, head)(hidden)


def hf_stage(model: nn.Module, keep: set[str]) -> HFDecoderStage:
    """The stage of ``model`` holding the units in ``keep`` (names from :func:`hf_units`)."""
    return HFDecoderStage(model, keep, hf_decoder_parts(model))  # type: ignore[arg-type]
