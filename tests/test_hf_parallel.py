"""A Hugging Face Llama trains like one process at dp=2 x tp=2 (parallelize(tp_plan="auto")) and at dp=2 x cp=2
(context_parallel routes its attention through meshwise's); sizes that do not divide, bad plans and attention that
a token split would silently break are refused."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshwise.testing import run_distributed

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/ is on sys.path under pytest's default import mode, and in the ranks)

BATCH, T, STEPS, LR = 4, 8, 4, 1e-2


def llama(**overrides):
    return hf_tiny.llama(**overrides)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (BATCH, T), generator=g) for _ in range(STEPS)]


def train(model: nn.Module, rows: slice) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches():
        # every row holds T valid labels: each data rank's mean, averaged by FSDP2, is the global mean
        loss = model(input_ids=ids[rows], labels=ids[rows]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _dp2_tp2(topo) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    import meshwise

    full = llama()
    ref = copy.deepcopy(full)
    train(ref, slice(None))
    model = meshwise.parallelize(full, topo, tp_plan="auto", dp="fsdp")
    q = model.model.layers[0].self_attn.q_proj.weight
    tp_index = q.device_mesh.mesh_dim_names.index("tp")
    n = BATCH // topo.data_size
    train(model, slice(topo.data_rank * n, (topo.data_rank + 1) * n))
    ref_params = dict(ref.named_parameters())
    diff = 0.0
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        diff = max(diff, (whole - ref_params[name].detach()).abs().max().item())
    return {
        "diff": diff,
        "q_tp_sharded": isinstance(q.placements[tp_index], Shard),
        "local_q_rows": q.to_local().shape[0],
    }


def test_llama_dp2_tp2_auto_plan_matches_one_process():
    results = run_distributed(_dp2_tp2, 4, mesh={"dp": 2, "tp": 2}, timeout=120)
    print("max parameter difference per rank:", [r["diff"] for r in results])
    for r in results:
        assert r["q_tp_sharded"], r
        assert r["diff"] <= 1e-12, r


def _balanced(x: torch.Tensor, rank: int, k: int) -> torch.Tensor:
    """Rank ``rank``'s two of ``2k`` token chunks (``rank`` and ``2k-1-rank``), as Shard(0, balanced=True) loads."""
    chunks = x.chunk(2 * k, dim=-1)
    return torch.cat([chunks[rank], chunks[2 * k - 1 - rank]], dim=-1)


def labels_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The micro-batch's mean over its non-ignored (already shifted) labels."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=hf_tiny.IGNORE)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone() for n, p in model.named_parameters()}


def _cp_without_ignored(topo) -> dict:
    """Every target scored: a plain loop, FSDP2's average of the equal-count local means is the global mean."""
    import torch.nn.functional as F

    import meshwise
    from meshwise.parallel.context import context_parallel

    g = torch.Generator().manual_seed(5)
    windows = [torch.randint(0, 64, (BATCH, T + 1), generator=g) for _ in range(STEPS)]
    n, cp, k = BATCH // topo.data_size, topo.coordinate("cp"), topo.size("cp")
    rows = slice(topo.data_rank * n, (topo.data_rank + 1) * n)
    runs = {}
    for name in ("one process", "dp2xcp2"):
        model = llama()
        if name == "dp2xcp2":
            # the ring kind: K/V blocks travel the cp ring inside transformers' attention route
            model = meshwise.parallelize(context_parallel(model, topo, kind="ring"), topo, dp="fsdp")
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for w in windows:
            ids, target = w[:, :-1], w[:, 1:]  # targets already shifted: a token split keeps each pair together
            if name == "one process":
                logits = model(input_ids=ids).logits
            else:
                ids, target = _balanced(ids[rows], cp, k), _balanced(target[rows], cp, k)
                positions = _balanced(torch.arange(T), cp, k).expand(n, -1)
                logits = model(input_ids=ids, position_ids=positions).logits
            # equal token counts on every rank: FSDP2's average of the local means is the global mean
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        runs[name] = _params(model)
    ref, got = runs["one process"], runs["dp2xcp2"]
    moved = max((ref[key] - p).abs().max().item() for key, p in llama().named_parameters())
    return {"diff": max((got[key] - ref[key]).abs().max().item() for key in ref), "moved": moved}


def _cp_with_ignored(topo) -> dict:
    """-100 labels spread unevenly over data ranks and token chunks, trained by create_trainer under
    loss_weight="labels", against one process's Hugging Face loss (labels= on the whole global batch)."""
    from ignite.engine import Events

    import meshwise
    from meshwise.parallel.context import context_parallel

    # the scored count changes every step (and a whole row scores nothing on even steps): the trainer scales
    # backward by each step's own global count, so LlamaRMSNorm's float32 islands round as in one process
    data = hf_tiny.batches(STEPS, BATCH, T, seed=7, ignore=True)
    reference = llama()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    ref_losses, hf_gap = [], 0.0
    for b in data:
        out = reference(input_ids=b["input"], labels=b["labels"])  # the one-process Hugging Face script
        loss = labels_loss(out.logits, b["target"])  # its loss in float64 (HF's own is upcast only to float32)
        hf_gap = max(hf_gap, abs(loss.item() - out.loss.item()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    n, cp, k = BATCH // topo.data_size, topo.coordinate("cp"), topo.size("cp")
    rows = slice(topo.data_rank * n, (topo.data_rank + 1) * n)
    positions = _balanced(torch.arange(T), cp, k).expand(n, -1)
    # cp peers hold parts of the same samples: the 'index' field names them (the trainer checks it at step 1)
    index = torch.arange(rows.start, rows.stop)
    local = [
        {
            "input": _balanced(b["input"][rows], cp, k),
            "target": _balanced(b["target"][rows], cp, k),
            "positions": positions,
            "index": index,
        }
        for b in data
    ]
    model = meshwise.parallelize(context_parallel(llama(), topo), topo, dp="fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    trainer = meshwise.create_trainer(
        model,
        opt,
        labels_loss,
        topo,
        loss_weight="labels",
        forward=lambda m, b: m(input_ids=b["input"], position_ids=b["positions"]),
    )
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append((e.state.output, e.state.loss_count)))
    trainer.run(local, max_epochs=1)
    ref, got = _params(reference), _params(model)
    return {
        "diff": max((got[key] - ref[key]).abs().max().item() for key in ref),
        "loss_diff": max(abs(s - r) for (s, _), r in zip(seen, ref_losses)),
        "counts": [c for _, c in seen],
        "expected_counts": [float((b["target"] != hf_tiny.IGNORE).sum()) for b in data],
        "local_counts": [int((b["target"] != hf_tiny.IGNORE).sum()) for b in local],
        "hf_gap": hf_gap,
    }


def _dp2_cp2(topo) -> dict:
    return {"plain": _cp_without_ignored(topo), "labels": _cp_with_ignored(topo)}


@pytest.fixture(scope="module")
def cp_ranks() -> list[dict]:
    return run_distributed(_dp2_cp2, 4, mesh={"dp": 2, "cp": 2}, timeout=180)


def test_llama_dp2_cp2_through_meshwise_attention_matches_one_process(cp_ranks):
    print("dp2 x cp2 max parameter difference per rank:", [r["plain"]["diff"] for r in cp_ranks])
    for r in cp_ranks:
        assert r["plain"]["moved"] > 1e-3, r  # training changed the parameters: the comparison is not trivial
        assert r["plain"]["diff"] <= 1e-12, r


def test_llama_dp2_cp2_ignored_labels_match_one_process_hf_loss(cp_ranks):
    results = [r["labels"] for r in cp_ranks]
    print("dp2 x cp2, -100 labels, loss_weight='labels':", [(r["diff"], r["loss_diff"]) for r in results])
    for r in results:
        assert r["hf_gap"] < 1e-5, r  # the float64 oracle is Hugging Face's own loss (which it computes in float32)
        assert r["diff"] <= 1e-12 and r["loss_diff"] <= 1e-12, r
        assert r["counts"] == r["expected_counts"] and len(set(r["counts"])) > 1, r
    # the ranks scored different numbers of labels, so a mean of their means would not be the global mean
    per_rank = [r["local_counts"] for r in results]
    assert all(len({c[step] for c in per_rank}) > 1 for step in range(STEPS)), per_rank


class FakeTopology:
    """Just the fields the pre-sharding checks read: they raise before any collective."""

    def __init__(self, **sizes: int) -> None:
        self.sizes = sizes
        self.replica_dims = tuple(d for d in sizes if d == "tp")
        self.split_dims = tuple(d for d in sizes if d == "cp")
        self.stage_dims = ()
        self.metric_dims = tuple(d for d in sizes if d == "dp")

    def size(self, dims) -> int:
        return math.prod(self.sizes[d] for d in ([dims] if isinstance(dims, str) else dims))


def test_auto_plan_translation_and_tp4_refusal():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import meshwise
    from meshwise.errors import ParallelError
    from meshwise.hf.plans import hf_tp_plan

    model = llama()
    plan = hf_tp_plan(model, 2)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    assert isinstance(plan["lm_head"], ColwiseParallel)
    with pytest.raises(ParallelError, match=r"num_key_value_heads=2.*among \[1, 2\]"):
        meshwise.parallelize(model, FakeTopology(dp=1, tp=4), tp_plan="auto")
    with pytest.raises(ParallelError, match="only string is 'auto'"):
        meshwise.parallelize(model, FakeTopology(dp=1, tp=2), tp_plan="colwise")
    with pytest.raises(ParallelError, match="not a transformers PreTrainedModel"):
        hf_tp_plan(nn.Linear(2, 2), 2)


def test_bad_auto_plans_are_refused():
    from meshwise.errors import ParallelError
    from meshwise.hf.plans import hf_tp_plan

    model = llama()
    model._tp_plan = {**model._tp_plan, "model.layers.*.self_attn.nope": "colwise"}
    assert "model.layers.*.self_attn.nope" not in hf_tp_plan(model, 2)  # skipped, as transformers skips it
    model._tp_plan = {"model.layers.*.self_attn.nope": "colwise"}
    with pytest.raises(ParallelError, match="none of LlamaForCausalLM's tp plan entries .* names a submodule"):
        hf_tp_plan(model, 2)
    model = llama()
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp.up_proj": "frobnicate"}
    with pytest.raises(ParallelError, match="style 'frobnicate'.*known"):
        hf_tp_plan(model, 2)
    model = llama()
    model._tp_plan = {**model._tp_plan, "model.norm": "colwise"}
    with pytest.raises(ParallelError, match="'model.norm' is a LlamaRMSNorm"):
        hf_tp_plan(model, 2)


def test_gpt2_conv1d_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from meshwise.errors import ParallelError
    from meshwise.hf.plans import hf_tp_plan

    model = GPT2LMHeadModel(
        GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0)
    )
    model._tp_plan = {"transformer.h.*.attn.c_attn": "colwise"}  # whatever GPT-2 declares, Conv1D is the catch
    with pytest.raises(ParallelError, match="Conv1D"):
        hf_tp_plan(model, 2)


def test_token_split_refuses_attention_not_routed_through_meshwise():
    import meshwise
    from meshwise.errors import ParallelError
    from meshwise.parallel.context import check_attention_routed, context_parallel, unrouted_attention

    model = llama()
    assert unrouted_attention(model) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    with pytest.raises(ParallelError, match=r"model.layers.0.self_attn.*context_parallel"):
        meshwise.parallelize(model, FakeTopology(dp=2, cp=2))
    with pytest.raises(ParallelError, match="nn.MultiheadAttention|self_attn|'0'"):
        check_attention_routed(nn.Sequential(nn.MultiheadAttention(8, 2)), FakeTopology(dp=1, cp=2))
    check_attention_routed(model, FakeTopology(dp=4, cp=1))  # no token split: nothing to refuse
    check_attention_routed(nn.Sequential(nn.Linear(2, 2)), FakeTopology(cp=2))  # no attention at all

    class Entry(nn.Module):
        context_attention = None

        def forward(self, x, positions=None):
            return x

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.routed, self.plain = Entry(), nn.MultiheadAttention(8, 2)

        def forward(self, x, positions=None):
            return self.routed(x, positions)

    fake = SimpleNamespace(size=lambda dims: 1, stage_dims=(), split_dims=())
    with pytest.raises(ParallelError, match=r"\['plain'\] have no `context_attention`"):
        context_parallel(Mixed(), fake)
    with pytest.raises(ParallelError, match=r"\['routed'\]"):  # the entry point declared but never set
        check_attention_routed(nn.ModuleDict({"routed": Entry()}), FakeTopology(cp=2))


def test_hf_model_under_context_parallel_refuses_labels_and_missing_positions():
    # The calls a user ported from a one-process HF script would make: labels= (shifted inside each rank's
    # chunk, wrong across chunk borders) and no position_ids (RoPE would number each chunk from 0).
    from meshwise.errors import ParallelError
    from meshwise.hf.attention import hf_context_parallel

    model = hf_context_parallel(llama(), attn=object())  # the hooks fire before any attention runs
    ids = torch.zeros(1, T, dtype=torch.long)
    positions = torch.arange(T)[None]
    with pytest.raises(ParallelError, match="labels= under context parallel.*loss_weight='labels'"):
        model(input_ids=ids, position_ids=positions, labels=ids)
    with pytest.raises(ParallelError, match="position_ids"):
        model(input_ids=ids)


def test_pipeline_pieces_must_compute_the_models_forward():
    """One process: a decoder whose own forward computes more than its pieces in a row (Cohere's logit_scale after
    the head), or whose pieces cannot run on their own (Gemma3's per-layer-type rotary embeddings), is refused
    before any stage is cut; a Llama's pieces are its forward."""
    from transformers import CohereConfig, CohereForCausalLM

    from meshwise.errors import ParallelError
    from meshwise.hf.pipeline import check_pieces

    check_pieces(llama())
    sizes = {k: v for k, v in hf_tiny.config().to_dict().items() if k in ("hidden_size", "num_hidden_layers")}
    config = CohereConfig(**sizes, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=64)
    torch.manual_seed(0)
    with pytest.raises(ParallelError, match=r"CohereForCausalLM's own forward computes more than its pipeline pieces"):
        check_pieces(CohereForCausalLM(config).double())
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # sliding and full layers, rotary embeddings per layer type: the pieces fail alone (a stage would fail on its
    # rank only while the others wait in a recv; the sweep saw that hang)
    gemma = Gemma3TextConfig(**sizes, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    with pytest.raises(ParallelError, match=r"Gemma3ForCausalLM's pipeline pieces do not run on their own"):
        check_pieces(Gemma3ForCausalLM(gemma).double())
