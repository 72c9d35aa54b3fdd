"""Pipeline stages of a Hugging Face decoder-only model (a tiny random float64 LlamaForCausalLM): cuts by module
path inside ``model.layers``, stage modules that chain to the full model's logits under its parameter names,
pp2xdp2 training (1F1B with a user cut, interleaved with the default cut) equal to one process; bad cuts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from meshwise.testing import run_distributed

pytest.importorskip("transformers")

VOCAB, T, GLOBAL_BATCH, STEPS, LR, CLIP = 64, 6, 8, 3, 0.01, 0.5
EPS = 1e-6  # as in tests/test_pipeline.py: keeps AdamW from amplifying 1e-18 summation-order differences
SAMPLES = STEPS * GLOBAL_BATCH


def llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        intermediate_size=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).double()


def dataset() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (SAMPLES, T + 1), generator=g)
    return {"input": ids[:, :-1].contiguous(), "target": ids[:, 1:].contiguous()}


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def reference(model) -> dict[str, torch.Tensor]:
    """Plain torch on one process: the loader's global batches, the HF forward, AdamW, clip_grad_norm_."""
    from meshwise.data import MeshSampler

    data = dataset()
    sampler = MeshSampler(SAMPLES, GLOBAL_BATCH, mode="train", seed=0, drop_last=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        idx = torch.from_numpy(sampler.global_batch(step * GLOBAL_BATCH))
        loss = loss_fn(model(data["input"][idx]).logits, data["target"][idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(topo, runs: list[tuple[str, list | None]]) -> dict:
    """Each (schedule, cut): STEPS clipped AdamW steps at this mesh; the largest difference from one process."""
    from ignite.engine import Events
    from torch.distributed.tensor import DTensor

    import meshwise
    from meshwise.data import ArrayDataset, mesh_dataloader

    out = {}
    for schedule, cut in runs:
        full = llama()
        ref = reference(copy.deepcopy(full))
        model = meshwise.parallelize(full, topo, schedule=schedule, microbatches=2, cut=cut)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        trainer = meshwise.create_trainer(model, opt, loss_fn, topo, grad_clip=CLIP)
        seen = []
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e, seen=seen: seen.append(e.state.output))
        data = mesh_dataloader(ArrayDataset(dataset()), topo, global_batch_size=GLOBAL_BATCH, drop_last=False)
        trainer.run(data, max_epochs=1)
        worst, names = 0.0, []
        for name, p in model.named_parameters():
            local = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            worst = max(worst, (local - ref[name]).abs().max().item())
            names.append(name)
        out[schedule] = {"diff": worst, "names": names, "seen": seen, "stages": model.stage_indices}
    return out


def test_pp2_dp2_llama_1f1b_and_interleaved_match_one_process():
    runs = [("1F1B", ["model.layers.1"]), ("Interleaved1F1B", None)]
    results = run_distributed(_train, 4, runs, mesh={"pp": 2, "dp": 2}, timeout=240)
    full = dict(llama().named_parameters())
    for rank, per_rank in enumerate(results):
        for schedule, r in per_rank.items():
            assert r["diff"] <= 1e-12, (rank, schedule, r["diff"])
            assert len(r["seen"]) == STEPS and r["seen"] == results[0][schedule]["seen"], (rank, schedule)
            assert set(r["names"]) <= set(full), "stage parameters keep the full model's names"
    print("pp2xdp2 Llama, largest parameter difference:", {s: [r[s]["diff"] for r in results] for s in results[0]})
    one_f = [set(r["1F1B"]["names"]) for r in results]
    assert one_f[0] | one_f[2] == set(full) and not one_f[0] & one_f[2], "the two stages share the model out"
    assert {n.split(".")[2] for n in one_f[0] if n.startswith("model.layers.")} == {"0"}, "cut at model.layers.1"
    inter = [set(r["Interleaved1F1B"]["names"]) for r in results]
    assert results[0]["Interleaved1F1B"]["stages"] == [0, 2] and inter[0] | inter[2] == set(full)
    assert {n.split(".")[2] for n in inter[0] if n.startswith("model.layers.")} == {"0", "2"}


def test_stages_chain_to_the_full_logits_under_full_names():
    from meshwise.parallel.pipeline import _prune, pipeline_units, stage_cuts

    model = llama()
    layers = [f"model.layers.{k}" for k in range(4)]
    assert pipeline_units(model) == ["model.embed_tokens", *layers, "model.norm", "lm_head"]
    cuts = stage_cuts(model, 3, ["model.layers.1", "model.layers.3"])
    assert cuts == [["model.embed_tokens", "model.layers.0"], layers[1:3], ["model.layers.3", "model.norm", "lm_head"]]
    assert stage_cuts(model, 2) == [["model.embed_tokens", *layers[:2]], [*layers[2:], "model.norm", "lm_head"]]
    stages = [_prune(model, set(units)) for units in cuts]
    ids = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(1))
    x = ids
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(ids).logits)
    full = dict(model.named_parameters())
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(full) and len(names) == len(set(names))


@pytest.mark.parametrize(
    ("cut", "stages", "match"),
    [
        (["model.layers.9"], 2, r"model.layers.9.*model.embed_tokens.*lm_head"),  # names the valid paths
        (["layers.1"], 2, r"layers.1.*model.layers.0"),
        (["model.embed_tokens"], 2, "none of them the first"),  # the first stage would be empty
        (["model.layers.2", "model.layers.2"], 3, "distinct units"),  # the middle stage would be empty
        (["model.layers.3", "model.layers.1"], 3, "model order"),
        (None, 5, "5 pipeline stages but LlamaForCausalLM has 4 decoder layers"),
    ],
)
def test_bad_cuts_raise_naming_the_valid_paths(cut, stages, match):
    from meshwise.errors import ParallelError
    from meshwise.parallel.pipeline import stage_cuts

    with pytest.raises(ParallelError, match=match):
        stage_cuts(llama(), stages, cut)


def test_tied_embeddings_refuse_a_cut():
    from meshwise.errors import ParallelError
    from meshwise.parallel.pipeline import stage_cuts

    with pytest.raises(ParallelError, match="tie_word_embeddings=False"):
        stage_cuts(llama(tie=True), 2)
