"""A transformers user's habits through ``create_trainer``, each equal to one float64 process or refused by name:
a forward before the optimizer is made under FSDP2 (an evaluation, which now trains right; a no-grad probe after
``load_hf``, refused until the optimizer is rebuilt), ``labels = input_ids`` with a ``loss_fn`` that shifts
inside (refused; ``prepare=shift_labels`` and transformers' ``shift_labels`` field train like one process), a
``loss_fn`` returning ``out.loss``, and a tied model that ``to_empty`` untied before ``load_hf``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import meshwise
from meshwise.errors import CheckpointError, MeshwiseError
from meshwise.testing import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_tiny  # noqa: E402  (tests/ is on sys.path under pytest's default import mode, and in the ranks)

ROWS, LENGTH, STEPS = 4, 8, 2


def causal_lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss meshwise documents: the mean over the micro-batch's scored labels, already aligned with the logits."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def summed_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The summed loss of the scored labels (0 for a row with none), for a metric that weighs rows."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")


def shifting_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The usual causal-LM habit: labels are the input ids and the loss shifts them itself."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def global_batches() -> list[dict[str, torch.Tensor]]:
    """Input ids and Hugging Face labels (the ids, -100 on uneven parts of the rows; position 0 scored)."""
    return [{"input": b["input"], "labels": b["labels"]} for b in hf_tiny.batches(STEPS, ROWS, LENGTH, 7, ignore=True)]


def _reference(start: dict) -> dict[str, torch.Tensor]:
    """One process on each global batch, AdamW: Hugging Face's loss (its own shift of ``labels``), in float64
    (``model(labels=...).loss`` upcasts the logits only to float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_tiny.config()).to(torch.float64)
    model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for b in global_batches():
        opt.zero_grad()
        causal_lm_loss(model(input_ids=b["input"]).logits, hf_tiny.shift(b["labels"])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _loaded(topo: meshwise.Topology, folder: str):
    """As docs/hf.md: built on the meta device, sharded (FSDP2 at dp=2), materialised, then ``load_hf``."""
    from transformers import AutoModelForCausalLM

    from meshwise.checkpoint import load_hf

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_tiny.config()).to(torch.float64)
    model = meshwise.parallelize(model, topo)
    model.to_empty(device=topo.device)
    load_hf(folder, model)
    return model


def _local(topo: meshwise.Topology, batch: dict) -> dict:
    n = ROWS // topo.data_size
    return {k: v[topo.data_rank * n : (topo.data_rank + 1) * n] for k, v in batch.items()}


def _difference(model, reference: dict) -> float:
    from torch.distributed.tensor import DTensor

    return max(
        ((p.full_tensor() if isinstance(p, DTensor) else p).detach() - reference[k]).abs().max().item()
        for k, p in model.named_parameters()
    )


def _habits(topo: meshwise.Topology, folder: str, reference: dict) -> dict:
    from meshwise.engine import shift_labels
    from meshwise.metrics import MeanLoss

    out: dict = {}
    batches = [_local(topo, b) for b in global_batches()]

    # an evaluation before the optimizer is made, then labels = input_ids fixed by prepare=shift_labels
    model = _loaded(topo, folder)
    evaluator = meshwise.create_evaluator(model, topo)
    evaluator.run([{"input": b["input"], "target": hf_tiny.shift(b["labels"])} for b in batches], max_epochs=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = meshwise.create_trainer(model, opt, causal_lm_loss, topo, loss_weight="labels", prepare=shift_labels)
    trainer.run([{"input": b["input"], "target": b["labels"]} for b in batches], max_epochs=1)
    out["evaluated_then_shift_labels"] = _difference(model, reference)

    # a no-grad probe after load_hf, then the optimizer: refused; rebuilt, it trains on transformers' field names
    model = _loaded(topo, folder)
    with torch.no_grad():
        model(input_ids=batches[0]["input"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        meshwise.create_trainer(model, opt, causal_lm_loss, topo, loss_weight="labels")
        out["probe_error"] = None
    except MeshwiseError as exc:
        out["probe_error"] = str(exc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = meshwise.create_trainer(
        model, opt, causal_lm_loss, topo, loss_weight="labels", input_key="input_ids", target_key="labels"
    )
    hf_batches = [
        {"input_ids": b["input"], "labels": b["labels"], "shift_labels": hf_tiny.shift(b["labels"])} for b in batches
    ]
    trainer.run(hf_batches, max_epochs=1)
    out["probe_then_shift_labels_field"] = _difference(model, reference)
    # the evaluator scores transformers' shift_labels field as the trainer does, not the unshifted labels
    losses = []
    for data in (hf_batches, [{"input_ids": b["input_ids"], "labels": b["shift_labels"]} for b in hf_batches]):
        evaluator = meshwise.create_evaluator(
            model, topo, {"loss": MeanLoss(summed_loss)}, input_key="input_ids", target_key="labels"
        )
        losses.append(evaluator.run(data, max_epochs=1).metrics["loss"])
    out["eval_shift_labels_field"] = abs(float(losses[0]) - float(losses[1]))

    # labels = input_ids with a loss_fn that shifts inside: refused on every rank at the first step
    model = _loaded(topo, folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = meshwise.create_trainer(model, opt, shifting_loss, topo, loss_weight="labels", target_key="labels")
    try:
        trainer.run(batches, max_epochs=1)
        out["habit_error"] = None
    except MeshwiseError as exc:
        out["habit_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("habits") / "pretrained"
    start = hf_tiny.llama()
    start.save_pretrained(str(folder))
    reference = _reference(copy.deepcopy(start.state_dict()))
    return run_distributed(_habits, 2, str(folder), reference, mesh={"dp": 2}, timeout=180)


def test_evaluation_before_the_optimizer_trains_like_one_process(ranks):
    for r in ranks:
        assert r["evaluated_then_shift_labels"] <= 1e-12, r


def test_probe_forward_before_the_optimizer_is_refused_and_a_rebuilt_one_trains(ranks):
    print("probe refusal:", ranks[0]["probe_error"])
    for r in ranks:
        assert r["probe_error"] is not None and "gathered" in r["probe_error"], r
        assert "meshwise.parallel.reshard(model)" in r["probe_error"], r
        assert r["probe_then_shift_labels_field"] <= 1e-12, r


def test_labels_equal_to_inputs_are_refused_on_every_rank(ranks):
    print("labels habit refusal:", ranks[0]["habit_error"])
    for r in ranks:
        assert r["habit_error"] is not None and "labels = input_ids" in r["habit_error"], r
        assert "shift_labels" in r["habit_error"], r


def test_the_evaluator_scores_the_shift_labels_field(ranks):
    for r in ranks:
        assert r["eval_shift_labels_field"] <= 1e-12, r


def test_differences_measured(ranks):
    print("vs one process:", {k: v for k, v in ranks[0].items() if not k.endswith("error")})


def test_labels_unshifted_tells_the_habit_from_shifted_targets():
    from meshwise.causal_lm import labels_unshifted

    ids = torch.tensor([[5, 9, 2, 7, 3, 8], [1, 4, 4, 6, 0, 2]])
    labels = ids.clone()
    labels[1, :2] = -100  # a masked prompt
    assert labels_unshifted({"input": ids, "target": labels}, "input", "target") is True
    assert labels_unshifted({"input_ids": ids, "labels": labels}, "input", "labels") is True  # HF field names
    assert labels_unshifted({"input": ids, "target": hf_tiny.shift(labels)}, "input", "target") is False
    # a run of one repeated token fits both readings: undecided, never refused
    same = torch.full((2, 6), 3)
    assert labels_unshifted({"input": same, "target": same}, "input", "target") is None
    # an MLM batch: labels where tokens were masked (the input holds the mask id there)
    masked = ids.clone()
    masked[:, 2] = 63
    mlm = torch.full_like(ids, -100)
    mlm[:, 2] = ids[:, 2]
    assert labels_unshifted({"input": masked, "target": mlm}, "input", "target") is False
    # a context-parallel rank's two balanced chunks of shifted targets, positions 0-1 and 6-7 of 8: the border
    # breaks the shift once, every other neighbour keeps it
    window = torch.tensor([[4, 4, 4, 4, 9, 9, 9, 9, 9], [2, 2, 2, 2, 5, 5, 5, 5, 5]])
    positions = torch.tensor([[0, 1, 6, 7]]).expand(2, -1)
    chunk = {"input": window[:, :-1][:, [0, 1, 6, 7]], "target": window[:, 1:][:, [0, 1, 6, 7]]}
    assert labels_unshifted({**chunk, "positions": positions}, "input", "target") is None
    # no inputs on this pipeline stage, or float targets: undecided
    assert labels_unshifted({"target": labels}, "input", "target") is None
    assert labels_unshifted({"input": ids.double(), "target": ids.double()}, "input", "target") is None


def test_out_loss_and_a_tie_broken_by_to_empty_are_named(tmp_path):
    from transformers import AutoModelForCausalLM

    from meshwise.checkpoint import load_hf
    from meshwise.engine import shift_labels

    topo = meshwise.init({"dp": 1})
    try:
        b = global_batches()[0]
        # the transformers habit: labels= into the model, and its .loss as the loss
        model = meshwise.parallelize(hf_tiny.llama(), topo)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = meshwise.create_trainer(
            model,
            opt,
            lambda out, batch: out.loss,
            topo,
            target_key=None,
            forward=lambda m, batch: m(input_ids=batch["input"], labels=batch["labels"]),
        )
        with pytest.raises(MeshwiseError, match=r"loss_fn read output.loss.*receives the model's output as a tensor"):
            trainer.run([b], max_epochs=1)
        # shift_labels: Hugging Face's shift on the batch
        shifted = shift_labels({"input": b["input"], "target": b["labels"]})
        assert torch.equal(shifted["target"], hf_tiny.shift(b["labels"])) and shifted["input"] is b["input"]
        assert shift_labels({"input": b["input"]}) == {"input": b["input"]}  # a stage without labels
        # a tied model built on the meta device and materialised by to_empty has lost its tie
        saved = hf_tiny.llama(tie=True)
        saved.save_pretrained(str(tmp_path / "tied"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_tiny.config(tie=True)).to(torch.float64)
        model = meshwise.parallelize(model, topo)
        model.to_empty(device=topo.device)
        with pytest.raises(CheckpointError, match=r"tie_word_embeddings=True.*model.tie_weights\(\)"):
            load_hf(tmp_path / "tied", model)
        model.tie_weights()  # the fix the message names
        load_hf(tmp_path / "tied", model)
        with torch.no_grad():
            assert torch.equal(model(input_ids=b["input"]).logits, saved(input_ids=b["input"]).logits)
    finally:
        meshwise.shutdown()
