"""A small GPT-style block stack built from Megatron-core's parallel layers, trained with meshwise on Megatron's groups.

    torchrun --nproc-per-node 4 examples/megatron/train.py --tp 2 --steps 4   # tp=2 x dp=2, checkpoints every 2
    torchrun --nproc-per-node 4 examples/megatron/train.py --tp 4 --steps 8   # resumes at tp=4 x dp=1
    python -m torch.distributed.run --nproc-per-node 1 examples/megatron/train.py --tp 1 --steps 8   # one process

The script is what a Megatron-core user already writes (``init_process_group``,
``parallel_state.initialize_model_parallel``, ``VocabParallelEmbedding``, column/row parallel linears,
``vocab_parallel_cross_entropy``, torch DDP over Megatron's data-parallel group), plus ``meshwise.megatron.adopt()``:
``mesh_dataloader`` feeds each rank its Megatron data-parallel rank's samples, ``create_trainer`` clips by the global
norm (Megatron's shards counted once), ignite's ``RunningAverage`` and ``Loss`` give one process's values, and
``Checkpointer`` saves whole named tensors, so a run resumes at another tp (docs/megatron.md). CPU/gloo or CUDA/NCCL.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import warnings

import torch
import torch.distributed as dist
from ignite.engine import Events
from ignite.metrics import Loss, RunningAverage
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import meshwise
import meshwise.megatron
from meshwise.data import ArrayDataset, mesh_dataloader
from meshwise.engine import Checkpointing

VOCAB, DIM, HEADS, SEQ, LAYERS = 64, 32, 4, 16, 2


class Block(nn.Module):
    """Pre-norm causal attention and MLP; heads and the MLP's hidden units are split over tp."""

    def __init__(self, config, tp: int) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        init = functools.partial(nn.init.normal_, mean=0.0, std=0.02)
        self.heads = HEADS // tp  # this rank's heads: the qkv rows are laid out head by head, q, k, v in each
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = ColumnParallelLinear(DIM, 3 * DIM, config=config, init_method=init, bias=True, gather_output=False)
        self.proj = RowParallelLinear(
            DIM, DIM, config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
        )
        self.up = ColumnParallelLinear(DIM, 4 * DIM, config=config, init_method=init, bias=True, gather_output=False)
        self.down = RowParallelLinear(
            4 * DIM, DIM, config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [seq, batch, dim], Megatron's layout
        s, b, _ = x.shape
        qkv, _ = self.qkv(self.norm1(x))
        q, k, v = qkv.view(s, b, self.heads, 3, DIM // HEADS).permute(3, 1, 2, 0, 4)  # each [batch, heads, seq, hd]
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out, _ = self.proj(att.permute(2, 0, 1, 3).reshape(s, b, -1))
        x = x + out
        h, _ = self.up(self.norm2(x))
        out, _ = self.down(nn.functional.gelu(h))
        return x + out


class TinyGPT(nn.Module):
    """Token embedding split over the vocabulary, blocks, and a vocabulary-split head: logits [seq, batch, vocab/tp]."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

        config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
        init = functools.partial(nn.init.normal_, mean=0.0, std=0.02)
        self.embed = VocabParallelEmbedding(VOCAB, DIM, init_method=init, config=config)
        self.pos = nn.Parameter(torch.zeros(SEQ, 1, DIM))
        self.blocks = nn.ModuleList(Block(config, tp) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = ColumnParallelLinear(DIM, VOCAB, config=config, init_method=init, bias=False, gather_output=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: [batch, seq]
        x = self.embed(tokens.t()) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits, _ = self.head(self.norm(x))
        return logits


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over vocabulary-split logits (the same value on every tp rank)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits.float(), target.t().contiguous()).mean()


def make_tokens(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Sequences counting up by a per-sequence stride (mod VOCAB): learnable from the first two tokens."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return {"input": seq[:, :-1], "target": seq[:, 1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="train until this many steps in all (resumes)")
    parser.add_argument("--dir", default="runs/megatron", help="checkpoints go to DIR/checkpoints")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

    from megatron.core import parallel_state

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    topo = meshwise.megatron.adopt()  # tp -> replica, dp -> batch: Megatron's own groups
    torch.manual_seed(0)  # Megatron's CPU initialisation draws each full weight, then keeps this rank's slice
    model = TinyGPT(args.tp).to(topo.device)
    if topo.size(topo.metric_dims) > 1:  # Megatron's layers do the tp communication; DDP averages over dp
        model = DistributedDataParallel(model, process_group=topo.group(topo.metric_dims))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    train = mesh_dataloader(ArrayDataset(make_tokens(512, 0)), topo, global_batch_size=32)
    val = mesh_dataloader(ArrayDataset(make_tokens(64, 1)), topo, global_batch_size=32, mode="eval")
    trainer = meshwise.create_trainer(model, opt, lm_loss, topo, grad_clip=1.0)
    RunningAverage(output_transform=lambda loss: loss).attach(trainer, "avg_loss")
    evaluator = meshwise.create_evaluator(model, topo, metrics={"loss": Loss(lm_loss)})
    ckpt = meshwise.Checkpointer(os.path.join(args.dir, "checkpoints"), topo)
    saving = Checkpointing(ckpt, every_iterations=2, model=model, optimizer=opt, loader=train).attach(trainer)

    @trainer.on(Events.ITERATION_COMPLETED)
    def log(engine) -> None:
        if topo.rank == 0:
            print(
                f"step {engine.state.iteration} loss {engine.state.output:.6f} grad_norm {engine.state.grad_norm:.6f}"
            )

    trainer.run(train, max_iters=args.steps)
    evaluator.run(val)
    ckpt.close()
    if topo.rank == 0:
        resumed = saving.resumed.step if saving.resumed is not None else None
        val_loss = evaluator.state.metrics["loss"]
        print(f"mesh {topo.layout.dims_text()} resumed_from {resumed} val_loss {val_loss:.6f}")
        assert math.isfinite(val_loss)
    meshwise.shutdown()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
