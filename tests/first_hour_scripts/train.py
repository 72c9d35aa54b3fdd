"""A user's small training script for tests/test_first_hour.py, run under ``meshwise run``.

An MLP regression in float64, FSDP2 over ``dp`` (and tensor parallel over ``tp`` when the mesh has one),
checkpointed every epoch with ``Checkpointing``. Options make it fail, slow down or declare its own mesh,
the way a user's script would.
"""

import argparse
import json
import os
import time

import torch
from ignite.engine import Events
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshwise
from meshwise.data import ArrayDataset, mesh_dataloader
from meshwise.engine.handlers import Checkpointing


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step (a slow data pipeline)")
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-at", type=int, default=3)
    parser.add_argument("--mesh-in-code", default=None)
    parser.add_argument("--no-plan", action="store_true", help="forget the tensor-parallel plan")
    args = parser.parse_args()
    os.makedirs(args.run_dir, exist_ok=True)

    torch.set_default_dtype(torch.float64)
    topo = meshwise.init(args.mesh_in_code)
    torch.manual_seed(0)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()} if topo.replica_dims and not args.no_plan else None
    model = meshwise.parallelize(MLP(), topo, tp_plan=plan, dp="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 4, generator=g)
    data = ArrayDataset({"input": x, "target": x.sin().sum(1, keepdim=True)})
    train = mesh_dataloader(data, topo, global_batch_size=8, mode="train")
    trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo)
    ckpt = meshwise.Checkpointer(os.path.join(args.run_dir, "checkpoints"), topo, verbose=False)
    Checkpointing(ckpt, every_epochs=1, model=model, optimizer=opt, loader=train).attach(trainer)

    @trainer.on(Events.ITERATION_COMPLETED)
    def _each_step(engine):
        if topo.rank == 0:
            with open(os.path.join(args.run_dir, "progress.txt"), "a") as f:
                f.write(f"{engine.state.iteration} {os.getpid()}\n")
        if args.fail_rank == topo.rank and engine.state.iteration == args.fail_at:
            raise ValueError(f"sample file shard-{topo.rank}.npy is truncated: regenerate it with prepare.py")
        time.sleep(args.sleep)

    trainer.run(train, max_epochs=args.epochs)
    ckpt.close()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if topo.rank == 0:
        with open(os.path.join(args.run_dir, "final.json"), "w") as f:
            json.dump({k: v.tolist() for k, v in full.items()}, f)
    meshwise.shutdown()


if __name__ == "__main__":
    main()
