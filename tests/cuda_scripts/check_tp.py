"""GPU check: tensor parallel through ``meshwise.parallelize`` trains a small model like one process does.

Mesh ``dp=-1, tp`` (tp 2 where the world is even; one GPU: tp=1, still a DTensor over a one-rank mesh). An MLP
in float64, full weights under one seed on every rank, ``ColwiseParallel`` / ``RowwiseParallel`` over tp and
FSDP2 over dp, five AdamW steps of ``create_trainer`` with clipping on ``mesh_dataloader``'s batches, against
the same model trained by plain torch in this process, on the same device, on the same global batches.
Parameters must agree within 1e-12.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _common import init, max_param_diff, report, two_if
from torch import nn

import meshwise

D_IN, HIDDEN, D_OUT = 8, 32, 4
SAMPLES, GLOBAL_BATCH, STEPS, LR, CLIP, EPS = 40, 8, 5, 1e-2, 0.5, 1e-6


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D_IN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "input": torch.randn(SAMPLES, D_IN, generator=g, dtype=torch.float64),
        "target": torch.randn(SAMPLES, D_OUT, generator=g, dtype=torch.float64),
    }


def reference(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Plain torch on this device: the sampler's global batches, AdamW, torch's clip_grad_norm_."""
    from meshwise.data import MeshSampler

    d = {k: v.to(device) for k, v in data().items()}
    sampler = MeshSampler(SAMPLES, GLOBAL_BATCH, mode="train", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        idx = torch.from_numpy(sampler.global_batch(step * GLOBAL_BATCH)).to(device)
        loss = F.mse_loss(model(d["input"][idx]), d["target"][idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from meshwise.data import ArrayDataset, mesh_dataloader

    topo = init({"dp": -1, "tp": two_if(2)})
    torch.manual_seed(0)
    net = MLP().double().to(topo.device)
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    ref = reference(copy.deepcopy(net), topo.device)
    moved = max((ref[n] - start[n]).abs().max().item() for n in ref)
    assert moved > 1e-3, f"the reference barely trained ({moved:.2e}): the comparison would show nothing"
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    model = meshwise.parallelize(net, topo, tp_plan=plan, dp="fsdp")
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    assert any(n.startswith("fc1") for n in sharded), sharded
    for n, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        assert local.device == topo.device, (n, local.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo, grad_clip=CLIP)
    loader = mesh_dataloader(ArrayDataset(data()), topo, global_batch_size=GLOBAL_BATCH)
    trainer.run(loader, max_epochs=1)
    assert trainer.state.iteration == STEPS, trainer.state.iteration
    diff = max_param_diff(model, ref)
    assert diff <= 1e-12, f"largest parameter difference from one process: {diff:.3e}"
    report("tp", topo, max_param_diff=diff, moved=moved, steps=STEPS, sharded=len(sharded))
    meshwise.shutdown()


if __name__ == "__main__":
    main()
