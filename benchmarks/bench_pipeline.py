"""Pipeline stages at pp=4: bytes each stage reads, and the trainer's step time against a hand-written
``torch.distributed.pipelining`` loop on the same model and schedule.

One launch of 4 processes (mesh pp=4, a small transformer of 8 blocks, two a stage, 1F1B, 4 micro-batches):

- bytes: one epoch of ``mesh_dataloader`` with ``stage_fields={"first": ["input"], "last": ["target"]}``
  against the same loader reading whole samples; ``*_bytes_ratio`` = staged / whole on the first stage, a
  middle stage and the last (inputs are ``D`` floats a token, targets ``OUT``: expected D/(D+OUT), 0, OUT/(D+OUT)).
- overhead: ``meshwise.create_trainer`` over ``meshwise.parallelize(..., schedule="1F1B", microbatches=4)``
  against a loop a user writes with torch's API on the very same stage modules and optimizer:
  ``PipelineStage`` + ``Schedule1F1B(loss_fn=mse_loss)``, zero_grad, ``schedule.step``, an all-reduce of the
  last stage's loss so every rank can log it, ``opt.step()`` and ``.item()``. Blocks alternate (trainer, loop,
  loop, trainer, ...) so machine load hits both alike; the ratio is median trainer step / median loop step.

Run: ``.venv/bin/python benchmarks/bench_pipeline.py`` (``--blocks``, ``--steps``). Final line
``RESULT first_bytes_ratio=… middle_bytes_ratio=… last_bytes_ratio=… overhead_ratio=…``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS, T, OUT, BATCH, MICRO, LAYERS, SAMPLES = 64, 4, 16, 16, 16, 4, 8, 256


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
    """Written for pipeline stages: the pieces another stage holds are None."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def stage_bytes(topo) -> tuple[int, int]:
    """One epoch's bytes read by this rank: stage fields, then whole samples."""
    from meshwise.data import ArrayDataset, mesh_dataloader

    g = torch.Generator().manual_seed(0)
    data = {"input": torch.randn(SAMPLES, T, D, generator=g), "target": torch.randn(SAMPLES, T, OUT, generator=g)}
    out = []
    for fields in ({"first": ["input"], "last": ["target"]}, None):
        kw = {} if fields is None else {"stage_fields": fields}
        loader = mesh_dataloader(ArrayDataset(data), topo, global_batch_size=BATCH, mode="train", **kw)
        for _ in loader:
            pass
        out.append(loader.bytes_read)
    return out[0], out[1]


def workload(topo, steps: int):
    """The batches, the meshwise trainer, and the hand-written torch loop on the same stages and optimizer."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import meshwise

    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(1)
    data = [
        {"input": torch.randn(BATCH, T, D, generator=g), "target": torch.randn(BATCH, T, OUT, generator=g)}
        for _ in range(steps)
    ]
    torch.manual_seed(0)
    model = meshwise.parallelize(Net(), topo, schedule="1F1B", microbatches=MICRO)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo)

    group = topo.group(topo.stage_dims)
    (module,), (index,) = model.stage_modules, model.stage_indices
    stage = PipelineStage(module, index, model.num_stages, topo.device, group=group)
    schedule = Schedule1F1B(stage, MICRO, loss_fn=F.mse_loss)
    first, last = index == 0, index == model.num_stages - 1

    def hand_loop(batches: list[dict]) -> None:
        module.train()
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            args = (batch["input"],) if first else ()
            schedule.step(*args, target=batch["target"] if last else None, losses=losses if last else None)
            value = torch.stack(losses).mean().detach() if last else torch.zeros(())
            dist.all_reduce(value)  # every rank gets the step's loss, as the trainer's state.output
            opt.step()
            value.item()

    return data, trainer, hand_loop


def measure(topo, blocks: int, steps: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    staged, whole = stage_bytes(topo)
    data, trainer, hand_loop = workload(topo, steps)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()  # from an aligned start to this rank's end of the step(s)
        fn()
        return (time.perf_counter() - start) / steps

    for _ in range(3):  # warm-up both (the trainer builds its schedule on its first step)
        trainer.run(data, max_epochs=1)
        hand_loop(data)
    ours, theirs = [], []
    for i in range(blocks):
        order = [("ours", lambda: trainer.run(data, max_epochs=1)), ("theirs", lambda: hand_loop(data))]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            (ours if name == "ours" else theirs).append(timed(fn))
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {
        "staged": staged,
        "whole": whole,
        "trainer_s": statistics.median(ours),
        "loop_s": statistics.median(theirs),
        "paired": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40, help="alternating blocks per implementation")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per block")
    args = parser.parse_args()
    from meshwise.testing import run_distributed

    res = run_distributed(measure, 4, args.blocks, args.steps, mesh={"pp": 4}, timeout=600)
    print(f"{'stage':<8} {'staged bytes':>13} {'whole bytes':>12} {'ratio':>7}")
    ratios = []
    for rank, r in enumerate(res):
        ratios.append(r["staged"] / r["whole"])
        print(f"{rank:<8} {r['staged']:>13,} {r['whole']:>12,} {ratios[-1]:>7.4f}")
    # every rank's time ends with the same step; rank 0's view is the one printed
    r = res[0]
    ratio = r["trainer_s"] / r["loop_s"]
    print(
        f"pp=4, 1F1B, {MICRO} micro-batches: create_trainer {r['trainer_s'] * 1e3:.2f} ms/step, hand loop "
        f"{r['loop_s'] * 1e3:.2f} ms/step, ratio {ratio:.3f} (paired {r['paired']:.3f}); per rank ratios "
        + ", ".join(f"{x['trainer_s'] / x['loop_s']:.3f}" for x in res)
    )
    print(
        f"RESULT first_bytes_ratio={ratios[0]:.4f} middle_bytes_ratio={ratios[1]:.4f} "
        f"last_bytes_ratio={ratios[-1]:.4f} overhead_ratio={ratio:.3f}"
    )


if __name__ == "__main__":
    main()
