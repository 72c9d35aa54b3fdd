"""parallelize + create_trainer train like one process (dp2xtp2 fsdp/replicate, dp4, tp4; clipping, accumulation,
masked rows), and bad plans or losses fail with clear errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshwise.testing import run_distributed

D, HEADS, T, OUT = 16, 4, 3, 8
GLOBAL_BATCH, STEPS, LR = 8, 5, 0.2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: each tensor-parallel rank holds HEADS / tp of them (local width of q, k, v)
        q, k, v = (m(x).view(b, t, -1, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.o": RowwiseParallel(),
        "blocks.*.fc1": ColwiseParallel(),
        "blocks.*.fc2": RowwiseParallel(),
    }


SAMPLES = STEPS * GLOBAL_BATCH - 3  # the last global batch has 3 padded rows (valid False)


def dataset() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"input": torch.randn(SAMPLES, T, D, generator=g), "target": torch.randn(SAMPLES, T, OUT, generator=g)}


def loader(topo):
    """meshwise.data's loader: shuffled, the short last batch padded (valid False) on the last data ranks."""
    from meshwise.data import ArrayDataset, mesh_dataloader

    return mesh_dataloader(
        ArrayDataset(dataset()), topo, global_batch_size=GLOBAL_BATCH, mode="train", seed=0, drop_last=False
    )


def global_batches() -> list[dict[str, torch.Tensor]]:
    """The loader's global batches, for the one-process reference; padded rows hold garbage."""
    from meshwise.data import MeshSampler

    data = dataset()
    sampler = MeshSampler(SAMPLES, GLOBAL_BATCH, mode="train", seed=0, drop_last=False)
    out = []
    for step in range(STEPS):
        idx = torch.from_numpy(sampler.global_batch(step * GLOBAL_BATCH))
        valid = idx >= 0
        batch = {k: v[idx.clamp(min=0)] for k, v in data.items()}
        batch["input"][~valid] = 1e3  # would wreck the step if it were not excluded
        out.append({**batch, "valid": valid})
    assert int((~out[-1]["valid"]).sum()) == 3
    return out


def reference_run(model: nn.Module, clip: float | None, momentum: float) -> tuple[list[float], dict, dict]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    losses = []
    for b in global_batches():
        v = b["valid"]
        loss = F.mse_loss(model(b["input"][v]), b["target"][v])
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    grads = [p.grad for p in model.parameters()]
    norms = {p: torch.nn.utils.get_total_norm(grads, p).item() for p in (2.0, 1.0, math.inf)}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def local_batch(topo, batch: dict) -> dict:
    """This rank's rows of a global batch: contiguous by data rank, the same on replica ranks."""
    n = GLOBAL_BATCH // topo.data_size
    lo = topo.data_rank * n
    return {k: v[lo : lo + n].clone() for k, v in batch.items()}


def _max_diff(model: nn.Module, ref: dict) -> float:
    from torch.distributed.tensor import DTensor

    worst = 0.0
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        worst = max(worst, (full - ref[name]).abs().max().item())
    return worst


VARIANTS = [  # (name, grad_clip, accumulation_steps, momentum)
    ("clip", 0.3, 1, 0.9),
    ("accum2", None, 2, 0.0),
]


def _equivalence(topo, dp_modes: list[str]) -> dict:
    from ignite.engine import Events

    import meshwise

    results = {}
    tp = topo.size(topo.replica_dims)
    for dp in dp_modes:
        for name, clip, accum, momentum in VARIANTS:
            torch.manual_seed(0)
            full = Net()  # full weights under one seed on every rank, then shard (docs/torch.md, random numbers)
            ref_losses, ref_params, ref_norms = reference_run(copy.deepcopy(full), clip, momentum)
            model = meshwise.parallelize(full, topo, tp_plan=tp_plan() if tp > 1 else None, dp=dp)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
            trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo, grad_clip=clip, accumulation_steps=accum)
            losses = []
            trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e, out=losses: out.append(e.state.output))
            data = loader(topo)
            assert len(data) == STEPS
            trainer.run(data, max_epochs=1)
            assert all(isinstance(x, float) for x in losses)
            results[f"{dp}/{name}"] = {
                "param_diff": _max_diff(model, ref_params),
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "losses": losses,
                "clip_active": clip is not None and trainer.state.grad_norm > clip,
                # the public clip_grad_norm on the last step's gradients (left in place) vs torch on one process
                "norm_rel_diff": max(
                    abs(meshwise.parallel.clip_grad_norm(model.parameters(), 1e9, topo, norm_type=p).item() - ref) / ref
                    for p, ref in ref_norms.items()
                ),
            }
    return results


def _check(results: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        for key, r in per_rank.items():
            assert r["param_diff"] <= 1e-5, (rank, key, r)
            assert r["loss_diff"] <= 1e-6, (rank, key, r)
            assert r["norm_rel_diff"] <= 1e-5, (rank, key, r)
            assert r["losses"] == results[0][key]["losses"], "engine.state.output differs between ranks"
            if key.endswith("clip"):
                assert r["clip_active"], "the clip threshold should bite in this test"
            assert all(math.isfinite(x) for x in r["losses"])


def _bad_inputs(topo) -> list[str]:
    """Each misuse raises a MeshwiseError naming the problem; returns the messages."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    import meshwise
    from meshwise.errors import MeshwiseError, ParallelError

    messages = []
    with pytest.raises(ParallelError, match="blocks.0.attn.query") as e:
        meshwise.parallelize(Net(), topo, tp_plan={"blocks.0.attn.query": ColwiseParallel()})
    messages.append(str(e.value))
    # DTensor parameters on a mesh that is not the topology's replica mesh (here: the dp mesh)
    model = Net()
    other = topo.submesh("dp")
    for mod in model.modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), other, [Replicate()])))
    with pytest.raises(ParallelError, match="already a DTensor on mesh") as e:
        meshwise.parallelize(model, topo, dp="replicate")
    messages.append(str(e.value))
    with pytest.raises(ParallelError, match="DDP is not offered"):
        meshwise.parallelize(Net(), topo, dp="ddp")
    ddp = torch.nn.parallel.DistributedDataParallel(Net(), process_group=topo.group("dp"))
    with pytest.raises(ParallelError, match="DistributedDataParallel"):
        meshwise.parallelize(ddp, topo)
    # a loss that is not a scalar: every rank raises at the same point, before any collective
    model = meshwise.parallelize(Net(), topo, tp_plan=tp_plan())
    trainer = meshwise.create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lambda o, t: F.mse_loss(o, t, reduction="none"), topo
    )
    with pytest.raises(MeshwiseError, match="not a scalar tensor") as e:
        trainer.run([local_batch(topo, global_batches()[0])], max_epochs=1)
    messages.append(str(e.value))
    with pytest.raises(ParallelError, match="not data parallel"):
        meshwise.create_trainer(Net(), torch.optim.SGD(Net().parameters(), lr=0.1), F.mse_loss, topo)
    return messages


def _dp2_tp2(topo) -> dict:
    return {"equivalence": _equivalence(topo, ["fsdp", "replicate"]), "errors": _bad_inputs(topo)}


def test_dp2_tp2_fsdp_and_replicate_match_one_process_and_bad_input_fails():
    results = run_distributed(_dp2_tp2, 4, mesh={"dp": 2, "tp": 2}, timeout=150)
    _check([r["equivalence"] for r in results])
    for msg in results[0]["errors"]:
        assert any(word in msg for word in ("use ", "Build ", "return ", "pass ")), msg  # says what to do


@pytest.mark.parametrize("mesh", [{"dp": 4}, {"tp": 4}])
def test_dp4_and_tp4_match_one_process(mesh):
    # dp="replicate" is covered beside TP at dp=2 x tp=2; at tp=4 there is no data parallel to apply
    _check(run_distributed(_equivalence, 4, ["fsdp"], mesh=mesh, timeout=150))


def _one_process(topo) -> dict:
    from torch.distributed._composable.replicate import replicate

    import meshwise
    from meshwise.errors import ParallelError

    with pytest.raises(ParallelError, match="exactly one mesh dim with role 'replica'"):
        meshwise.parallelize(Net(), topo, tp_plan=tp_plan())
    legacy = replicate(Net())
    with pytest.raises(ParallelError, match="_composable.replicate"):
        meshwise.parallelize(legacy, topo)
    with pytest.raises(ParallelError, match="_composable.replicate"):
        meshwise.create_trainer(legacy, torch.optim.SGD(legacy.parameters(), lr=0.1), F.mse_loss, topo)
    return _equivalence(topo, ["fsdp"])


def test_one_process_trainer_and_tp_without_replica_dim():
    import meshwise

    topo = meshwise.init({"dp": 1})  # in this process: a world of one needs no launch
    try:
        _check([_one_process(topo)])
    finally:
        meshwise.shutdown()
