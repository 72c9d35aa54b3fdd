"""GPU check: a pipeline schedule on the device trains like one process.

With an even world: mesh ``pp=2, dp=-1``, ``meshwise.parallelize`` cuts a float64 model of four blocks into two
stages (FSDP2 over dp) and ``create_trainer`` runs ``1F1B`` and ``GPipe`` with two micro-batches for five AdamW
steps with clipping on ``mesh_dataloader``'s stage-aware batches; parameters within 1e-12 of plain torch in
this process on the same global batches. With one GPU (no second stage to cut to): torch's own ``PipelineStage``
+ ``ScheduleGPipe`` with four micro-batches on one stage, its gradients within 1e-12 of one plain backward.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _common import init, max_param_diff, report, world_size
from torch import nn

import meshwise

D_IN, D, OUT, T = 5, 8, 4, 3
SAMPLES, GLOBAL_BATCH, STEPS, LR, CLIP, EPS = 40, 8, 5, 0.01, 0.5, 1e-6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Written the way pipeline stages need: a piece another stage holds is None and is skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, T, D_IN, generator=g, dtype=torch.float64)
    return {"input": x, "target": torch.randn(SAMPLES, T, OUT, generator=g, dtype=torch.float64)}


def reference(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
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


def staged(topo: meshwise.Topology, net: nn.Module, schedule: str) -> float:
    """meshwise's pipeline over pp=2: the largest parameter difference from one process after five steps."""
    from meshwise.data import ArrayDataset, mesh_dataloader

    ref = reference(copy.deepcopy(net), topo.device)
    model = meshwise.parallelize(copy.deepcopy(net), topo, schedule=schedule, microbatches=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo, grad_clip=CLIP)
    fields = {"first": ["input"], "last": ["target"]}
    loader = mesh_dataloader(ArrayDataset(data()), topo, global_batch_size=GLOBAL_BATCH, stage_fields=fields)
    trainer.run(loader, max_epochs=1)
    assert trainer.state.iteration == STEPS, trainer.state.iteration
    return max_param_diff(model, ref, subset=True)  # this stage's parameters


def one_stage(topo: meshwise.Topology, net: nn.Module) -> float:
    """torch's GPipe schedule on a single stage (four micro-batches): gradients vs one plain backward."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    d = {k: v[:GLOBAL_BATCH].to(topo.device) for k, v in data().items()}
    ref = copy.deepcopy(net)
    F.mse_loss(ref(d["input"]), d["target"]).backward()
    model = copy.deepcopy(net)
    stage = PipelineStage(model, 0, 1, topo.device, group=topo.group("pp"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=F.mse_loss)  # the mean of 4 equal micro-batch means
    losses: list[torch.Tensor] = []
    schedule.step(d["input"], target=d["target"], losses=losses)
    assert len(losses) == 4, losses
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def main() -> None:
    pp = 2 if world_size() % 2 == 0 else 1
    topo = init({"pp": pp, "dp": -1})
    torch.manual_seed(0)
    net = Net().double().to(topo.device)
    if pp == 2:
        results = {f"{s}_param_diff": staged(topo, net, s) for s in ("1F1B", "GPipe")}
    else:
        results = {"one_stage_grad_diff": one_stage(topo, net)}
    for key, value in results.items():
        assert value <= 1e-12, f"{key}: {value:.3e} from one process"
    report("pipeline", topo, **results)
    meshwise.shutdown()


if __name__ == "__main__":
    main()
