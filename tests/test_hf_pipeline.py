"""Pipeline stages of a Hugging Face decoder-only model (a tiny random float64 LlamaForCausalLM): cuts by module
path inside ``model.layers``, stage modules that chain to the full model's logits under its parameter names,
pp2xdp2 training (1F1B with a user cut, interleaved with the default cut) and pp2xtp2 (``tp_plan="auto"``,
-100 labels under ``loss_weight="labels"``) equal to one process; bad cuts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from meshwise.testing import run_distributed

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/ is on sys.path under pytest's default import mode, and in the ranks)

VOCAB, T, GLOBAL_BATCH, STEPS, LR, CLIP = hf_tiny.VOCAB, 6, 8, 3, 0.01, 0.5
EPS = 1e-6  # as in tests/test_pipeline.py: keeps AdamW from amplifying 1e-18 summation-order differences
SAMPLES = STEPS * GLOBAL_BATCH


def llama(tie: bool = False):
    return hf_tiny.llama(layers=4, tie=tie)


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


def labels_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The micro-batch's mean over its non-ignored (already shifted) labels, Hugging Face's causal-LM loss."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=hf_tiny.IGNORE)


def labels_reference(model, data: list[dict]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process on the whole global batches: Hugging Face's mean over every scored label, AdamW, clipping."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for b in data:
        out = model(input_ids=b["input"], labels=b["labels"])
        loss = labels_loss(out.logits, b["target"])  # HF's own loss, but in float64 (it upcasts only to float32)
        assert abs(loss.item() - out.loss.item()) < 1e-5, "the oracle is Hugging Face's own loss"
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _largest_difference(model, ref: dict[str, torch.Tensor]) -> tuple[float, list[str]]:
    from torch.distributed.tensor import DTensor

    worst, names = 0.0, []
    for name, p in model.named_parameters():
        local = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        worst = max(worst, (local - ref[name]).abs().max().item())
        names.append(name)
    return worst, names


def _pp2_dp2(topo, runs: list[tuple[str, list | None]]) -> dict:
    """Each (schedule, cut): STEPS clipped AdamW steps at pp2xdp2; the largest difference from one process."""
    from ignite.engine import Events

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
        worst, names = _largest_difference(model, ref)
        out[schedule] = {"diff": worst, "names": names, "seen": seen, "stages": model.stage_indices}
    return out


def _pp2_tp2(topo) -> dict:
    """pp2xtp2: tp_plan="auto" on each stage, -100 labels (a whole micro-batch scoring nothing on even steps)
    under loss_weight="labels", four micro-batches, clipped AdamW; the largest difference from one process."""
    from ignite.engine import Events
    from torch.distributed.tensor import DTensor

    import meshwise

    data = hf_tiny.batches(STEPS, GLOBAL_BATCH, T, seed=6, ignore=True)
    full = llama()
    ref, ref_losses = labels_reference(copy.deepcopy(full), data)
    model = meshwise.parallelize(full, topo, tp_plan="auto", schedule="1F1B", microbatches=4)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    trainer = meshwise.create_trainer(model, opt, labels_loss, topo, grad_clip=CLIP, loss_weight="labels")
    seen, counts = [], []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.output))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: counts.append(e.state.loss_count))
    trainer.run([{"input": b["input"], "target": b["target"]} for b in data], max_epochs=1)
    worst, names = _largest_difference(model, ref)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    return {
        "diff": worst,
        "names": names,
        "sharded": sharded,
        "loss_diff": max(abs(a - b) for a, b in zip(seen, ref_losses)),
        "counts": counts,
        "expected_counts": [float((b["target"] != hf_tiny.IGNORE).sum()) for b in data],
        "stages": model.stage_indices,
    }


def _meshes(runs: list[tuple[str, list | None]]) -> dict:
    """One 4-rank process group, two meshes in turn: pp2xdp2 (the runs), then pp2xtp2."""
    import torch.distributed as dist

    import meshwise

    dist.init_process_group("gloo")  # meshwise adopts it, so shutdown() keeps it for the second mesh
    out = {}
    try:
        for mesh, check in (({"pp": 2, "dp": 2}, lambda t: _pp2_dp2(t, runs)), ({"pp": 2, "tp": 2}, _pp2_tp2)):
            topo = meshwise.init(mesh)
            try:
                out["x".join(f"{d}{n}" for d, n in mesh.items())] = check(topo)
            finally:
                meshwise.shutdown()
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    runs = [("1F1B", ["model.layers.1"]), ("Interleaved1F1B", None)]
    return run_distributed(_meshes, 4, runs, timeout=240)


def test_pp2_dp2_llama_1f1b_and_interleaved_match_one_process(ranks):
    results = [r["pp2xdp2"] for r in ranks]
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


def test_pp2_tp2_auto_plan_with_ignored_labels_matches_one_process(ranks):
    results = [r["pp2xtp2"] for r in ranks]
    print("pp2xtp2 Llama (tp_plan='auto', -100 labels):", [(r["diff"], r["loss_diff"]) for r in results])
    full = dict(llama().named_parameters())
    for rank, r in enumerate(results):
        assert r["diff"] <= 1e-12 and r["loss_diff"] <= 1e-12, (rank, r["diff"], r["loss_diff"])
        assert r["counts"] == r["expected_counts"], "loss_count: the global batch's scored labels"
        assert set(r["names"]) <= set(full)
        # the auto plan reached every stage: attention and MLP projections, the embedding and the head are DTensors
        assert any(".self_attn.q_proj." in n for n in r["sharded"]) and any(
            ".mlp.down_proj." in n for n in r["sharded"]
        )
    # mesh pp2 x tp2: ranks 0-1 hold stage 0 (embeddings), ranks 2-3 stage 1 (head)
    assert "model.embed_tokens.weight" in results[0]["sharded"] and "lm_head.weight" in results[2]["sharded"]
    assert set(results[0]["names"]) | set(results[2]["names"]) == set(full)


def test_stages_chain_to_the_full_logits_under_full_names():
    from meshwise.parallel.stages import _prune, pipeline_units, stage_cuts

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


def test_cuts_follow_the_models_own_pipeline_plan():
    # The pieces come from config.base_model_pp_plan and the class's _pp_plan, not from Llama's attribute names:
    # a model whose plan calls its layer list "blocks" cuts at "model.blocks.k" and chains to the same logits.
    from meshwise.parallel.stages import _prune, pipeline_units, stage_cuts

    model = llama()
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(2))
    expected = model(ids).logits
    assert list(model.config.base_model_pp_plan) == ["embed_tokens", "layers", "norm"]
    assert list(type(model)._pp_plan) == ["lm_head"]
    base = model.model
    base.blocks = base.layers
    del base.layers
    model.config.base_model_pp_plan = {"embed_tokens": None, "blocks": None, "norm": None}
    blocks = [f"model.blocks.{k}" for k in range(4)]
    assert pipeline_units(model) == ["model.embed_tokens", *blocks, "model.norm", "lm_head"]
    x = ids
    for units in stage_cuts(model, 2, ["model.blocks.3"]):
        x = _prune(model, set(units))(x)
    assert torch.equal(x, expected)


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
    from meshwise.parallel.stages import stage_cuts

    with pytest.raises(ParallelError, match=match):
        stage_cuts(llama(), stages, cut)


def test_tied_embeddings_are_found_at_the_cut():
    # trained at pp=2 equal to one process in tests/test_pipeline_tied.py
    from meshwise.parallel.pipeline_shared import find_shared
    from meshwise.parallel.stages import stage_cuts

    model = llama(tie=True)
    shared = find_shared(model, stage_cuts(model, 2))
    assert [e.names for e in shared] == [((0, "model.embed_tokens.weight"), (1, "lm_head.weight"))]
