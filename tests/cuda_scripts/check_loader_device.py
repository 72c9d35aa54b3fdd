"""GPU check: batches from ``mesh_dataloader`` reach the model on ``cuda:LOCAL_RANK``, holding the right samples.

Mesh ``dp=-1, tp`` (tp 2 where the world is even). The loader itself moves nothing (its batches are host
tensors, ``index`` naming each row's sample: reported); ``create_trainer`` and ``create_evaluator`` move every tensor
field to ``topo.device``, which ``meshwise.init`` bound to ``cuda:LOCAL_RANK``. Checked inside the step, on
every batch: the device of every tensor field, that each row equals the dataset's sample ``index`` names (the
move kept the values), and that the evaluator's metric over every sample once equals one process's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import full, init, report, two_if
from torch import nn

import meshwise

SAMPLES, EVAL_SAMPLES, GLOBAL_BATCH, D = 48, 21, 8, 6


def data(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    return {"input": x, "target": torch.randn(n, 1, generator=g, dtype=torch.float64)}


def main() -> None:
    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.metrics import MeanLoss

    topo = init({"dp": -1, "tp": two_if(2)})
    train_data, eval_data = data(SAMPLES, 5), data(EVAL_SAMPLES, 6)
    loader = mesh_dataloader(ArrayDataset(train_data), topo, global_batch_size=GLOBAL_BATCH)
    first = next(iter(loader))
    loader_devices = sorted({str(v.device) for v in first.values() if isinstance(v, torch.Tensor)})
    assert "index" in first, sorted(first)

    seen: list[str] = []

    def checked(source: dict[str, torch.Tensor]):
        def forward(model: nn.Module, batch: dict) -> torch.Tensor:
            for key, value in batch.items():
                if isinstance(value, torch.Tensor):
                    assert value.device == topo.device, f"batch[{key!r}] on {value.device}, not {topo.device}"
                    seen.append(str(value.device))
            idx = batch["index"].to(torch.int64)
            ok = idx >= 0 if "valid" not in batch else batch["valid"]
            expected = source["input"].to(topo.device)[idx[ok]]
            assert torch.equal(batch["input"][ok], expected), "a batch's rows are not the samples its index names"
            return model(batch["input"])

        return forward

    torch.manual_seed(0)
    model = meshwise.parallelize(nn.Linear(D, 1).double().to(topo.device), topo)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo, forward=checked(train_data))
    trainer.run(loader, max_epochs=1)
    assert trainer.state.iteration == SAMPLES // GLOBAL_BATCH, trainer.state.iteration
    assert seen, "the trainer's forward saw no tensor"

    metric = MeanLoss(lambda pred, target: F.mse_loss(pred, target, reduction="none"))  # float64 states
    evaluator = meshwise.create_evaluator(model, topo, {"mse": metric}, forward=checked(eval_data))
    evaluator.run(mesh_dataloader(ArrayDataset(eval_data), topo, global_batch_size=GLOBAL_BATCH, mode="eval"))
    with torch.no_grad():
        w, b = full(model.weight).to(topo.device), full(model.bias).to(topo.device)
        x, y = eval_data["input"].to(topo.device), eval_data["target"].to(topo.device)
        expected = F.mse_loss(x @ w.T + b, y).item()
    mse = float(evaluator.state.metrics["mse"])
    assert abs(mse - expected) <= 1e-12, f"evaluator mse {mse!r}, one process {expected!r}"
    report(
        "loader_device",
        topo,
        loader_devices=loader_devices,
        devices=sorted(set(seen)),
        tensors_checked=len(seen),
        eval_mse=mse,
        eval_mse_diff=abs(mse - expected),
    )
    meshwise.shutdown()


if __name__ == "__main__":
    main()
