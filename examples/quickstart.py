"""The README's quick start: an MLP regression trained, evaluated and checkpointed on any mesh.

    python examples/quickstart.py                                                    # one process
    meshwise run --nproc-per-node 4 --mesh dp=-1,tp=2 examples/quickstart.py         # dp=2 x tp=2

Every mesh prints the same numbers (up to float rounding): that is the point. Run it again in the same
folder and it resumes from its last checkpoint; once the run is complete it says so and evaluates again.
"""

import argparse

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torchmetrics import MeanSquaredError

import meshwise
from meshwise.data import ArrayDataset, mesh_dataloader
from meshwise.engine.handlers import Checkpointing, ProgressBar


class MLP(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_data(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return {"input": x, "target": x.sin().sum(1, keepdim=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoints", default="runs/quickstart/checkpoints", help="run it twice: it resumes")
    args = parser.parse_args()

    topo = meshwise.init()  # the mesh comes from --mesh / MESHWISE_MESH (default dp=-1)
    torch.manual_seed(0)  # the same full weights on every rank, then sharded
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()} if topo.replica_dims else None
    model = meshwise.parallelize(MLP(), topo, tp_plan=plan, dp="fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    train = mesh_dataloader(ArrayDataset(make_data(512, 0)), topo, global_batch_size=64, mode="train")
    val = mesh_dataloader(ArrayDataset(make_data(203, 1)), topo, global_batch_size=64, mode="eval")
    trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo, grad_clip=1.0)
    evaluator = meshwise.create_evaluator(model, topo, metrics={"mse": MeanSquaredError()})  # each sample once

    ckpt = meshwise.Checkpointer(args.checkpoints, topo, keep_last=2, verbose=False)
    checkpointing = Checkpointing(ckpt, every_epochs=1, model=model, optimizer=opt, loader=train).attach(trainer)
    ProgressBar(topo).attach(trainer)  # one bar, on global rank 0
    trainer.run(train, max_epochs=args.epochs)  # resumes from the latest checkpoint, if any
    evaluator.run(val)
    ckpt.close()
    if topo.is_leader():
        mesh = " x ".join(f"{d}={s}" for d, s in topo.sizes.items())
        if trainer.state.output is None:  # the checkpoint already held the whole run: no step ran
            trained = f"checkpoint step {checkpointing.resumed.step} already completes {args.epochs} epochs"
        else:
            trained = f"last train loss {trainer.state.output:.6f}"
        print(
            f"mesh {mesh}: {trained}, held-out mse {evaluator.state.metrics['mse']:.6f} over 203 samples",
            flush=True,
        )
    meshwise.shutdown()


if __name__ == "__main__":
    main()
