"""Context parallel proves that attention goes through meshwise's, and runs a model written without meshwise in mind.

One launch of 4 gloo processes: at dp=2 x cp=2 a GPT-Neo (whose attention never calls transformers' attention
interface) is refused by context_parallel, naming its attention modules, where the route alone attends each
rank's own tokens (checked too); a Llama, routed through the interface, trains like one process and the proof
takes itself off after the first forward; a module that declares meshwise's entry point but never calls it is
refused; positions built with arange on every rank are refused with the fix. A nanoGPT-style model (SDPA with
``is_causal=True``, positions from ``torch.arange(t)`` in its forward, tied embedding and head, blocks in a
ModuleList inside a ModuleDict) trains through ``context_parallel(sdpa=True, positions_into=...)`` like one process
at dp=2 x cp=2, and at cp=4 with both attention kinds; without ``positions_into`` or without positions it is
refused with the fix; with activation checkpointing its recompute is routed too. Every comparison: float64,
AdamW, against one process on the same global batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

from meshwise.testing import run_distributed

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/ is on sys.path under pytest's default import mode, and in the ranks)

BATCH, T, STEPS, LR, VOCAB = 4, 8, 3, 1e-2, 64


# --------------------------------------------------------------------- a model written the way nanoGPT is written


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = VOCAB
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# --------------------------------------------------------------------- helpers run in every rank


def _nano() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig()).double()


def _neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        max_position_embeddings=16,
        window_size=4,
        intermediate_size=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPTNeoForCausalLM(cfg).to(torch.float64)


def _balanced(x: torch.Tensor, rank: int, k: int) -> torch.Tensor:
    """Rank ``rank``'s two of ``2k`` token chunks (``rank`` and ``2k-1-rank``), as Shard(0, balanced=True) loads."""
    chunks = x.chunk(2 * k, dim=-1)
    return torch.cat([chunks[rank], chunks[2 * k - 1 - rank]], dim=-1)


def _windows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (BATCH, T + 1), generator=g) for _ in range(STEPS)]


def _params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone() for n, p in model.named_parameters()}


def _local(topo, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's input, shifted target and global positions of the global windows ``w``."""
    n, cp, k = BATCH // topo.data_size, topo.coordinate("cp"), topo.size("cp")
    rows = slice(topo.data_rank * n, (topo.data_rank + 1) * n)
    ids, target = _balanced(w[rows, :-1], cp, k), _balanced(w[rows, 1:], cp, k)
    return ids, target, _balanced(torch.arange(T), cp, k).expand(n, -1)


def _train(make, step, topo=None, **placement) -> dict[str, torch.Tensor]:
    """``STEPS`` AdamW steps of ``make()``; ``step(model, window, topo)`` returns the loss (a local mean: every rank
    holds as many tokens, so FSDP2's average of the local means is the global mean)."""
    import meshwise

    model = make()
    if topo is not None:
        model = meshwise.parallelize(model, topo, dp="fsdp", **placement)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for w in _windows():
        loss = step(model, w, topo)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _params(model)


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _nano_step(model, w, topo):
    if topo is None:
        return model(w[:, :-1], w[:, 1:].contiguous())[1]  # a loader's targets are contiguous
    ids, target, positions = _local(topo, w)
    return model(ids, target, positions=positions)[1]


def _llama_step(model, w, topo):
    if topo is None:
        logits = model(input_ids=w[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())
    ids, target, positions = _local(topo, w)
    logits = model(input_ids=ids, position_ids=positions).logits
    if "forward" in model.__dict__:
        raise AssertionError("the routing proof is still wrapped around the forward after a forward that passed")
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _error(fn) -> str:
    from meshwise.errors import ParallelError

    try:
        fn()
    except ParallelError as e:
        return str(e)
    return "no error"


class _Ignores(nn.Module):
    """An attention module that declares meshwise's entry point and never calls it."""

    context_attention = None

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, positions=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


class _Own(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Ignores()

    def forward(self, x, positions=None):
        return self.attn(x, positions)


def _dp2_cp2(topo) -> dict:
    from meshwise.hf.attention import hf_context_parallel
    from meshwise.parallel.context import ContextAttention, context_parallel
    from meshwise.parallel.routing import attention_calls

    out: dict = {}
    w = _windows()[0]
    ids, _, positions = _local(topo, w)
    # GPT-Neo: without the proof (the route alone) each rank attends to its own tokens, silently
    neo, plain = _neo(), _neo()
    hf_context_parallel(neo, ContextAttention(topo))
    calls = attention_calls()
    local_logits = neo(input_ids=ids, position_ids=positions).logits
    whole = plain(input_ids=w[:, :-1]).logits
    n = BATCH // topo.data_size
    full = _balanced(whole[topo.data_rank * n : (topo.data_rank + 1) * n].transpose(1, 2), topo.coordinate("cp"), 2)
    out["neo_unproven"] = ((local_logits - full.transpose(1, 2)).abs().max().item(), attention_calls() - calls)
    out["neo"] = _error(lambda: context_parallel(_neo(), topo)(input_ids=ids, position_ids=positions))
    # Llama through transformers' attention interface: equal to one process, the proof gone after step 1
    ref = _train(hf_tiny.llama, _llama_step)
    out["llama"] = _diff(_train(lambda: context_parallel(hf_tiny.llama(), topo), _llama_step, topo), ref)
    local = torch.arange(T // 2).expand(ids.shape[0], -1)
    out["llama_arange"] = _error(lambda: context_parallel(hf_tiny.llama(), topo)(input_ids=ids, position_ids=local))
    x = torch.zeros(1, T // 2, 8, dtype=torch.float64)
    out["own"] = _error(lambda: context_parallel(_Own().double(), topo)(x, positions=positions[:1]))
    # the nanoGPT-style model through the SDPA road
    ref = _train(_nano, _nano_step)
    road = _train(
        lambda: context_parallel(_nano(), topo, sdpa=True, positions_into="transformer.wpe"), _nano_step, topo
    )
    out["nano"] = _diff(road, ref)
    # activation checkpointing recomputes the blocks in backward: the routed attention is recomputed routed
    make = lambda: context_parallel(_nano(), topo, sdpa=True, positions_into="transformer.wpe")  # noqa: E731
    out["nano_checkpointed"] = _diff(_train(make, _nano_step, topo, activation_checkpointing="full"), ref)
    out["nano_arange"] = _error(lambda: context_parallel(_nano(), topo, sdpa=True)(ids, positions=positions))
    out["nano_no_positions"] = _error(lambda: context_parallel(_nano(), topo, sdpa=True)(ids))
    return out


def _cp4(topo) -> dict:
    from meshwise.parallel.context import context_parallel

    ref = _train(_nano, _nano_step)
    out = {}
    for kind in ("gather", "ring"):

        def make(kind=kind):
            return context_parallel(_nano(), topo, sdpa=True, positions_into="transformer.wpe", kind=kind)

        out[kind] = _diff(_train(make, _nano_step, topo), ref)
    return out


def _phases() -> dict:
    import meshwise

    out = {}
    topo = meshwise.init({"dp": 2, "cp": 2}, timeout=30)
    out["dp2cp2"] = _dp2_cp2(topo)
    meshwise.shutdown()
    topo = meshwise.init({"cp": 4}, timeout=30)
    out["cp4"] = _cp4(topo)
    meshwise.shutdown()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_phases, 4, timeout=240)


def test_non_interface_attention_is_refused_naming_its_modules(ranks):
    for r in ranks:
        r = r["dp2cp2"]
        wrong, calls = r["neo_unproven"]
        assert wrong > 1e-3 and calls == 0, r["neo_unproven"]  # what the proof stops: silently wrong, no call
        # refused by context_parallel itself: GPT-Neo's attention classes never read the interface
        assert "'transformer.h.0.attn.attention'" in r["neo"], r["neo"]
        assert "compute attention themselves" in r["neo"] and "attention interface" in r["neo"], r["neo"]
        assert "['attn']" in r["own"] and "context_attention(q, k, v, positions)" in r["own"], r["own"]


def test_routed_llama_equals_one_process(ranks):
    for r in ranks:
        assert r["dp2cp2"]["llama"] <= 1e-12, r["dp2cp2"]["llama"]
        assert "every split rank passed positions 0..3" in r["dp2cp2"]["llama_arange"]


def test_nanogpt_style_model_through_the_sdpa_road_equals_one_process(ranks):
    print("nanoGPT-style, max parameter difference:", [(r["dp2cp2"]["nano"], r["cp4"]) for r in ranks])
    for r in ranks:
        assert r["dp2cp2"]["nano_checkpointed"] <= 1e-12, r["dp2cp2"]
        assert r["dp2cp2"]["nano"] <= 1e-12 and r["cp4"]["gather"] <= 1e-12 and r["cp4"]["ring"] <= 1e-12, r


def test_positions_built_in_the_forward_are_refused_with_the_fix(ranks):
    for r in ranks:
        msg = r["dp2cp2"]["nano_arange"]
        assert "torch.arange(4)" in msg and "positions_into=['transformer.wpe']" in msg, msg
        assert "positions=batch['positions']" in r["dp2cp2"]["nano_no_positions"]


def test_bad_sdpa_road_options():
    from types import SimpleNamespace

    from meshwise.errors import ParallelError
    from meshwise.parallel.context import context_parallel

    fake = SimpleNamespace(size=lambda dims: 1, stage_dims=(), split_dims=("cp",), roles={"cp": "split"})
    with pytest.raises(ParallelError, match="pass sdpa=True as well"):
        context_parallel(_nano(), fake, positions_into="transformer.wpe")
    with pytest.raises(ParallelError, match=r"\['nope'\] name no submodule"):
        context_parallel(_nano(), fake, sdpa=True, positions_into="nope")
    with pytest.raises(ParallelError, match="sdpa=True"):  # the refusal names the road
        context_parallel(_nano(), fake)


def test_attention_arguments_meshwise_does_not_compute_are_refused():
    """One process: the transformers attention function refuses, naming them, the arguments that change the math
    (softcap, attention sinks, a sliding window shorter than the window, a mask the family computed itself), and
    takes the mask transformers' own mask code built."""
    from meshwise.errors import ParallelError
    from meshwise.hf.attention import _check_call, _mask_function

    module = nn.Linear(1, 1)
    q = torch.zeros(1, 4, 4, 8)  # [B, heads, T_local, head_dim]: 8 tokens over a split of 2
    for kwargs, match in (
        ({"softcap": 50.0}, r"softcapping \(softcap=50.0\)"),
        ({"s_aux": torch.zeros(4)}, r"attention sinks \(s_aux"),
        ({"sliding_window": 4}, r"sliding window of 4 tokens shorter than the 8-token window"),
        ({"indices": torch.zeros(2)}, r"indices=Tensor"),
    ):
        with pytest.raises(ParallelError, match=match):
            _check_call(module, q, None, kwargs, 2)
    assert _check_call(module, q, None, {"sliding_window": 8, "softcap": None, "use_cache": True}, 2)
    assert not _check_call(module, q, None, {"is_causal": False}, 2)
    from transformers.masking_utils import causal_mask_function

    mask = _mask_function(
        batch_size=1,
        q_length=4,
        kv_length=4,
        mask_function=causal_mask_function,
        allow_is_causal_skip=False,
    )
    assert _check_call(module, q, mask, {}, 2)
    with pytest.raises(ParallelError, match=r"an attention_mask its own forward computed"):
        _check_call(module, q, mask.float() * 0.5, {}, 2)  # e.g. Doge's learned dynamic mask


class _Mesh:
    """Just the dims check_random_draws reads (it runs before any collective)."""

    def __init__(self, dims: dict) -> None:
        self.dims = dims
        self.metric_dims = tuple(d for d in dims if d in ("dp", "cp"))
        self.stage_dims = tuple(d for d in dims if d == "pp")
        self.split_dims = tuple(d for d in dims if d == "cp")

    def size(self, dims) -> int:
        return math.prod(self.dims[d] for d in dims)


class _CumsumMlp(nn.Module):
    """A token mixer outside attention: each token gets the running sum of the ones before it."""

    def __init__(self, mlp: nn.Module, noise: bool = False) -> None:
        super().__init__()
        self.mlp, self.noise = mlp, noise

    def forward(self, x):
        if self.noise:
            return self.mlp(x) * (1 + 0.01 * torch.rand_like(x)) if self.training else self.mlp(x)
        return self.mlp(x) + 0.1 * x.cumsum(1)


def test_split_probe_refuses_what_cannot_equal_one_process():
    """One process: under a token split, a transformers model is refused when it mixes tokens outside attention,
    uses positions of its own (RoBERTa's offset) or ignores position_ids (BART); on a mesh that splits the batch,
    when its training forward draws random numbers (a router's jitter); a Llama passes."""
    from transformers import BartConfig, BartForCausalLM, RobertaConfig, RobertaForCausalLM

    from meshwise.hf.attention import check_random_draws, probe_split

    probe_split(hf_tiny.llama())
    mixer = hf_tiny.llama()
    mixer.model.layers[1].mlp = _CumsumMlp(mixer.model.layers[1].mlp)
    assert "mixes tokens outside attention" in _error(lambda: probe_split(mixer))
    noisy = hf_tiny.llama()
    noisy.model.layers[0].mlp = _CumsumMlp(noisy.model.layers[0].mlp, noise=True)
    assert "draws random numbers (['rand_like']" in _error(lambda: probe_split(noisy))  # under a token split
    for dims, refused in (({"tp": 2}, False), ({"dp": 2}, True), ({"cp": 2}, True), ({"pp": 2}, True)):
        message = _error(lambda dims=dims: check_random_draws(noisy, _Mesh(dims)))
        assert ("draws random numbers (['rand_like']" in message) == refused, (dims, message)
    plain = hf_tiny.llama().eval()
    assert _error(lambda: check_random_draws(plain, _Mesh({"dp": 2}))) == "no error" and not plain.training
    small = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    roberta = RobertaForCausalLM(RobertaConfig(vocab_size=64, is_decoder=True, **small)).double()
    assert "its own positions differ from the global position_ids" in _error(lambda: probe_split(roberta))
    bart = BartForCausalLM(
        BartConfig(vocab_size=64, d_model=16, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32)
    ).double()
    assert "ignores the position_ids it is given" in _error(lambda: probe_split(bart))
