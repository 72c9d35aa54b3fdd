"""A plain ignite script (docs/migrate-from-ignite.md, "before"): an MLP classifier trained with idist's helpers.

python examples/migrate/before.py                                            # one process
torchrun --nproc-per-node 4 examples/migrate/before.py                       # DDP over 4 processes
"""

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver, ProgressBar
from ignite.metrics import Accuracy, Loss
from torch import nn
from torch.utils.data import TensorDataset


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
    return x, y


def training(local_rank: int, epochs: int = 4) -> None:
    torch.manual_seed(0)
    train_loader = idist.auto_dataloader(TensorDataset(*make_data(1024, 0)), batch_size=64, shuffle=True)
    val_loader = idist.auto_dataloader(TensorDataset(*make_data(250, 1)), batch_size=64)
    model = idist.auto_model(Net())
    optimizer = idist.auto_optim(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loss_fn = nn.CrossEntropyLoss()

    trainer = create_supervised_trainer(model, optimizer, loss_fn, device=idist.device())
    metrics = {"accuracy": Accuracy(), "loss": Loss(loss_fn)}
    evaluator = create_supervised_evaluator(model, metrics=metrics, device=idist.device())
    ProgressBar().attach(trainer, output_transform=lambda loss: {"loss": loss})

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        evaluator.run(val_loader)
        m = evaluator.state.metrics
        if idist.get_rank() == 0:
            print(f"epoch {engine.state.epoch}: val accuracy {m['accuracy']:.4f}, val loss {m['loss']:.6f}")

    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    saver = DiskSaver("runs/migrate/before", require_empty=False)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, saver, n_saved=2))
    trainer.run(train_loader, max_epochs=epochs)


if __name__ == "__main__":
    with idist.Parallel(backend=None) as parallel:
        parallel.run(training)
