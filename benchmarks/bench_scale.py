"""Costs that stay flat as the world grows: meshwise.init time and group count at 8, 1,024 and 16,384 ranks of a
3-dim mesh, and the trainer's per-step meshwise overhead at 16,384 against 8, on torch's fake backend.

Each world size runs in a fresh process (one process plays rank 1 of the world). The step overhead is the time
of a meshwise trainer step minus a plain-torch step of the same local model and batch, in the same process.

    .venv/bin/python benchmarks/bench_scale.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

__all__ = ["main"]

MESH = "dp=-1,cp=4,tp=2"  # batch x split x replica
STEPS = 200


def _one_world(world: int) -> dict:
    """Run in a fresh process: init as rank 1 of ``world``, then time trainer steps against plain torch."""
    os.environ["MESHWISE_DRY_RUN"] = f"rank=1,world={world},nproc=8,steps=1"
    import torch
    import torch.distributed as dist
    from torch.distributed import device_mesh, tensor  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401

    import meshwise
    from meshwise.data import mesh_dataloader
    from meshwise.dryrun import join_fake_group  # noqa: F401 - imports, not init, are what a first call pays

    start = time.perf_counter()
    topo = meshwise.init(MESH)
    init_s = time.perf_counter() - start
    groups = len(dist.distributed_c10d._world.pg_map) - 1  # every group but the world's
    local = 4
    data = {"input": torch.randn(local * topo.data_size * 2, 16), "target": torch.randn(local * topo.data_size * 2, 1)}
    loader = mesh_dataloader(data, topo, global_batch_size=local * topo.data_size, parts={"input": None})
    batch = next(iter(loader))
    model = meshwise.parallelize(torch.nn.Linear(16, 1), topo, dp="replicate")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = meshwise.create_trainer(model, opt, torch.nn.functional.mse_loss, topo)
    step = trainer._process_function
    for _ in range(20):
        step(trainer, batch)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step(trainer, batch)
    mesh_s = (time.perf_counter() - t0) / STEPS
    x, y = batch["input"], batch["target"]
    t0 = time.perf_counter()
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    plain_s = (time.perf_counter() - t0) / STEPS
    meshwise.shutdown()
    return {"init_s": init_s, "groups": groups, "step_s": mesh_s, "plain_s": plain_s}


def main() -> None:
    results = {}
    for world in (8, 1024, 16384):
        out = subprocess.run(
            [sys.executable, __file__, "--world", str(world)], capture_output=True, text=True, check=True
        ).stdout
        results[world] = json.loads(out.strip().splitlines()[-1])
        r = results[world]
        print(
            f"world {world:>6}: init {r['init_s']:.3f}s, {r['groups']} groups; step {r['step_s'] * 1e6:.0f} us "
            f"(plain torch {r['plain_s'] * 1e6:.0f} us)",
            flush=True,
        )
    overhead = {w: r["step_s"] - r["plain_s"] for w, r in results.items()}
    ratio = overhead[16384] / overhead[8]
    print(
        f"RESULT init_s_8={results[8]['init_s']:.3f} init_s_1024={results[1024]['init_s']:.3f} "
        f"init_s_16384={results[16384]['init_s']:.3f} groups_16384={results[16384]['groups']} "
        f"step_overhead_us_8={overhead[8] * 1e6:.0f} step_overhead_us_16384={overhead[16384] * 1e6:.0f} "
        f"step_overhead_ratio={ratio:.3f}"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--world":
        print(json.dumps(_one_world(int(sys.argv[2]))))
    else:
        main()
