"""The Checkpointing handler with the real layers: create_trainer + parallelize + mesh_dataloader, resume mid-epoch."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from meshwise.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent / "ckpt_scripts"))

import ckpt_common as cc  # noqa: E402

MESH = {"dp": 2, "tp": 2}
N, BATCH = 24, 8  # 3 steps per epoch


def _run(topo, root: str | None, stop_at: int | None, max_epochs: int = 2) -> dict:
    from ignite.engine import Events
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import meshwise
    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.engine import Checkpointing

    torch.manual_seed(1234)
    model = meshwise.parallelize(
        cc.MLP(), topo, dp="fsdp", tp_plan={"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = np.random.default_rng(3)
    ds = ArrayDataset(
        {"input": g.standard_normal((N, cc.D_IN), np.float32), "target": g.standard_normal((N, cc.D_OUT), np.float32)}
    )
    loader = mesh_dataloader(ds, topo, global_batch_size=BATCH, seed=5)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: loader.set_epoch(e.state.epoch - 1))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: sched.step())
    seen = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: seen.append((e.state.epoch, e.state.iteration, e.state.batch["index"].tolist(), e.state.output)),
    )
    if root is not None:
        ckpt = meshwise.Checkpointer(root, topo, keep_last=2)
        Checkpointing(ckpt, every_iterations=2, model=model, optimizer=opt, loader=loader, scheduler=sched).attach(
            trainer
        )
    if stop_at is not None:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), lambda e: e.terminate())
    trainer.run(loader, max_epochs=max_epochs)
    if root is not None:
        ckpt.close()
    return {
        "seen": seen,
        "state": cc.full_state(model, opt),
        "counters": (trainer.state.epoch, trainer.state.iteration),
        "lr": opt.param_groups[0]["lr"],
    }


def _first(topo, root: str) -> dict:
    return {"ref": _run(topo, None, None), "part": _run(topo, root, stop_at=5)}


def _second(topo, root: str) -> dict:
    return _run(topo, root, None)


def test_checkpointing_resumes_create_trainer_and_mesh_dataloader_mid_epoch(tmp_path):
    root = str(tmp_path / "ckpt")
    one = run_distributed(_first, 4, root, mesh=MESH, timeout=120)
    # step-4 is the latest checkpoint (mid-epoch 2); iteration 5 ran but was not saved, so it runs again
    two = run_distributed(_second, 4, root, mesh=MESH, timeout=120)
    for r in range(4):
        ref, part, res = one[r]["ref"], one[r]["part"], two[r]
        assert [s[:2] for s in res["seen"]] == [(2, 5), (2, 6)]
        assert part["seen"][:4] + res["seen"] == ref["seen"]  # batches, epochs, iterations and losses
        assert cc.max_diff(ref["state"], res["state"]) <= 1e-6
        assert res["counters"] == ref["counters"] == (2, 6) and res["lr"] == ref["lr"]
    assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith("step-")) == ["step-4", "step-6"]
