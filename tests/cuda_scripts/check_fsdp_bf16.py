"""GPU check: FSDP2 with bf16 mixed precision trains within bf16's tolerance of float32 in one process.

Mesh ``dp=-1`` (every rank). A residual MLP built in float32 under one seed, five SGD steps of ``create_trainer``
on ``mesh_dataloader``'s batches, two ways: ``meshwise.parallelize(precision="bf16", fsdp_units=Block)`` (FSDP2
with ``MixedPrecisionPolicy(bf16, reduce fp32)`` over dp > 1; a data-parallel size of 1 runs autocast instead),
and torch's ``fully_shard(mp_policy=...)`` applied directly over the dp submesh (FSDP2 even on one GPU). Each is
compared with plain float32 torch in this process on the same global batches: every step's loss within 2e-2
relative and the parameters within 1e-2, while differing from float32 by more than float32 rounding (bf16 ran),
with the blocks computing in bf16 and the optimizer's parameters and gradients staying float32.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _common import init, max_param_diff, report
from torch import nn

import meshwise

D, D_OUT, BLOCKS = 32, 4, 3
SAMPLES, GLOBAL_BATCH, STEPS, LR = 80, 16, 5, 0.1
LOSS_RTOL, PARAM_ATOL = 2e-2, 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"input": torch.randn(SAMPLES, D, generator=g), "target": torch.randn(SAMPLES, D_OUT, generator=g)}


def reference(model: nn.Module, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """float32 plain torch on this device: each step's loss and the final parameters."""
    from meshwise.data import MeshSampler

    d = {k: v.to(device) for k, v in data().items()}
    sampler = MeshSampler(SAMPLES, GLOBAL_BATCH, mode="train", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        idx = torch.from_numpy(sampler.global_batch(step * GLOBAL_BATCH)).to(device)
        loss = F.mse_loss(model(d["input"][idx]), d["target"][idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(topo: meshwise.Topology, model: nn.Module) -> tuple[list[float], list[torch.dtype]]:
    """Five SGD steps through the trainer; each step's loss and the dtypes of the first block's first output."""
    from ignite.engine import Events

    from meshwise.data import ArrayDataset, mesh_dataloader

    seen: list[torch.dtype] = []
    model.blocks[0].fc1.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo)
    losses: list[float] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(float(e.state.output)))
    trainer.run(mesh_dataloader(ArrayDataset(data()), topo, global_batch_size=GLOBAL_BATCH), max_epochs=1)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, (n, p.dtype)
    return losses, seen


def compare(name: str, losses: list[float], model: nn.Module, ref: tuple[list[float], dict]) -> dict[str, float]:
    ref_losses, ref_params = ref
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    diff = max_param_diff(model, ref_params)
    assert len(losses) == STEPS, (name, losses)
    assert loss_rel <= LOSS_RTOL, f"{name}: a loss {loss_rel:.2e} (relative) from float32's: {losses} vs {ref_losses}"
    assert diff <= PARAM_ATOL, f"{name}: parameters {diff:.2e} from float32's"
    assert diff > 1e-6, f"{name}: parameters within {diff:.1e} of float32's: bf16 did not run"
    return {f"{name}_loss_rel": loss_rel, f"{name}_param_diff": diff}


def main() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    topo = init({"dp": -1})
    torch.manual_seed(0)
    net = Net().to(topo.device)
    ref = reference(copy.deepcopy(net), topo.device)
    results: dict[str, object] = {"ref_losses": ref[0]}

    model = meshwise.parallelize(copy.deepcopy(net), topo, fsdp_units=Block, precision="bf16")
    losses, seen = train(topo, model)
    assert seen and all(dt == torch.bfloat16 for dt in seen), f"parallelize(bf16): the block computed in {seen}"
    results.update(compare("parallelize", losses, model, ref))
    results["parallelize_path"] = "fsdp2" if topo.size("dp") > 1 else "autocast"

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    direct = copy.deepcopy(net)
    dp_mesh = topo.submesh("dp")
    for block in direct.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(direct, mesh=dp_mesh, mp_policy=policy)
    losses, seen = train(topo, direct)
    assert seen and all(dt == torch.bfloat16 for dt in seen), f"fully_shard(bf16): the block computed in {seen}"
    local = next(direct.parameters()).to_local()
    assert local.device == topo.device, local.device
    results.update(compare("fully_shard", losses, direct, ref))
    report("fsdp_bf16", topo, **results)
    meshwise.shutdown()


if __name__ == "__main__":
    main()
