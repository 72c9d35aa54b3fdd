"""Hugging Face integration: everything that knows transformers, safetensors or datasets by name lives here.

:mod:`~meshwise.hf.plans` (a model's own tensor-parallel plan as torch styles, the plan strings refused),
:mod:`~meshwise.hf.attention` (context parallel through transformers' ``AttentionInterface``),
:mod:`~meshwise.hf.pipeline` (pipeline stages of decoder-only models), and :mod:`~meshwise.hf.folder` (safetensors
folders in and out: :func:`load_hf`, :func:`export_hf`).

The core never imports this package: it offers hooks (``tp_plan="auto"`` readers, stage cutters, attention
routers) and loads this package with importlib when ``transformers`` is in ``sys.modules``, as it loads
:mod:`meshwise.physicsnemo`. Importing it registers the hooks below, once. The ``datasets`` sources are still read
by :mod:`meshwise.data` itself (recognised by their class names, without importing ``datasets``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshwise.hf.attention import ROUTER, hf_context_parallel
from meshwise.hf.folder import export_hf, load_hf
from meshwise.hf.pipeline import DECODER_CUTTER
from meshwise.hf.plans import hf_tp_plan, is_hf_model
from meshwise.parallel.context import on_attention_router
from meshwise.parallel.stages import on_stage_cutter
from meshwise.parallel.tp_plan import on_auto_plan

__all__ = ["export_hf", "hf_context_parallel", "hf_tp_plan", "is_hf_model", "load_hf"]


def _auto_plan(model: nn.Module, tp: int) -> dict[str, Any] | None:
    """``tp_plan="auto"`` for a transformers model: its own plan translated (None: not a transformers model)."""
    return hf_tp_plan(model, tp) if is_hf_model(model) else None


on_auto_plan(_auto_plan)
on_stage_cutter(DECODER_CUTTER)
on_attention_router(ROUTER)
