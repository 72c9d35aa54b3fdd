"""Pipeline stages of a model written the way nanoGPT is written (embedding and head tied, blocks in a ModuleList
inside a ModuleDict, SDPA with is_causal=True, positions from arange, dropout 0), float64: the tied weight kept
in step across stages at pp=2, pp2xdp2 and pp2xtp2 (clipped AdamW, equal to one process); a cut inside the
nested container; batches whose padded length changes per step; a checkpoint round trip; nanoGPT's unmodified
forward refused on every stage before any stage runs; a transformers Llama with tie_word_embeddings=True and a
GPT-NeoX (whose pipeline plan has a dropout after the embeddings) at pp=2 equal to one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshwise.testing import run_distributed

V, C, HEADS, LAYERS, BLOCK = 32, 16, 2, 4, 8
T, GLOBAL_BATCH, STEPS, LR, CLIP = 6, 8, 4, 0.01, 0.5
EPS = 1e-6  # as in tests/test_pipeline.py: AdamW's eps=1e-8 amplifies 1e-18 summation-order differences
SAMPLES = STEPS * GLOBAL_BATCH


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C_ = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C_))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(C), CausalSelfAttention(), nn.LayerNorm(C), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's layout and forward, unmodified: this forward calls every piece, so no stage of it can run."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(V, C),
                wpe=nn.Embedding(BLOCK, C),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([Block() for _ in range(LAYERS)]),
                ln_f=nn.LayerNorm(C),
            )
        )
        self.lm_head = nn.Linear(C, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT and GPT-2 do

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


class StagedGPT(GPT):
    """The same model, its forward changed as docs/pipeline.md says: skip the pieces a stage does not hold."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        if "wte" in self.transformer:  # the first stage: ids in
            pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:  # the blocks this stage holds
            x = block(x)
        if "ln_f" in self.transformer:
            x = self.transformer.ln_f(x)
        return x if self.lm_head is None else self.lm_head(x)


def gpt(cls: type = StagedGPT) -> GPT:
    torch.manual_seed(0)
    return cls().double()


def tp_plan() -> dict:
    """The vocabulary dim of the tied weight split alike on both stages (embedding rows, head output rows), the
    MLPs split as usual; nanoGPT's fused c_attn stays whole (a plain ColwiseParallel of it is wrong)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def dataset() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (SAMPLES, T + 1), generator=g)
    return {"input": ids[:, :-1].contiguous(), "target": ids[:, 1:].contiguous()}


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def one_process(model: nn.Module, batches: list[dict], norms: list | None = None) -> dict[str, torch.Tensor]:
    """Plain torch: the global batches, AdamW, clip_grad_norm_ (its norms appended to ``norms``); every name of a
    tied parameter."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for b in batches:
        loss = loss_fn(model(b["input"]), b["target"])
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if norms is not None:
            norms.append(norm.item())
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def global_batches() -> list[dict]:
    from meshwise.data import MeshSampler

    data, out = dataset(), []
    sampler = MeshSampler(SAMPLES, GLOBAL_BATCH, mode="train", seed=0, drop_last=False)
    for step in range(STEPS):
        idx = torch.from_numpy(sampler.global_batch(step * GLOBAL_BATCH))
        out.append({k: v[idx] for k, v in data.items()})
    return out


def largest_difference(model: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    from torch.distributed.tensor import DTensor

    worst = 0.0
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        worst = max(worst, (full - ref[name]).abs().max().item())
    return worst


def train_tied(topo, *, cut=None, schedule="1F1B", tp=False, batches=None, steps=None) -> dict:
    """A user's script at this mesh: the tied model parallelized, clipped AdamW through create_trainer."""
    from ignite.engine import Events

    import meshwise
    from meshwise.data import ArrayDataset, mesh_dataloader

    full = gpt()
    norms: list[float] = []
    ref = one_process(copy.deepcopy(full), batches if batches is not None else global_batches(), norms)
    model = meshwise.parallelize(
        full, topo, tp_plan=tp_plan() if tp else None, cut=cut, schedule=schedule, microbatches=2
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    trainer = meshwise.create_trainer(model, opt, loss_fn, topo, grad_clip=CLIP)
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append((e.state.output, e.state.grad_norm)))
    if batches is None:
        data = mesh_dataloader(ArrayDataset(dataset()), topo, global_batch_size=GLOBAL_BATCH, drop_last=False)
        trainer.run(data, max_epochs=1)
    else:
        trainer.run(batches, max_epochs=1)
    return {
        "diff": largest_difference(model, ref),
        "norm_diff": max(abs(norm - ref_norm) for (_, norm), ref_norm in zip(seen, norms)),  # counted once
        "seen": seen,
        "names": sorted(n for n, _ in model.named_parameters()),
        "shared": [e.names for e in model.shared],
    }


def _meshes_4() -> dict:
    """One 4-rank process group, two meshes in turn: pp2xdp2 (FSDP2 on each stage), pp2xtp2 (the vocab dim split)."""
    import torch.distributed as dist

    import meshwise

    dist.init_process_group("gloo")  # meshwise adopts it, so shutdown() keeps it for the second mesh
    out = {}
    try:
        for key, mesh, kw in (("pp2xdp2", {"pp": 2, "dp": 2}, {}), ("pp2xtp2", {"pp": 2, "tp": 2}, {"tp": True})):
            topo = meshwise.init(mesh)
            try:
                out[key] = train_tied(topo, **kw)
                if key == "pp2xtp2":
                    out["refused"] = _split_unlike(topo)
            finally:
                meshwise.shutdown()
    finally:
        dist.destroy_process_group()
    return out


def _split_unlike(topo) -> str:
    """The head split over tp, the embedding whole: the copies' gradients cannot be summed shard by shard."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    import meshwise
    from meshwise.errors import ParallelError

    with pytest.raises(ParallelError, match="placed differently") as e:
        meshwise.parallelize(gpt(), topo, tp_plan={"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return str(e.value)


def test_tied_weight_at_pp2_dp2_and_pp2_tp2_matches_one_process():
    ranks = run_distributed(_meshes_4, 4, timeout=240)
    for r in ranks:  # refused on every rank alike, naming the parameter's names and stages
        assert "'transformer.wte.weight' (stage 0) and 'lm_head.weight' (stage 1)" in r["refused"], r["refused"]
    for key in ("pp2xdp2", "pp2xtp2"):
        results = [r[key] for r in ranks]
        print(key, "tied GPT, largest parameter difference:", [r["diff"] for r in results])
        for rank, r in enumerate(results):
            assert r["diff"] <= 1e-12 and r["norm_diff"] <= 1e-12, (key, rank, r["diff"], r["norm_diff"])
            assert len(r["seen"]) == STEPS and r["seen"] == results[0]["seen"], (key, rank)
            assert r["seen"][0][1] > CLIP, "the clip threshold bites"
            assert r["shared"] == [((0, "transformer.wte.weight"), (1, "lm_head.weight"))]
        # mesh pp2 x dp2 / pp2 x tp2: ranks 0-1 hold stage 0, ranks 2-3 stage 1; each stage one copy of the weight
        assert "transformer.wte.weight" in results[0]["names"] and "lm_head.weight" not in results[0]["names"]
        assert "lm_head.weight" in results[2]["names"] and "transformer.wte.weight" not in results[2]["names"]


def varying_batches() -> list[dict]:
    """Global batches padded to a length of their own each step (6, 4, 7, 5 tokens)."""
    g = torch.Generator().manual_seed(8)
    out = []
    for length in (6, 4, 7, 5):
        ids = torch.randint(0, V, (GLOBAL_BATCH, length + 1), generator=g)
        out.append({"input": ids[:, :-1].contiguous(), "target": ids[:, 1:].contiguous()})
    return out


def _resume(topo, folder: str) -> dict:
    """Two steps at pp=2, a checkpoint, a fresh model loading it, two more steps: equal to four in one process."""
    import meshwise

    batches = varying_batches()
    ref = one_process(gpt(), batches)
    out = {}
    for part, load in ((batches[:2], False), (batches[2:], True)):
        model = meshwise.parallelize(gpt(), topo, microbatches=2)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        trainer = meshwise.create_trainer(model, opt, loss_fn, topo, grad_clip=CLIP)
        ckpt = meshwise.Checkpointer(folder, topo, verbose=False)
        if load:
            out["step"] = ckpt.load("latest", model=model, optimizer=opt).step
        trainer.run(part, max_epochs=1)
        if not load:
            ckpt.save(2, model=model, optimizer=opt)
        ckpt.close()
    out["diff"] = largest_difference(model, ref)
    return out


def _unmodified(topo) -> dict:
    """nanoGPT's own forward: refused on every stage at the first step, before any stage sends anything."""
    import time

    import meshwise
    from meshwise.errors import ParallelError

    model = meshwise.parallelize(gpt(GPT), topo, microbatches=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    trainer = meshwise.create_trainer(model, opt, loss_fn, topo, grad_clip=CLIP)
    start = time.monotonic()
    with pytest.raises(ParallelError, match="fails in the model's own forward") as e:
        trainer.run(global_batches()[:1], max_epochs=1)
    return {"message": str(e.value), "seconds": time.monotonic() - start}


def _hf(topo, family: str) -> dict:
    """A transformers model at pp=2 (its own pipeline plan), clipped AdamW, against its own one-process forward."""
    import meshwise

    full = hf_model(family)
    batches = global_batches()
    ref_model = copy.deepcopy(full)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, eps=EPS)
    for b in batches:
        loss = loss_fn(ref_model(b["input"]).logits, b["target"])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), CLIP)
        opt.step()
    ref = {n: p.detach().clone() for n, p in ref_model.named_parameters(remove_duplicate=False)}
    model = meshwise.parallelize(full, topo, microbatches=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    meshwise.create_trainer(model, opt, loss_fn, topo, grad_clip=CLIP).run(batches, max_epochs=1)
    return {"diff": largest_difference(model, ref), "shared": [e.names for e in model.shared]}


def hf_model(family: str) -> nn.Module:
    if family == "llama-tied":
        import hf_tiny

        return hf_tiny.llama(layers=4, tie=True, vocab=V)
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=V,
        tie_word_embeddings=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(cfg).to(torch.float64)


def _pp2(topo, folder: str) -> dict:
    """Everything at pp=2 in one launch."""
    out = {
        "1F1B": train_tied(topo),
        "interleaved": train_tied(topo, schedule="Interleaved1F1B"),
        "nested cut": train_tied(topo, cut=["transformer.h.3"]),
        "varying length": train_tied(topo, batches=varying_batches()),
        "resume": _resume(topo, folder),
        "unmodified": _unmodified(topo),
    }
    for family in ("llama-tied", "gpt-neox"):
        out[family] = _hf(topo, family)
    return out


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> list[dict]:
    return run_distributed(_pp2, 2, str(tmp_path_factory.mktemp("ckpt")), mesh={"pp": 2}, timeout=240)


def test_tied_weight_at_pp2_matches_one_process(pp2):
    for key in ("1F1B", "interleaved", "nested cut", "varying length"):
        print(f"pp=2 {key}: largest parameter difference", [r[key]["diff"] for r in pp2])
        for rank, r in enumerate(pp2):
            assert r[key]["diff"] <= 1e-12 and r[key]["norm_diff"] <= 1e-12, (key, rank, r[key])
            assert r[key]["seen"] == pp2[0][key]["seen"] and len(r[key]["seen"]) == STEPS
    cut_first = [n for n in pp2[0]["nested cut"]["names"] if n.startswith("transformer.h.")]
    assert {n.split(".")[2] for n in cut_first} == {"0", "1", "2"}, "the cut at transformer.h.3"
    inter = pp2[0]["interleaved"]["shared"]
    assert inter == [((0, "transformer.wte.weight"), (3, "lm_head.weight"))], inter


def test_checkpoint_round_trip_keeps_the_tied_copies(pp2):
    print("pp=2 resumed from a checkpoint at step 2: largest parameter difference", [r["resume"]["diff"] for r in pp2])
    for rank, r in enumerate(pp2):
        assert r["resume"]["step"] == 2 and r["resume"]["diff"] <= 1e-12, (rank, r["resume"])


def test_unmodified_forward_is_refused_on_every_stage(pp2):
    for r in pp2:
        assert "transformer.ln_f" in r["unmodified"]["message"] and "skip the pieces" in r["unmodified"]["message"]
        assert r["unmodified"]["seconds"] < 20, "no stage waited for a timeout"
    print(pp2[0]["unmodified"]["message"])


def test_transformers_tied_llama_and_gpt_neox_at_pp2_match_one_process(pp2):
    pytest.importorskip("transformers")
    for family in ("llama-tied", "gpt-neox"):
        print(family, "at pp=2: largest parameter difference", [r[family]["diff"] for r in pp2])
        for rank, r in enumerate(pp2):
            assert r[family]["diff"] <= 1e-12, (family, rank, r[family]["diff"])
    assert pp2[0]["llama-tied"]["shared"] == [((0, "model.embed_tokens.weight"), (1, "lm_head.weight"))]
    assert pp2[0]["gpt-neox"]["shared"] == []


def test_cuts_at_any_depth_and_refusals_listing_the_paths_there():
    from meshwise.errors import ParallelError
    from meshwise.parallel.stages import pipeline_units, stage_cuts

    model = gpt()
    blocks = [f"transformer.h.{k}" for k in range(LAYERS)]
    head = ["transformer.wte", "transformer.wpe", "transformer.drop"]
    assert pipeline_units(model) == [*head, *blocks, "transformer.ln_f", "lm_head"]
    # the default cuts the block list (not the ModuleDict around it) evenly
    assert stage_cuts(model, 2) == [[*head, *blocks[:2]], [*blocks[2:], "transformer.ln_f", "lm_head"]]
    assert stage_cuts(model, 2, ["transformer.h.3"])[1] == ["transformer.h.3", "transformer.ln_f", "lm_head"]
    assert stage_cuts(model, 2, ["transformer.h"])[0] == head, "a container's path starts at its first item"
    inside = stage_cuts(model, 2, ["transformer.h.1.mlp"])  # any path: the block is opened into its pieces
    assert inside[0][-3:] == ["transformer.h.1.ln_1", "transformer.h.1.attn", "transformer.h.1.ln_2"]
    for cut, listed in [
        (["transformer.h.9"], "the submodules under 'transformer.h' are ['transformer.h.0', 'transformer.h.1'"),
        (["transformer.blocks.0"], "under 'transformer' are ['transformer.wte', 'transformer.wpe'"),
        (["decoder.0"], "of StagedGPT are ['transformer', 'lm_head']"),
    ]:
        with pytest.raises(ParallelError) as e:
            stage_cuts(model, 2, cut)
        assert listed in str(e.value), str(e.value)


def test_a_transformers_model_whose_plan_meshwise_cannot_follow_is_refused():
    pytest.importorskip("transformers")
    import hf_tiny

    from meshwise.errors import ParallelError
    from meshwise.parallel.stages import stage_cuts

    model = hf_tiny.llama(layers=2)
    model.config.base_model_pp_plan = None
    with pytest.raises(ParallelError, match="pipeline plan meshwise cannot follow.*without a pp dim"):
        stage_cuts(model, 2)
