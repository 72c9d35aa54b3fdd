"""Memory per rank on the GPT example's model: what FSDP2 at dp=4 leaves each rank of the parameter, gradient and
AdamW-state bytes one process holds, what full activation checkpointing leaves of the activations saved for
backward, and how far bf16 training's loss is from fp32's after 50 steps.

* ``state_bytes_ratio_dp4`` — the largest rank's parameter + gradient + optimizer-state bytes
  (:func:`meshwise.parallel.precision.memory_per_rank`, after one AdamW step) at dp=4 (FSDP2 per block)
  over one process's (goal ≤ 1/4 + 2 %);
* ``activation_ratio_ac`` — bytes of tensors saved for backward in one forward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, parameters left out), with every block
  checkpointed over none; a checkpointed block saves nothing inside it but keeps its input, which is added
  (goal ≤ 0.5);
* ``bf16_loss_gap`` — |bf16 loss - fp32 loss| at step 50 of the same dp=4 run (same data and initial weights),
  with the largest gap over all 50 steps beside it.

The model is the GPT example's default (4 layers, d_model 128, 4 heads) with block_size 64, trained on
byte-level text of Python standard-library modules, global batch 16, AdamW lr 2e-3.
Run: ``.venv/bin/python benchmarks/bench_memory.py`` (one launch of 4 gloo ranks).
Final line: ``RESULT state_bytes_ratio_dp4=… activation_ratio_ac=… bf16_loss_gap=…``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

import model as gpt  # noqa: E402

from meshwise.parallel.precision import (  # noqa: E402
    apply_activation_checkpointing,
    block_names,
    memory_per_rank,
)
from meshwise.testing import run_distributed  # noqa: E402

CONFIG = dict(block_size=64)  # the rest: GPTConfig's defaults, as examples/gpt/train.py uses them
BATCH, LR = 16, 2e-3


def text_windows(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of byte windows from standard-library modules (the GPT example's kind of data)."""
    import typing

    data = b"".join(Path(m.__file__).read_bytes() for m in (os, argparse, typing))
    tokens = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    n = CONFIG["block_size"] + 1
    windows = tokens[: len(tokens) // n * n].view(-1, n)
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(windows), (steps, BATCH), generator=g)
    return [(windows[p, :-1], windows[p, 1:]) for p in picks]


def one_process_state() -> int:
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(**CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = text_windows(1)[0]
    gpt.token_loss(model(x), y).backward()
    opt.step()
    return memory_per_rank(model, opt).total


def saved_activation_bytes(checkpointed: bool) -> int:
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(**CONFIG))
    kept_inputs = 0
    if checkpointed:
        names = block_names(model, [])
        apply_activation_checkpointing(model, names)

        def keep(_module, args):
            nonlocal kept_inputs
            kept_inputs += sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))

        for name in names:
            dict(model.named_modules())[name].register_forward_pre_hook(keep)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    x, y = text_windows(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gpt.token_loss(model(x), y)
    loss.backward()
    return sum(storages.values()) + kept_inputs


def on_mesh(topo, steps: int) -> dict:
    import torch.distributed as dist
    from ignite.engine import Events

    import meshwise

    b_local = BATCH // topo.data_size
    lo = topo.data_rank * b_local
    local = [{"input": x[lo : lo + b_local], "target": y[lo : lo + b_local]} for x, y in text_windows(steps)]
    out: dict = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = gpt.GPT(gpt.GPTConfig(**CONFIG))
        model = meshwise.parallelize(model, topo, dp="fsdp", fsdp_units=gpt.Block, precision=precision)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))
        trainer = meshwise.create_trainer(model, opt, gpt.token_loss, topo, loss_weight="tokens")
        losses: list[float] = []
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e, ls=losses: ls.append(e.state.output))
        t0 = time.perf_counter()
        trainer.run(local, max_epochs=1)
        out[f"{precision}_seconds"] = time.perf_counter() - t0
        out[precision] = losses
        if precision == "fp32":
            total = torch.tensor([float(memory_per_rank(model, opt).total)])
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            out["state_max_rank"] = int(total.item())
        else:
            out["bf16_master_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    one = one_process_state()
    plain, ac = saved_activation_bytes(False), saved_activation_bytes(True)
    t0 = time.perf_counter()
    r = run_distributed(on_mesh, 4, args.steps, mesh={"dp": 4}, timeout=900)[0]
    mesh_s = time.perf_counter() - t0
    state_ratio = r["state_max_rank"] / one
    gaps = [abs(a - b) for a, b in zip(r["bf16"], r["fp32"])]
    print(f"one process: parameters + gradients + AdamW state = {one} bytes")
    print(f"dp=4 FSDP2: largest rank {r['state_max_rank']} bytes -> ratio {state_ratio:.4f} (goal <= {0.25 * 1.02})")
    print(f"saved for backward: none {plain} bytes, full checkpointing {ac} bytes -> ratio {ac / plain:.4f}")
    print(f"fp32 loss {r['fp32'][0]:.4f} -> {r['fp32'][-1]:.4f}; bf16 {r['bf16'][0]:.4f} -> {r['bf16'][-1]:.4f}")
    print(f"bf16 master weights: {r['bf16_master_dtypes']}; largest gap over {len(gaps)} steps {max(gaps):.4g}")
    print(f"train seconds fp32 {r['fp32_seconds']:.1f}, bf16 {r['bf16_seconds']:.1f}; launch total {mesh_s:.1f}")
    print(
        f"RESULT state_bytes_ratio_dp4={state_ratio:.4f} activation_ratio_ac={ac / plain:.4f} "
        f"bf16_loss_gap={gaps[-1]:.4g} bf16_loss_gap_max={max(gaps):.4g}"
    )


if __name__ == "__main__":
    main()
