"""GPU check: an async checkpoint of a sharded model on the device is saved, then loaded back equal.

Mesh ``dp=-1, tp`` (tp 2 where the world is even). A float64 MLP on the device, TP over tp and FSDP2 over dp,
two AdamW steps; ``Checkpointer(async_save=True).save()`` returns once the state is staged in host memory, and
the model then takes a third step *before* the background write finished: the checkpoint must hold step two.
A model built under another seed, with its own optimizer, loads it: every parameter and every AdamW state
tensor equal to step two's bit for bit, on the device. Reported beside: whether the host staging buffers are
pinned (page-locked) memory, which lets the device-to-host copy of the next save run without a bounce buffer.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import full, init, report, two_if
from torch import nn

import meshwise

D, HIDDEN = 16, 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def build(topo: meshwise.Topology, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(seed)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    model = meshwise.parallelize(MLP().double().to(topo.device), topo, tp_plan=plan, dp="fsdp")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: nn.Module, opt: torch.optim.Optimizer, topo: meshwise.Topology, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, D, generator=g, dtype=torch.float64).to(topo.device)
    loss = F.mse_loss(model(x), torch.zeros_like(x))
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state tensor, full, by name (``fc1.weight``, ``fc1.weight/exp_avg``, ...)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p).clone()
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor):
                out[f"{name}/{key}"] = full(value).clone().to(out[name].device)
    return out


def shared_root(topo: meshwise.Topology) -> str:
    """One folder for every rank: ``MESHWISE_CHECK_DIR`` when the test gives one, else rank 0's new temp folder."""
    given = os.environ.get("MESHWISE_CHECK_DIR")
    root = [given or (tempfile.mkdtemp(prefix="meshwise-gpu-") if topo.rank == 0 else None)]
    if topo.world_size > 1:
        dist.broadcast_object_list(root, src=0)
    return os.path.join(root[0], "checkpoints")


def staged_buffers(ckpt: meshwise.Checkpointer) -> list[torch.Tensor]:
    """The host tensors the checkpointer staged into (its private buffers: empty where they are not kept)."""
    from torch.distributed.tensor import DTensor

    tensors = []
    for value in getattr(ckpt, "_buffers", {}).values():
        value = value.to_local() if isinstance(value, DTensor) else value
        if isinstance(value, torch.Tensor):
            tensors.append(value)
    return tensors


def main() -> None:
    topo = init({"dp": -1, "tp": two_if(2)})
    root = shared_root(topo)
    model, opt = build(topo, seed=0)
    for s in range(2):
        step(model, opt, topo, seed=s)
    expected = snapshot(model, opt)
    ckpt = meshwise.Checkpointer(root, topo, async_save=True)
    ckpt.save(2, model=model, optimizer=opt)
    staged = staged_buffers(ckpt)
    step(model, opt, topo, seed=2)  # training goes on while the background thread writes step 2
    moved = max((full(p) - expected[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 0, "the third step changed nothing: the check would not see a torn save"
    ckpt.close()

    fresh, fresh_opt = build(topo, seed=1)
    step(fresh, fresh_opt, topo, seed=7)  # give the optimizer state to overwrite
    loader = meshwise.Checkpointer(root, topo)
    info = loader.load("latest", model=fresh, optimizer=fresh_opt)
    loaded = snapshot(fresh, fresh_opt)
    assert set(loaded) == set(expected), sorted(set(loaded) ^ set(expected))
    for name, value in expected.items():
        assert loaded[name].device == topo.device, (name, loaded[name].device)
        gap = (loaded[name] - value).abs().max().item()
        assert torch.equal(loaded[name], value), f"{name}: loaded differs from saved by {gap:.3e}"
    loader.close()
    pinned = [t.is_pinned() for t in staged if t.device.type == "cpu"]
    report(
        "async_checkpoint",
        topo,
        step=getattr(info, "step", None),
        tensors_compared=len(expected),
        staged_host_tensors=len(pinned),
        staged_pinned=bool(pinned) and all(pinned),
        moved_after_save=moved,
    )
    meshwise.shutdown()


if __name__ == "__main__":
    main()
