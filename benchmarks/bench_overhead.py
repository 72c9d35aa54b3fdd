"""Overhead of ``meshwise.create_trainer`` against a hand-written torch loop doing the same work.

Both train the same small transformer (TP plan + FSDP2 at dp=2 x tp=2, plain in one process); the hand
loop does zero_grad, forward, loss, backward, an all-reduce of the loss over the data group, step and
``.item()``. Blocks of steps alternate (trainer, loop, trainer, ...) so machine load hits both alike;
the ratio is median per-step time (trainer) / median per-step time (loop) over all blocks; the median of
the ratios of neighbouring blocks is printed beside it as a check on the noise.
Run: ``.venv/bin/python benchmarks/bench_overhead.py`` (``--blocks`` and ``--steps`` change the length).
Final line: ``RESULT overhead_ratio_2x2=… overhead_ratio_1=…``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS, T, OUT, LOCAL_BATCH = 64, 4, 16, 64, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(b, t, -1, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cols = {f"blocks.*.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc1")}
    return {**cols, "blocks.*.o": RowwiseParallel(), "blocks.*.fc2": RowwiseParallel()}


def build(topo) -> tuple[nn.Module, torch.optim.Optimizer]:
    import meshwise

    torch.manual_seed(0)
    tp = topo.size(topo.replica_dims)
    model = meshwise.parallelize(Net(), topo, tp_plan=plan() if tp > 1 else None, dp="fsdp")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def measure(topo, blocks: int, steps: int) -> dict:
    import torch.distributed as dist

    import meshwise

    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(topo.data_rank)
    data = [
        {"input": torch.randn(LOCAL_BATCH, T, D, generator=g), "target": torch.randn(LOCAL_BATCH, T, OUT, generator=g)}
        for _ in range(steps)
    ]
    model_a, opt_a = build(topo)
    trainer = meshwise.create_trainer(model_a, opt_a, F.mse_loss, topo)
    model_b, opt_b = build(topo)
    data_size = topo.size(topo.metric_dims)
    group = topo.group(topo.metric_dims) if data_size > 1 else None

    def hand_loop(batches: list[dict]) -> None:
        model_b.train()
        for batch in batches:
            opt_b.zero_grad(set_to_none=True)
            loss = F.mse_loss(model_b(batch["input"]), batch["target"])
            loss.backward()
            value = loss.detach().clone()
            if group is not None:
                dist.all_reduce(value, group=group)
                value /= data_size
            opt_b.step()
            value.item()

    def timed(fn) -> float:
        if topo.world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        fn()
        if topo.world_size > 1:
            dist.barrier()
        return (time.perf_counter() - start) / steps

    trainer.run(data[:2], max_epochs=1)  # warm-up both
    hand_loop(data[:2])
    ours, theirs = [], []
    for i in range(blocks):
        order = [("ours", lambda: trainer.run(data, max_epochs=1)), ("theirs", lambda: hand_loop(data))]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            (ours if name == "ours" else theirs).append(timed(fn))
    ratios = [a / b for a, b in zip(ours, theirs)]  # neighbouring blocks see about the same machine load
    return {
        "trainer_s": statistics.median(ours),
        "loop_s": statistics.median(theirs),
        "ratio": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12, help="alternating blocks per implementation")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per block (x4 in one process)")
    args = parser.parse_args()
    from meshwise.testing import run_distributed

    multi = run_distributed(measure, 4, args.blocks, args.steps, mesh={"dp": 2, "tp": 2}, timeout=600)[0]
    torch.set_num_threads(1)  # as each of the 4 ranks runs
    single = run_distributed(measure, 1, args.blocks, args.steps * 4, mesh={"dp": 1}, timeout=300)[0]
    rows = [("dp=2 x tp=2 (4 procs)", multi), ("1 process", single)]
    print(f"{'mesh':<22} {'create_trainer ms':>18} {'hand loop ms':>13} {'ratio':>7} {'paired ratio':>13}")
    for name, r in rows:
        ratio = r["trainer_s"] / r["loop_s"]
        print(f"{name:<22} {r['trainer_s'] * 1e3:>18.2f} {r['loop_s'] * 1e3:>13.2f} {ratio:>7.3f} {r['ratio']:>13.3f}")
    print(
        f"RESULT overhead_ratio_2x2={multi['trainer_s'] / multi['loop_s']:.3f} "
        f"overhead_ratio_1={single['trainer_s'] / single['loop_s']:.3f}"
    )


if __name__ == "__main__":
    main()
