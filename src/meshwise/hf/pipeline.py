"""Pipeline stages of a Hugging Face decoder-only model (``LlamaForCausalLM`` and kin): the pieces a cut may
separate (``model.embed_tokens``, ``model.layers.0`` ... ``model.norm``, ``lm_head``) and the stage module
that runs its share of them, keeping the full model's parameter names."""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
from torch import nn

from meshwise import compat
from meshwise.errors import ParallelError
from meshwise.hf.plans import is_hf_model

__all__ = [
    "DECODER_CUTTER",
    "HFDecoderStage",
    "check_pieces",
    "hf_decoder_parts",
    "hf_default_cuts",
    "hf_stage",
    "hf_units",
]


Parts = tuple[str, tuple[str, ...], str, tuple[str, ...], str]


def _part_names(model: nn.Module) -> Parts | None:
    """(base prefix, pieces before the layers, layers, pieces after them, head) of a decoder-only model, or None.

    The names come from ``config.base_model_pp_plan`` (transformers' pipeline plan, in order: the embeddings and
    what follows them, e.g. GPT-NeoX's ``emb_dropout``; the layer list; the final norm and what follows it) and
    the class's ``_pp_plan`` (the head), so a model that names its pieces differently still cuts.
    """
    if not is_hf_model(model):
        return None
    prefix = model.base_model_prefix
    base = getattr(model, prefix, None) if prefix else None
    plan = list(getattr(model.config, "base_model_pp_plan", None) or {})
    heads = list(compat.hf_class_pp_plan(type(model)))
    if not isinstance(base, nn.Module) or base is model or len(heads) != 1:
        return None
    lists = [k for k, name in enumerate(plan) if isinstance(getattr(base, name, None), nn.ModuleList)]
    if len(lists) != 1 or lists[0] == 0 or not all(isinstance(getattr(base, n, None), nn.Module) for n in plan):
        return None
    k = lists[0]
    return prefix, tuple(plan[:k]), plan[k], tuple(plan[k + 1 :]), heads[0]


def hf_decoder_parts(model: nn.Module) -> Parts | None:
    """:func:`_part_names` of ``model``: None for a model not from transformers; a transformers model whose
    pieces meshwise cannot lay out as a decoder raises (its own forward calls every piece, so no stage of it
    could run)."""
    parts = _part_names(model)
    if parts is None and is_hf_model(model):
        plan = dict(getattr(model.config, "base_model_pp_plan", None) or {})
        raise ParallelError(
            f"{type(model).__name__} is a transformers model whose pipeline plan meshwise cannot follow "
            f"(config.base_model_pp_plan={list(plan)}, head plan {list(compat.hf_class_pp_plan(type(model)))}; "
            "meshwise needs embeddings, one layer list, a norm and one head): its own forward calls every piece, "
            "so a stage holding some of them would fail ('NoneType' object is not callable). Train it without a "
            "pp dim (dp, tp, cp), or wrap its pieces in a model whose forward skips the pieces a stage does not "
            "hold (docs/pipeline.md)"
        )
    return parts


def hf_units(model: nn.Module) -> list[str]:
    """The pieces of a decoder-only model a cut may separate, in order (``model.layers.k`` one per layer)."""
    prefix, pre, layers, post, head = hf_decoder_parts(model)  # type: ignore[misc]
    blocks = [f"{prefix}.{layers}.{k}" for k, _ in getattr(model, prefix).get_submodule(layers).named_children()]
    return [*(f"{prefix}.{n}" for n in pre), *blocks, *(f"{prefix}.{n}" for n in post), head]


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
    ``0 .. T-1`` (cheap, and nothing but hidden states travels between stages) and the causal mask. A parameter
    tied across stages (``tie_word_embeddings=True``) is a copy on each: the trainer sums its gradients
    (:mod:`meshwise.parallel.pipeline_shared`).
    """

    def __init__(self, model: nn.Module, keep: set[str], parts: Parts) -> None:
        super().__init__()
        prefix, pre, layers, post, head = parts
        self.parts = parts
        stage = copy.deepcopy(model)
        base = getattr(stage, prefix)
        block_list = base.get_submodule(layers)
        for key in [k for k, _ in block_list.named_children() if f"{prefix}.{layers}.{k}" not in keep]:
            delattr(block_list, key)  # del list[i] would renumber the layers that follow (and their names)
        for name in (*pre, *post):
            if f"{prefix}.{name}" not in keep:
                setattr(base, name, None)
        # children under the full model's names: parameters read as "model.layers.2.mlp.up_proj.weight"
        self.add_module(prefix, base)
        self.add_module(head, getattr(stage, head) if head in keep else None)

    def pieces(self) -> list[tuple[str, nn.Module]]:
        """(full name, module) of each piece this stage holds, rotary embeddings included."""
        prefix, _, layers, _, head = self.parts
        base = getattr(self, prefix)
        out = [(f"{prefix}.{n}", m) for n, m in base.named_children() if m is not None and n != layers]
        out += [(f"{prefix}.{layers}.{k}", m) for k, m in base.get_submodule(layers).named_children()]
        if getattr(self, head) is not None:
            out.append((head, getattr(self, head)))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        prefix, pre, layers, post, head = self.parts
        base = getattr(self, prefix)
        hidden = x
        for name in pre:  # the embeddings take ids, what follows them (dropout) hidden states
            if getattr(base, name) is not None:
                hidden = getattr(base, name)(hidden)
        rows, length = hidden.shape[:2]
        positions = torch.arange(length, device=hidden.device).unsqueeze(0).expand(rows, -1)
        mask = create_causal_mask(
            config=base.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
        )
        rope = base.rotary_emb(hidden, position_ids=positions) if hasattr(base, "rotary_emb") else None
        kw: dict[str, Any] = {"attention_mask": mask, "position_ids": positions, "position_embeddings": rope}
        for layer in base.get_submodule(layers):
            hidden = layer(hidden, **kw)
        for name in post:
            if getattr(base, name) is not None:
                hidden = getattr(base, name)(hidden)
        return hidden if getattr(self, head) is None else getattr(self, head)(hidden)


def hf_stage(model: nn.Module, keep: set[str]) -> HFDecoderStage:
    """The stage of ``model`` holding the units in ``keep`` (names from :func:`hf_units`)."""
    return HFDecoderStage(model, keep, hf_decoder_parts(model))  # type: ignore[arg-type]


def check_pieces(model: nn.Module) -> None:
    """Refuse a decoder whose own forward computes more than its pieces in a row do (what every stage runs):
    Cohere's ``logit_scale``, Gemma2's final logit softcapping, a layer fed more than hidden states, mask and
    rotary positions. Proven in this process on a fixed 8-token window (eval mode, RNG state restored, the same on
    every rank): the model's logits against the pieces' (embeddings, layers, norm, head). Not on the meta device."""
    parts = hf_decoder_parts(model)
    params = list(model.parameters())
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if parts is None or not params or any(p.device.type == "meta" for p in params) or vocab < 16:
        return
    prefix, _, _, _, head = parts
    ids = ((torch.arange(8, device=params[0].device) * 5 + 3) % (vocab - 3) + 3)[None]
    whole = types.SimpleNamespace(parts=parts, **{prefix: getattr(model, prefix), head: getattr(model, head)})
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            out = model(input_ids=ids)
            own = (out if isinstance(out, torch.Tensor) else out.logits).double()
            try:
                pieces = HFDecoderStage.forward(whole, ids).double()  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - the model runs, its pieces do not: each stage would fail
                raise ParallelError(
                    f"{type(model).__name__}'s pipeline pieces do not run on their own ({type(exc).__name__}: "
                    f"{exc}), while its own forward does: a stage would fail on its rank alone and leave the others "
                    "waiting (e.g. rotary embeddings per layer type, config.layer_types with sliding and full "
                    "attention). Train it without a pp dim (dp, tp, cp)"
                ) from exc
    except ParallelError:
        raise
    except Exception:  # noqa: BLE001 - a model whose own forward fails here is judged at its first step
        return
    finally:
        for m, training in modes.items():
            m.train(training)
    diff = (own - pieces).abs().max().item() if own.shape == pieces.shape else float("inf")
    if diff > 1e-6 * (1.0 + own.abs().max().item()):
        raise ParallelError(
            f"{type(model).__name__}'s own forward computes more than its pipeline pieces in a row "
            f"({[prefix, head]}: embeddings, layers, norm, head), so its stages would train another model (their "
            f"logits {diff:.1e} off its own on a test window: e.g. a logit scale or softcap after the head, or "
            "layers fed more than hidden states, mask and rotary positions). Train it without a pp dim (dp, tp, cp)"
        )


class _DecoderCutter:
    """The :class:`~meshwise.parallel.stages.StageCutter` of transformers decoder-only models."""

    def claims(self, model: nn.Module) -> bool:
        return hf_decoder_parts(model) is not None

    def units(self, model: nn.Module) -> list[str]:
        check_pieces(model)
        return hf_units(model)

    def default_cuts(self, model: nn.Module, stages: int) -> list[str]:
        return hf_default_cuts(model, stages)

    def stage(self, model: nn.Module, keep: set[str]) -> nn.Module:
        return hf_stage(model, keep)


DECODER_CUTTER = _DecoderCutter()
"""Registered with :func:`meshwise.parallel.stages.on_stage_cutter` by :mod:`meshwise.hf`."""
