"""A nanoGPT-sized GPT in one readable file, and its Megatron-style tensor-parallel plan.

The model is plain PyTorch (no parallel code inside). ``tp_plan`` says how torch's ``parallelize_module``
shards it: q/k/v and MLP-in column-wise, attention-out and MLP-out row-wise, the head column-wise with
vocab-sharded logits for ``loss_parallel()``. Attention reshapes with ``-1`` heads, so each tensor-parallel
rank runs the heads it holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Model size. ``vocab_size`` 256 is byte-level text; ``n_head`` and ``vocab_size`` must divide by tp."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0  # 0 keeps a tensor-parallel run comparable to one process (docs/torch.md, random numbers)
    bias: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}: change one of them")
        self.head_dim = cfg.d_model // cfg.n_head
        # Separate q/k/v projections so each can be sharded column-wise on its own: a fused qkv weight
        # sharded on dim 0 would give a rank some q, some k and some v columns of different heads.
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    # Set by meshwise.parallel.context_parallel: attention over a window split across ranks (context parallel).
    context_attention = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism the local q/k/v hold n_head / tp heads.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.context_attention is not None:  # this rank holds part of the window: it attends to earlier ranks'
            y = self.context_attention(q, k, v, positions)
        else:
            dropout = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.out(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), positions))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` pre-norm blocks, a final LayerNorm and an untied head.

    The head is not tied to the embedding: a tied weight would have to be sharded two ways at once.
    ``forward(idx)`` returns logits ``[B, T, vocab]`` (a vocab-sharded DTensor under the TP plan). A piece
    that is None (held by another pipeline stage) is skipped, so each stage runs only its own pieces.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation; residual projections scaled by 1/sqrt(2 n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith(("out.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the global position of each token when the window is split (context parallel)."""
        # Pipeline stages (meshwise.parallelize over a pp dim) hold some pieces only; the others are None:
        # the first stage embeds token ids, later ones get the previous stage's activations [B, T, d_model].
        x = idx
        if self.tok_emb is not None:
            T = idx.shape[1]
            if T > self.cfg.block_size:
                raise ValueError(f"sequence of {T} tokens is longer than block_size {self.cfg.block_size}")
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device) if positions is None else positions)
            if self.drop is not None:
                x = self.drop(x)
        for block in self.blocks:
            x = block(x, positions)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return x if self.head is None else self.head(x)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def tp_plan(model: GPT) -> dict:
    """The Megatron plan for ``parallelize_module`` (module path -> ParallelStyle).

    Column-wise layers keep their output sharded on the feature dim, so the next row-wise layer consumes
    it without communication; the row-wise layer all-reduces once per attention and once per MLP.
    Embeddings and LayerNorms stay replicated. Compute the loss under ``loss_parallel()``.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict = {}
    for i in range(len(model.blocks)):
        prefix = f"blocks.{i}"
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("attn.out", "mlp.proj"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def check_tp_degree(cfg: GPTConfig, tp: int) -> None:
    """Fail early, with what to change, when the model cannot be split ``tp`` ways."""
    from meshwise.errors import ParallelError

    for what, n in (("n_head", cfg.n_head), ("vocab_size", cfg.vocab_size), ("4*d_model", 4 * cfg.d_model)):
        if n % tp:
            raise ParallelError(
                f"{what}={n} is not divisible by the tensor-parallel degree {tp}: change the "
                f"model size or the tp size of the mesh"
            )


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy per token; works on vocab-sharded DTensor logits inside ``loss_parallel()``."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1).long())
