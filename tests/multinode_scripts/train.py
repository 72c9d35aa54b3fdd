"""One training run on whatever launched it (two torchrun "nodes", or srun variables), checked against one process.

Used by tests/test_multinode.py; every rank writes ``OUT_DIR/rank<N>.json``. By hand, on each of two nodes:

    meshwise run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint NODE0:29400 --rdzv-id job1 \
        --mesh dp=2,tp=2 tests/multinode_scripts/train.py OUT_DIR

The run: a small MLP with a LayerNorm, tensor parallel over ``tp`` and FSDP2 over ``dp``, trained by
``meshwise.create_trainer`` on ``mesh_dataloader`` batches with momentum and global-norm clipping; the
same full weights (one seed) train in this process on the global batches as the reference. Then the
process group is rebuilt with the dims in the other order (``tp`` outermost) to record the placement
warning that layout earns on several nodes, and to check a ``tp`` all-reduce that now crosses nodes.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import meshwise
from meshwise.errors import PlacementWarning
from meshwise.layout import dims_crossing_nodes, placement_warnings

D, OUT, GLOBAL_BATCH, STEPS, LR, CLIP = 8, 4, 8, 4, 0.2, 0.5
SAMPLES = GLOBAL_BATCH * STEPS
ENV_SEEN = (
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_MAX_RESTARTS",
    "MASTER_ADDR",
    "SLURM_PROCID",
    "SLURM_NODEID",
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def dataset() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"input": torch.randn(SAMPLES, D, generator=g), "target": torch.randn(SAMPLES, OUT, generator=g)}


def reference(model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the loader's global batches (the sampler's global order)."""
    from meshwise.data import MeshSampler

    data = dataset()
    sampler = MeshSampler(SAMPLES, GLOBAL_BATCH, mode="train", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        idx = torch.from_numpy(sampler.global_batch(step * GLOBAL_BATCH))
        loss = F.mse_loss(model(data["input"][idx]), data["target"][idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def init_recording(mesh: str) -> tuple[meshwise.Topology, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        topo = meshwise.init(mesh, timeout=60)
    return topo, [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]


def train(topo: meshwise.Topology) -> dict:
    from ignite.engine import Events
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from meshwise.data import ArrayDataset, mesh_dataloader

    torch.manual_seed(0)
    full = Net()  # full weights under one seed on every rank, then sharded
    ref_losses, ref_params = reference(copy.deepcopy(full))
    model = meshwise.parallelize(full, topo, tp_plan={"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, dp="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo, grad_clip=CLIP)
    losses: list[float] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    loader = mesh_dataloader(ArrayDataset(dataset()), topo, global_batch_size=GLOBAL_BATCH, mode="train", seed=0)
    trainer.run(loader, max_epochs=1)
    diff = max(
        ((p.full_tensor() if isinstance(p, DTensor) else p.detach()) - ref_params[name]).abs().max().item()
        for name, p in model.named_parameters()
    )
    return {
        "param_diff": diff,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "losses": losses,
        "steps": len(losses),
    }


def main(out_dir: str) -> None:
    topo, warned = init_recording(os.environ.get("MESHWISE_MESH", "dp=2,tp=2"))
    report = {
        "rank": topo.rank,
        "world_size": topo.world_size,
        "launcher": topo.environment.launcher,
        "local_rank": topo.local_rank,
        "local_world_size": topo.environment.local_world_size,
        "master_addr": topo.environment.master_addr,
        "env": {k: os.environ.get(k) for k in ENV_SEEN},
        "node": topo.node,
        "nodes": list(topo.nodes),
        "num_nodes": topo.num_nodes,
        "node_names": list(topo.node_names),
        "coordinates": topo.coordinates(),
        "warned": warned,
        "describe": topo.describe() if topo.rank == 0 else None,
        **train(topo),
    }
    meshwise.shutdown()

    # The same ranks with tp outermost: tp groups pair ranks r and r+2, which sit on different nodes. A mesh in
    # code that differs from the launcher's --mesh is refused, so this second mesh forgets the launcher's.
    os.environ.pop("MESHWISE_MESH", None)
    topo, warned = init_recording("tp=2,dp=2")
    value = torch.tensor([float(topo.rank + 1)])
    dist.all_reduce(value, group=topo.group("tp"))
    report["swapped"] = {
        "warned": warned,
        "advice": placement_warnings(topo.layout, topo.nodes),
        "crossing": list(dims_crossing_nodes(topo.layout, topo.nodes)),
        "tp_sum": value.item(),
        "tp_expected": float(sum(r + 1 for r in topo.group_ranks("tp"))),
    }
    meshwise.shutdown()
    Path(out_dir, f"rank{report['rank']}.json").write_text(json.dumps(report))
    # One write that starts on a fresh line: the workers of a node share one pipe with torch's warnings.
    sys.stdout.write(f"\nrank {report['rank']} node {report['node']} param_diff {report['param_diff']:.3g}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    torch.set_num_threads(1)  # four ranks on two cores
    main(sys.argv[1])
