"""The ignite script of before.py on a mesh (docs/migrate-from-ignite.md, "after"): the same classifier, any mesh.

python examples/migrate/after.py                                             # one process
meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 examples/migrate/after.py   # dp=2 x tp=2
"""

import torch
from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
from ignite.handlers import Checkpoint, ProgressBar
from ignite.metrics import Accuracy, Loss
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshwise
from meshwise.checkpoint import MeshSaver
from meshwise.data import ArrayDataset, mesh_dataloader
from meshwise.engine import on_mesh
from meshwise.engine.ignite_engine import global_loss, prepare_batch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 1).long()
    return ArrayDataset({"input": x, "target": y})


def training(epochs: int = 4) -> None:
    topo = meshwise.init()  # the mesh comes from --mesh (one process: world size 1)
    torch.manual_seed(0)
    train_loader = mesh_dataloader(make_data(1024, 0), topo, global_batch_size=64, mode="train")
    val_loader = mesh_dataloader(make_data(250, 1), topo, global_batch_size=64, mode="eval")
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()} if topo.replica_dims else None
    model = meshwise.parallelize(Net(), topo, tp_plan=plan, dp="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss()

    step = {"prepare_batch": prepare_batch(topo), "output_transform": global_loss(topo)}
    trainer = create_supervised_trainer(model, optimizer, loss_fn, device=topo.device, **step)
    on_mesh(trainer, topo, model=model)  # ignite's engine on the mesh: loader, metrics, checkpoints checked
    metrics = {"accuracy": Accuracy(), "loss": Loss(loss_fn)}
    evaluator = create_supervised_evaluator(model, metrics=metrics, prepare_batch=prepare_batch(topo, train=False))
    on_mesh(evaluator, topo)  # ignite's metrics count every sample once, over dp only
    ProgressBar().attach(trainer, output_transform=lambda loss: {"loss": loss})

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        evaluator.run(val_loader)
        m = evaluator.state.metrics
        if topo.rank == 0:
            print(f"epoch {engine.state.epoch}: val accuracy {m['accuracy']:.4f}, val loss {m['loss']:.6f}")

    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    saver = MeshSaver("runs/migrate/after", topo)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, saver, n_saved=2))
    trainer.run(train_loader, max_epochs=epochs)
    meshwise.shutdown()


if __name__ == "__main__":
    training()
