"""Overhead of ``meshwise.create_trainer`` against a hand-written torch loop doing the same work.

Both train the same small transformer, in fact the same model and optimizer objects (TP plan + FSDP2 at
dp=2 x tp=2, plain in one process); the hand
loop does zero_grad, forward, loss, backward, an all-reduce of the loss over the data group, step and
``.item()``. Steps alternate (trainer, loop, loop, trainer, ...; each a ``trainer.run`` of one batch, so the
trainer also pays ignite's per-run set-up) so machine load hits both alike;
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


def workload(topo, steps: int):
    """Each data rank's ``steps`` batches, one model and optimizer, the trainer over them, and the hand loop
    doing the same work; one model and optimizer for both, so memory layout and parameter values cannot
    favour either side. Also used by bench_debug.py."""
    import torch.distributed as dist

    import meshwise

    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(topo.data_rank)
    data = [
        {"input": torch.randn(LOCAL_BATCH, T, D, generator=g), "target": torch.randn(LOCAL_BATCH, T, OUT, generator=g)}
        for _ in range(steps)
    ]
    model_b, opt_b = build(topo)
    trainer = meshwise.create_trainer(model_b, opt_b, F.mse_loss, topo)
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

    return data, trainer, hand_loop


def measure(topo, blocks: int, steps: int) -> dict:
    import torch.distributed as dist

    data, trainer, hand_loop = workload(topo, steps)

    def timed(fn) -> float:
        if topo.world_size > 1:
            dist.barrier()
        start = time.perf_counter()  # from an aligned start to this rank's end of the step(s)
        fn()
        return (time.perf_counter() - start) / steps

    for _ in range(3):  # warm-up both
        trainer.run(data, max_epochs=1)
        hand_loop(data)
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


def framework_cost(topo, pairs: int = 400) -> dict:
    """Per-step cost of the trainer itself: both sides train a 4x4 linear layer, so almost all is overhead."""
    import meshwise

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo)
    batch = [{"input": torch.randn(8, 4), "target": torch.randn(8, 4)}]

    def hand_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(batch[0]["input"]), batch[0]["target"])
        loss.backward()
        value = loss.detach().clone()
        opt.step()
        value.item()

    ours, theirs = [], []
    for i in range(pairs):
        for name in ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours"):
            start = time.perf_counter()
            trainer.run(batch, max_epochs=1) if name == "ours" else hand_step()
            (ours if name == "ours" else theirs).append(time.perf_counter() - start)
    return {"trainer_us": statistics.median(ours) * 1e6, "loop_us": statistics.median(theirs) * 1e6}


def measure_single(topo, blocks: int, steps: int) -> dict:
    return {**measure(topo, blocks, steps), **framework_cost(topo)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=60, help="alternating blocks per implementation (x4 in 1 proc)")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per block")
    args = parser.parse_args()
    from meshwise.testing import run_distributed

    multi = run_distributed(measure, 4, args.blocks, args.steps, mesh={"dp": 2, "tp": 2}, timeout=600)[0]
    torch.set_num_threads(1)  # as each of the 4 ranks runs
    single = run_distributed(measure_single, 1, args.blocks * 4, args.steps, mesh={"dp": 1}, timeout=300)[0]
    rows = [("dp=2 x tp=2 (4 procs)", multi), ("1 process", single)]
    print(f"{'mesh':<22} {'create_trainer ms':>18} {'hand loop ms':>13} {'ratio':>7} {'paired ratio':>13}")
    for name, r in rows:
        ratio = r["trainer_s"] / r["loop_s"]
        print(f"{name:<22} {r['trainer_s'] * 1e3:>18.2f} {r['loop_s'] * 1e3:>13.2f} {ratio:>7.3f} {r['ratio']:>13.3f}")
    cost = single["trainer_us"] - single["loop_us"]
    print(
        f"framework cost (4x4 linear, 1 process): create_trainer {single['trainer_us']:.0f} us/step, "
        f"hand loop {single['loop_us']:.0f} us/step -> {cost:.0f} us/step, i.e. "
        f"{cost / (multi['loop_s'] * 1e6):.2%} of a dp=2 x tp=2 step and {cost / (single['loop_s'] * 1e6):.2%} "
        "of a one-process step above"
    )
    print(
        f"RESULT overhead_ratio_2x2={multi['trainer_s'] / multi['loop_s']:.3f} "
        f"overhead_ratio_1={single['trainer_s'] / single['loop_s']:.3f} overhead_us_per_step={cost:.0f}"
    )


if __name__ == "__main__":
    main()
