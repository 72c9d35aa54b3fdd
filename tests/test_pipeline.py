"""Pipeline stages: parallelize over a stage dim + the trainer running GPipe, 1F1B and interleaved schedules
equal one process (fp64, AdamW, clipping, a padded last batch) at pp=2, pp2xdp2, pp2xtp2, pp2xdp2xtp2;
stage-aware loading; evaluation through the pipeline; checkpoints across stage counts; bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshwise.testing import run_distributed

D_IN, D, HEADS, T, OUT = 5, 8, 2, 3, 4
GLOBAL_BATCH, STEPS, LR, CLIP = 8, 5, 0.01, 0.5
# AdamW moves a weight whose gradient is far below eps by lr/eps times that gradient: with the default eps (1e-8)
# a 1e-18 summation-order difference becomes 1e-12; eps=1e-6 keeps rounding, not amplification, in view.
EPS = 1e-6
SAMPLES = STEPS * GLOBAL_BATCH - 3  # the last global batch has 3 padded rows (valid False)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    """Written the way pipeline stages need: a piece another stage holds is None and is skipped."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"blocks.*.attn.{n}": ColwiseParallel() for n in "qkv"}
    return {
        **plan,
        "blocks.*.attn.o": RowwiseParallel(),
        "blocks.*.fc1": ColwiseParallel(),
        "blocks.*.fc2": RowwiseParallel(),
    }


def dataset() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, T, D_IN, generator=g, dtype=torch.float64)
    return {"input": x, "target": torch.randn(SAMPLES, T, OUT, generator=g, dtype=torch.float64)}


def loader(topo, stage_fields=None, mode="train", batch=GLOBAL_BATCH):
    from meshwise.data import ArrayDataset, mesh_dataloader

    kw = {} if stage_fields is None else {"stage_fields": stage_fields}
    return mesh_dataloader(ArrayDataset(dataset()), topo, global_batch_size=batch, mode=mode, drop_last=False, **kw)


def reference(model: nn.Module, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain torch on one process: the loader's global batches, valid rows only, AdamW, clip_grad_norm_."""
    from meshwise.data import MeshSampler

    data = dataset()
    sampler = MeshSampler(SAMPLES, GLOBAL_BATCH, mode="train", seed=0, drop_last=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(steps):
        idx = torch.from_numpy(sampler.global_batch(step * GLOBAL_BATCH))
        idx = idx[idx >= 0]
        loss = F.mse_loss(model(data["input"][idx]), data["target"][idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(model: nn.Module, ref: dict) -> float:
    from torch.distributed.tensor import DTensor

    worst = 0.0
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        worst = max(worst, (full - ref[name]).abs().max().item())
    return worst


def build(topo, schedule: str = "1F1B", microbatches: int = 2, **kw):
    """A user's script: full weights under one seed, parallelize over the mesh, AdamW, a trainer with clipping."""
    import meshwise

    torch.manual_seed(0)
    net = Net().double()
    plan = tp_plan() if topo.size(topo.replica_dims) > 1 else None
    model = meshwise.parallelize(net, topo, tp_plan=plan, schedule=schedule, microbatches=microbatches, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo, grad_clip=CLIP)
    return net, model, opt, trainer


FIELDS = {"first": ["input"], "last": ["target"]}


def train(topo, schedule: str, microbatches: int, **kw) -> tuple[nn.Module, dict]:
    """Five steps of the padded loader; the largest parameter difference from one process, and what ranks saw."""
    from ignite.engine import Events

    net, model, opt, trainer = build(topo, schedule, microbatches, **kw)
    ref = reference(copy.deepcopy(net))
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append((e.state.output, e.state.grad_norm)))
    trainer.run(loader(topo, FIELDS), max_epochs=1)
    return model, {"diff": max_diff(model, ref), "seen": seen}


def _equivalence(topo, runs: list[tuple[str, int]]) -> dict:
    return {f"{s}/{m}": train(topo, s, m)[1] for s, m in runs}


# valid masks of three global batches of 8 rows, 2 micro-batches of 4: padding inside a micro-batch, padding
# first, and a micro-batch with no valid row (the boolean-mask and empty paths of the pipeline's loss)
MASKS = [[1, 0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 1, 0], [0, 1, 0, 1, 0, 0, 0, 0]]


def _masked(topo) -> float:
    """Batches whose padded rows sit inside micro-batches, filled with large garbage, train like one process
    on the valid rows only; returns the largest parameter difference."""
    net, model, opt, trainer = build(topo, "1F1B", 2)
    g = torch.Generator().manual_seed(5)
    batches = []
    for mask in MASKS:
        valid = torch.tensor(mask, dtype=torch.bool)
        x = torch.randn(8, T, D_IN, generator=g, dtype=torch.float64)
        y = torch.randn(8, T, OUT, generator=g, dtype=torch.float64)
        x[~valid], y[~valid] = 100.0, -100.0  # what a padded row holds must not matter
        batches.append({"input": x, "target": y, "valid": valid})
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for b in batches:
        loss = F.mse_loss(ref(b["input"][b["valid"]]), b["target"][b["valid"]])
        ref_opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
    trainer.run(batches, max_epochs=1)
    return max_diff(model, {n: p.detach() for n, p in ref.named_parameters()})


def _pp2(topo, runs: list[tuple[str, int]]) -> dict:
    return {**_equivalence(topo, runs), "masked": _masked(topo)}


def _check(results: list[dict], tol: float = 1e-12) -> None:
    for rank, per_rank in enumerate(results):
        for key, r in per_rank.items():
            assert r["diff"] <= tol, (rank, key, r["diff"])
            assert r["seen"] == results[0][key]["seen"], "state.output / grad_norm differ between ranks"
            assert len(r["seen"]) == STEPS and r["seen"][0][1] > CLIP, "five steps; the clip threshold bites"


def test_pp2_gpipe_1f1b_interleaved_match_one_process():
    runs = [("GPipe", 2), ("1F1B", 4), ("Interleaved1F1B", 2)]
    results = run_distributed(_pp2, 2, runs, mesh={"pp": 2}, timeout=200)
    masked = [r.pop("masked") for r in results]
    assert max(masked) <= 1e-12, masked  # padded rows inside micro-batches (boolean mask, empty micro-batch)
    print("padded rows inside micro-batches: largest parameter difference", masked)
    _check(results)


def test_pp2_tp2_1f1b_matches_one_process():
    _check(run_distributed(_equivalence, 4, [("1F1B", 2)], mesh={"pp": 2, "tp": 2}, timeout=200))


@pytest.mark.slow
def test_pp2_dp2_tp2_interleaved_matches_one_process():
    _check(run_distributed(_equivalence, 8, [("Interleaved1F1B", 2)], mesh={"pp": 2, "dp": 2, "tp": 2}, timeout=400))


def eval_reference(params: dict) -> float:
    """Mean squared error over every sample, plain torch on one process, from the one-process parameters."""
    net = Net().double()
    net.load_state_dict(params)
    data = dataset()
    with torch.no_grad():
        return F.mse_loss(net(data["input"]), data["target"]).item()


def evaluate(topo, model) -> float:
    from torchmetrics import MeanSquaredError

    import meshwise

    evaluator = meshwise.create_evaluator(model, topo, {"mse": MeanSquaredError().set_dtype(torch.float64)})
    evaluator.run(loader(topo, FIELDS, mode="eval", batch=12))  # 37 samples: the last batch padded
    return evaluator.state.metrics["mse"]


def epoch_bytes(topo, fields) -> int:
    data = loader(topo, fields)
    for _ in data:
        pass
    return data.bytes_read


def _pp2_dp2(topo, folder: str) -> dict:
    """GPipe equivalence and evaluation, bytes read by stage, a checkpoint after 3 steps, and bad input."""
    import meshwise

    model, out = train(topo, "GPipe", 2)
    torch.manual_seed(0)
    out["eval"] = evaluate(topo, model)
    out["eval_ref"] = eval_reference(reference(Net().double()))
    out["bytes"] = (epoch_bytes(topo, FIELDS), epoch_bytes(topo, None))
    _, model, opt, trainer = build(topo, "1F1B", 2)
    data = loader(topo, FIELDS)
    trainer.run(data, max_epochs=1, epoch_length=3)
    ckpt = meshwise.Checkpointer(folder, topo, verbose=False)
    ckpt.save(3, model=model, optimizer=opt, loader=data)
    ckpt.close()
    out["errors"] = bad_inputs(topo)
    return out


def bad_inputs(topo) -> list[str]:
    """Each raises ParallelError before any collective (every rank raises alike, nothing hangs)."""
    import meshwise
    from meshwise.errors import ParallelError

    messages = []
    for kw, match in [
        ({"cut": ["blocks.9"]}, "blocks.9"),
        ({"cut": ["blocks.2", "head"]}, "need 1"),
        ({"stages_per_rank": 3, "schedule": "Interleaved1F1B"}, "6 pipeline stages"),
        ({"schedule": "ZeroBubble"}, "ZeroBubble"),
        ({"microbatches": 0}, "microbatches"),
    ]:
        with pytest.raises(ParallelError, match=match) as e:
            meshwise.parallelize(Net().double(), topo, **kw)
        messages.append(str(e.value))
    _, _, _, trainer = build(topo, "GPipe", 3)  # 3 micro-batches of a local batch of 4
    with pytest.raises(ParallelError, match="does not divide the local batch of 4") as e:
        trainer.run(loader(topo, FIELDS), max_epochs=1)
    messages.append(str(e.value))
    return messages


def _resume(topo, folder: str, cuts: list) -> dict:
    """Load the pp2xdp2 checkpoint of step 3 at this mesh (each cut in turn), train steps 4 and 5."""
    import meshwise

    out = {}
    for cut in cuts:
        net, model, opt, trainer = build(topo, "1F1B", 4 if topo.size(topo.stage_dims) == 4 else 2, cut=cut)
        ref = reference(copy.deepcopy(net))
        data = loader(topo, FIELDS)
        ckpt = meshwise.Checkpointer(folder, topo, verbose=False)
        info = ckpt.load("latest", model=model, optimizer=opt, loader=data)
        ckpt.close()
        trainer.run(data, max_epochs=1, epoch_length=2)
        out[str(cut)] = {"diff": max_diff(model, ref), "step": info.step, "cursor": data.state_dict()}
    out["middle_bytes"] = epoch_bytes(topo, FIELDS)
    return out


@pytest.mark.slow
def test_pp2_dp2_gpipe_eval_stage_reads_checkpoint_and_bad_input(tmp_path):
    results = run_distributed(_pp2_dp2, 4, str(tmp_path), mesh={"pp": 2, "dp": 2}, timeout=300)
    _check([{"gpipe": r} for r in results])
    for rank, r in enumerate(results):
        assert abs(r["eval"] - r["eval_ref"]) <= 1e-12, (rank, r["eval"], r["eval_ref"])
        staged, whole = r["bytes"]
        per_sample = {"input": T * D_IN * 8, "target": T * OUT * 8}
        share = whole // (per_sample["input"] + per_sample["target"])  # samples this rank read
        assert staged == share * per_sample["input" if rank < 2 else "target"], (rank, staged, whole)
        assert len(r["errors"]) == 6
    print("bytes by stage (staged, whole):", [r["bytes"] for r in results])
    # resume the pp2xdp2 checkpoint at pp=4 (the default cut, then another) and at one process (pp=1)
    cuts = [None, ["blocks.0", "blocks.2", "blocks.3"]]
    at_pp4 = run_distributed(_resume, 4, str(tmp_path), cuts, mesh={"pp": 4}, timeout=300)
    at_pp1 = run_distributed(_resume, 1, str(tmp_path), [None], mesh={"dp": 1}, timeout=120)
    for rank, r in enumerate(at_pp4 + at_pp1):
        for cut in map(str, cuts if rank < 4 else [None]):
            assert r[cut]["diff"] <= 1e-12 and r[cut]["step"] == 3, (rank, cut, r[cut])
            assert r[cut]["cursor"] == at_pp1[0]["None"]["cursor"], "the data cursor continues from step 3"
    assert [r["middle_bytes"] for r in at_pp4][1:3] == [0, 0], "middle stages read nothing"
