"""Training that survives a lost node: the same global batch and the same parameters on whatever world is left.

One process (the reference), then an elastic job of two nodes that loses one (docs/cluster.md, "Elastic runs"):

    python examples/elastic/train.py --out ref.json
    meshwise store 127.0.0.1:29400 &                      # the rendezvous store, on no training node
    meshwise run --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job1 --mesh dp=-1,tp=2 examples/elastic/train.py --out elastic.json
    # ... the same command again in a second shell (the second node); kill it mid-run: the first goes on alone

Every restart loads the latest checkpoint onto the new mesh (dp is re-derived from the world: dp=2 x tp=2, then
dp=1 x tp=2), and ``micro_batch_size`` sets the accumulation so that the global batch stays ``--batch`` (each rank
then runs twice the micro-batches). The run folder's ``worlds.jsonl`` says which worlds trained which steps
(``meshwise report RUN_DIR``); the final weights equal the one-process run's (float64).
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from ignite.engine import Events
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshwise
from meshwise.data import ArrayDataset, mesh_dataloader
from meshwise.engine.handlers import Checkpointing


class MLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_data(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    return {"input": x, "target": x.sin().sum(1, keepdim=True)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/elastic", help="checkpoints and worlds.jsonl")
    p.add_argument("--steps", type=int, default=24, help="training steps of the whole run")
    p.add_argument("--batch", type=int, default=16, help="global batch size, the same on every world")
    p.add_argument("--micro-batch", type=int, default=4, help="rows a rank runs at once (accumulation follows)")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep after each step (time to kill a node)")
    p.add_argument("--out", default=None, help="a JSON file for the final step and weights (rank 0)")
    args = p.parse_args(argv)

    topo = meshwise.init(os.environ.get("MESHWISE_MESH") or "dp=-1")
    torch.manual_seed(0)  # the same full weights on every rank, then sharded
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()} if "tp" in topo.sizes else None
    model = meshwise.parallelize(MLP().double(), topo, tp_plan=plan, dp="replicate")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = mesh_dataloader(ArrayDataset(make_data(256)), topo, global_batch_size=args.batch, mode="train")
    trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo, micro_batch_size=args.micro_batch)
    ckpt = meshwise.Checkpointer(Path(args.run_dir), topo, keep_last=2, verbose=False)
    Checkpointing(ckpt, every_iterations=1, model=model, optimizer=opt, loader=loader).attach(trainer)
    if args.step_seconds:
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda _: time.sleep(args.step_seconds))
    trainer.run(loader, max_iters=args.steps)  # resumes from the latest checkpoint, on whatever mesh this is
    ckpt.close()
    weights = torch.cat(
        [v.full_tensor().flatten() if hasattr(v, "full_tensor") else v.flatten() for v in model.state_dict().values()]
    )
    out = {"step": trainer.state.iteration, "world": topo.world_size, "weights": weights.tolist()}
    if topo.is_leader():
        mesh = " x ".join(f"{d}={s}" for d, s in topo.sizes.items())
        print(f"mesh {mesh}: step {trainer.state.iteration}, weights sum {float(weights.sum())!r}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(out))
    meshwise.shutdown()
    return out


if __name__ == "__main__":
    main()
