"""``loss_weight="labels"``: the causal-LM loss as Hugging Face means it (mean over the non-ignored labels of
the whole global batch) matches one float64 process on dp=4, dp=2 x tp=2 and pipelined at pp=2 x dp=2; -100
labels under the sample or token weighting are refused; a transformers ``ModelOutput`` reaches ``loss_fn`` as
its logits, from a plain model and from the last pipeline stage alike, and the evaluator's metrics as well."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshwise
from meshwise.errors import MeshwiseError
from meshwise.testing import run_distributed

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/ is on sys.path under pytest's default import mode, and in the ranks)

V, D, T, GLOBAL_BATCH, STEPS, ACCUMULATION = 24, 8, 6, 8, 4, 2


class TinyCausalLM(nn.Module):
    """Embedding, one MLP block and a vocab head; returns a transformers ``ModelOutput`` like an HF model.

    Pieces a pipeline stage does not hold are None and skipped, so ``cut=["fc1"]`` gives a first stage of the
    embedding alone and a last stage returning the ``ModelOutput``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, V)

    def forward(self, input_ids: torch.Tensor):
        from transformers.modeling_outputs import CausalLMOutput

        x = self.embed(input_ids) if self.embed is not None else input_ids
        if self.fc1 is not None:
            x = x + self.fc2(F.gelu(self.fc1(x)))
        return x if self.head is None else CausalLMOutput(logits=self.head(x))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The micro-batch's mean over its non-ignored (already shifted) labels."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def masked_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same mean written by hand (per-token losses summed over the scored labels, divided by their number):
    with nothing scored its gradient is 0 * inf = NaN unless the trainer keeps such a micro-batch finite."""
    scored = (labels != -100).flatten()
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
    return (per_token * scored).sum() / scored.sum()


def global_batches() -> list[dict[str, torch.Tensor]]:
    """Shifted labels with -100 in uneven amounts: rows 2-3 (one micro-batch of dp=4's rank 1) score nothing on
    even steps (hf_tiny.batches)."""
    return [{"input": b["input"], "target": b["target"]} for b in hf_tiny.batches(STEPS, GLOBAL_BATCH, T, 5, V, True)]


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyCausalLM().double()
    start = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for b in global_batches():
        loss = causal_lm_loss(model(b["input"]).logits, b["target"])  # one process: mean over all scored labels
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"start": start, "end": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _train(topo: meshwise.Topology, start: dict, kind: str) -> tuple[nn.Module, list[float]]:
    """Train from ``start`` on ``topo`` (``kind``: "dp", "tp" or "pp"); the model and each step's global loss."""
    from ignite.engine import Events
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

    full = TinyCausalLM().double()
    full.load_state_dict(start)
    tp = kind == "tp"
    if tp:
        plan = {
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        model = meshwise.parallelize(full, topo, tp_plan=plan, dp="fsdp")
    elif kind == "pp":  # the last stage's CausalLMOutput reaches loss_fn as its logits; a micro-batch = one row
        model = meshwise.parallelize(full, topo, cut=["fc1"], schedule="1F1B", microbatches=2)
    else:
        model = meshwise.parallelize(full, topo, dp="fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    trainer = meshwise.create_trainer(
        model,
        opt,
        masked_mean_loss if kind == "pp" else causal_lm_loss,
        topo,
        loss_weight="labels",
        accumulation_steps=ACCUMULATION,
        step_context=loss_parallel if tp else None,
    )
    losses: list[float] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    n = GLOBAL_BATCH // topo.data_size
    lo = topo.data_rank * n
    trainer.run([{k: v[lo : lo + n] for k, v in b.items()} for b in global_batches()], max_epochs=1)
    return model, losses


def _both_meshes(reference: dict) -> dict:
    """On 4 ranks: dp=4, dp=2 x tp=2, then pp=2 x dp=2 on the same process group; max parameter difference of each."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")  # meshwise adopts it, so shutdown() keeps it for the second mesh
    out = {}
    meshes = (("dp4", {"dp": 4}, "dp"), ("dp2tp2", {"dp": 2, "tp": 2}, "tp"), ("pp2dp2", {"pp": 2, "dp": 2}, "pp"))
    for name, mesh, kind in meshes:
        topo = meshwise.init(mesh)
        try:
            model, losses = _train(topo, reference["start"], kind)
            end = reference["end"]
            out[name] = max(
                ((p.full_tensor() if isinstance(p, DTensor) else p.detach()) - end[k]).abs().max().item()
                for k, p in model.named_parameters()
            )
            out[name + "_losses"] = losses
        finally:
            meshwise.shutdown()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_both_meshes, 4, _reference(), timeout=240)


def test_labels_weighting_matches_one_process_on_dp_and_tp(ranks):
    for r in ranks:
        assert r["dp4"] <= 1e-12 and r["dp2tp2"] <= 1e-12, r
        assert r["dp4_losses"] == ranks[0]["dp4_losses"] and all(x == x for x in r["dp4_losses"]), r  # no NaN


def test_labels_weighting_and_model_output_through_pipeline_stages(ranks):
    # pp=2 x dp=2, two accumulation parts of two one-row micro-batches: on even steps data rank 0's second part
    # (rows 2-3) scores nothing, so a whole schedule step weighs 0 (and must leave no NaN)
    print("pp2 x dp2, loss_weight='labels', CausalLMOutput:", [r["pp2dp2"] for r in ranks])
    for r in ranks:
        assert r["pp2dp2"] <= 1e-12, r
        assert r["pp2dp2_losses"] == ranks[0]["pp2dp2_losses"], r  # every stage reports the global loss
        assert all(abs(a - b) <= 1e-12 for a, b in zip(r["pp2dp2_losses"], r["dp4_losses"])), r


def test_ignored_labels_under_count_weightings_are_refused_and_empty_micro_is_finite():
    topo = meshwise.init({"dp": 1})
    try:
        torch.manual_seed(0)
        model = TinyCausalLM().double()
        batch = global_batches()[0]
        for weight in ("samples", "tokens"):
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            trainer = meshwise.create_trainer(model, opt, causal_lm_loss, topo, loss_weight=weight)
            with pytest.raises(MeshwiseError, match="loss_weight='labels'"):
                trainer.run([batch], max_epochs=1)
        # integer targets without -100 keep the sample weighting working as before
        clean = {"input": batch["input"], "target": batch["input"].roll(-1, 1)}
        trainer = meshwise.create_trainer(model, torch.optim.AdamW(model.parameters()), causal_lm_loss, topo)
        trainer.run([clean], max_epochs=1)
        assert trainer.state.loss_count == GLOBAL_BATCH
        # a micro-batch with no scored label weighs 0 and leaves no NaN
        before = [p.detach().clone() for p in model.parameters()]
        partly = {"input": batch["input"], "target": batch["target"].clone()}
        partly["target"][: GLOBAL_BATCH // 2] = -100
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        trainer = meshwise.create_trainer(model, opt, causal_lm_loss, topo, loss_weight="labels", accumulation_steps=2)
        trainer.run([partly], max_epochs=1)
        assert trainer.state.loss_count == float((partly["target"] != -100).sum())
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert any((p - b).abs().max() > 0 for p, b in zip(model.parameters(), before))
        # the evaluator hands its metrics the ModelOutput's logits, as the trainer hands them to loss_fn
        from torchmetrics import MeanMetric

        class LabelsLoss(MeanMetric):
            def update(self, logits, target):
                super().update(causal_lm_loss(logits, target), weight=float((target != -100).sum()))

        evaluator = meshwise.create_evaluator(model, topo, {"loss": LabelsLoss().set_dtype(torch.float64)})
        evaluator.run([partly, batch], max_epochs=1)
        assert isinstance(evaluator.state.output[0], torch.Tensor)
        with torch.no_grad():
            expected = causal_lm_loss(
                model(torch.cat([partly["input"], batch["input"]])).logits,
                torch.cat([partly["target"], batch["target"]]),
            )
        assert abs(evaluator.state.metrics["loss"] - expected.item()) <= 1e-12
    finally:
        meshwise.shutdown()
