"""The tiny random float64 Llama the Hugging Face tests train, written once: its config, the seeded model (the
same full weights on every rank) and token batches with Hugging Face labels, shifted targets and -100."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
IGNORE = -100  # Hugging Face's and PyTorch's ignore_index


def config(layers: int = 2, tie: bool = False, vocab: int = VOCAB, **overrides: Any) -> Any:
    """A ``LlamaConfig`` small enough for 2 cores: 4 heads over 2 key/value heads, so tp=2 splits both."""
    from transformers import LlamaConfig

    sizes: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "intermediate_size": 64,
        "tie_word_embeddings": tie,
    }
    return LlamaConfig(**{**sizes, **overrides})


def llama(layers: int = 2, tie: bool = False, seed: int = 0, **overrides: Any) -> Any:
    """A ``LlamaForCausalLM`` in float64 with weights drawn from ``seed`` (identical on every rank)."""
    from transformers import LlamaForCausalLM

    cfg = config(layers, tie, **overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.float64)


def shift(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's own shift of causal-LM ``labels`` (``ForCausalLMLoss``): label ``t + 1`` scores logit ``t``,
    ``-100`` after the last token. Targets shifted before a token split keep every pair on one rank."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1)


def batches(
    steps: int,
    rows: int,
    length: int,
    seed: int,
    vocab: int = VOCAB,
    ignore: bool = False,
    scored: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """``steps`` global batches: ``input`` ids (rows, length), ``labels`` as a Hugging Face script passes them
    (the ids, ``-100`` where nothing is scored) and ``target`` = :func:`shift` of them.

    With ``ignore`` the rows lose more labels the later they come (row 0 none, the last about 80%), and on
    even steps rows 2-3 score nothing, so per-rank and per-micro-batch means all differ from the global one.
    With ``scored`` exactly that many labels of each global batch are scored, the earlier rows holding more.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (rows, length), generator=g)
        labels = ids.clone()
        if ignore:
            drop = torch.rand(rows, length, generator=g) < torch.linspace(0.0, 0.8, rows)[:, None]
            labels[drop] = IGNORE
            if step % 2 == 0 and rows >= 4:
                labels[2:4] = IGNORE
        if scored is not None:
            # the smallest keys are kept: row r's keys are stretched by r + 1; label 0 is shifted out anyway
            key = torch.rand(rows, length, generator=g) * torch.arange(1, rows + 1)[:, None]
            key[:, 0] = float("inf")
            drop = torch.ones(rows * length, dtype=torch.bool)
            drop[key.flatten().argsort()[:scored]] = False
            labels[drop.view(rows, length)] = IGNORE
        out.append({"input": ids, "labels": labels, "target": shift(labels)})
    return out
