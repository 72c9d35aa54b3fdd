"""Every plan string of the installed transformers is translated to a torch style or refused, and the models whose
plans need more than colwise/rowwise train like one process under tp_plan="auto": Qwen3 and Gemma3
(``replicated_with_grad_allreduce`` q_norm/k_norm) at tp=4 and dp=2 x tp=2 (FSDP2 and replicate), and MoE models
whose every layer is sparse (the dense-layer plan keys match nothing and are skipped) at dp=2 x tp=2."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshwise.testing import run_distributed

pytest.importorskip("transformers")

BATCH, T, STEPS, LR, VOCAB = 4, 8, 3, 1e-2, 64
CLIP = 0.05  # well below the gradient norm of these models: clipping acts on every step
SIZES = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # tp=4 splits the key/value heads too
    "head_dim": 8,
    "intermediate_size": 64,
    "vocab_size": VOCAB,
}


def build(family: str, seed: int = 0) -> nn.Module:
    """A transformers user's tiny model: a config, ``from_config``, float64; the same weights on every rank."""
    from transformers import (
        AutoModelForCausalLM,
        DeepseekV3Config,
        Gemma3TextConfig,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    configs = {
        "qwen3": lambda: Qwen3Config(**SIZES, tie_word_embeddings=False),
        "gemma3": lambda: Gemma3TextConfig(**SIZES),  # tied embeddings (its default): they stay whole
        # every layer sparse (the defaults): no dense mlp.gate_proj for the plan's dense-layer keys
        "qwen3_moe": lambda: Qwen3MoeConfig(**SIZES, **moe, tie_word_embeddings=False),
        "qwen2_moe": lambda: Qwen2MoeConfig(**SIZES, **moe, shared_expert_intermediate_size=32),
        "mixtral": lambda: MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2),
        # multi-head latent attention (mla_kv_a_proj), a dense first layer, then routed and shared experts
        "deepseek_v3": lambda: DeepseekV3Config(
            **{k: v for k, v in SIZES.items() if k != "head_dim"},  # its heads: qk_nope + qk_rope wide
            **{"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 2},
            **{"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16},
            **{"qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "tie_word_embeddings": False},
        ),
    }
    configs["qwen3_variants"] = configs["qwen3"]
    moe_family = family in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
    extra = {"experts_implementation": "eager"} if moe_family else {}  # float64 experts on CPU
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[family](), **extra).to(torch.float64)
    if family == "qwen3_variants":
        model.tp_plan = VARIANTS  # transformers' own setter: the other translated strings, GLM- and Inkling-style
    return model


VARIANTS = {
    "model.embed_tokens": "embedding_colwise",  # hidden-split embedding, gathered
    "model.layers.*.self_attn.q_proj": "unit_colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.o_proj": "unit_rowwise",
    "model.layers.*.mlp.gate_proj": "colwise_rep",  # gathered outputs, split again by down_proj (GLM's fused MLP)
    "model.layers.*.mlp.up_proj": "colwise_gather_output",
    "model.layers.*.mlp.down_proj": "rowwise_split_input",
    "model.layers.*.input_layernorm": "replicate",
    "model.norm": "replicate",
    "lm_head": "rowwise_rep",  # the replicated hidden state split, partial logits summed (Inkling's head)
}
TESTED = set(VARIANTS.values()) | {"colwise", "rowwise", "embedding_rowwise", "mla_kv_a_proj"}  # + own plans


def windows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, T + 1), generator=g) for _ in range(STEPS)]


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone() for n, p in model.named_parameters()}


def one_process(family: str, clip: bool = False) -> dict[str, torch.Tensor]:
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for w in windows():
        logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            assert norm > 2 * CLIP, norm  # the clip is active
        opt.step()
    return full(model)


def on_mesh(topo: Any, family: str, dp: str, clip: bool = False) -> nn.Module:
    """The user's script on the mesh: parallelize(tp_plan="auto"), AdamW, this data rank's rows of each batch."""
    import meshwise

    model = meshwise.parallelize(build(family), topo, tp_plan="auto", dp=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    n = BATCH // topo.data_size
    rows = slice(topo.data_rank * n, (topo.data_rank + 1) * n)
    if clip:  # meshwise's trainer: global mean, clipped by the global norm
        trainer = meshwise.create_trainer(
            model,
            opt,
            lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten()),
            topo,
            grad_clip=CLIP,
            loss_weight="labels",
            forward=lambda m, b: m(input_ids=b["input"]),
        )
        trainer.run([{"input": w[rows, :-1], "target": w[rows, 1:]} for w in windows()], max_epochs=1)
        return model
    for w in windows():
        # equal token counts on every data rank: FSDP2's average of the local means is the global mean
        logits = model(input_ids=w[rows, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), w[rows, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


RUNS = [  # (mesh, dp kind, family, clipped by create_trainer); the first one is saved for the reload below
    ({"dp": 2, "tp": 2}, "fsdp", "qwen3", True),
    ({"tp": 4}, "fsdp", "qwen3", False),
    ({"tp": 4}, "fsdp", "gemma3", False),
    ({"dp": 2, "tp": 2}, "fsdp", "gemma3", False),
    ({"dp": 4}, "fsdp", "gemma3", False),  # no tp: Gemma3's own float32 norms alone, the rounding baseline
    ({"dp": 2, "tp": 2}, "replicate", "qwen3", False),
    ({"dp": 2, "tp": 2}, "fsdp", "qwen3_variants", False),
    ({"dp": 2, "tp": 2}, "fsdp", "qwen3_moe", False),
    ({"dp": 2, "tp": 2}, "replicate", "qwen2_moe", False),
    ({"tp": 4}, "fsdp", "mixtral", False),
    # DeepSeek-V3's router computes in float32 (like Gemma3's norms): a data-parallel split of its gradient's sum
    # rounds differently (4.5e-9 at dp=2 x tp=2), so the latent attention is checked at tp=4, exact
    ({"tp": 4}, "fsdp", "deepseek_v3", False),
]


def _compare(got: dict, ref: dict, family: str) -> dict:
    diffs = {n: (got[n] - ref[n]).abs().max().item() for n in ref}
    worst = max(diffs, key=diffs.get)
    norms = [v for n, v in diffs.items() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    moved = max((ref[n] - p).abs().max().item() for n, p in build(family).named_parameters())
    return {"diff": diffs[worst], "worst": worst, "norms": max(norms, default=0.0), "moved": moved}


def _reload(folder: str, ref: dict) -> dict:
    """The dp=2 x tp=2 checkpoint read back into a fresh tp=4 model (DCP reshards): the trained parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import meshwise

    topo = meshwise.init({"tp": 4}, timeout=60)
    try:
        model = meshwise.parallelize(build("qwen3", seed=1), topo, tp_plan="auto")
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(model, state)
        return {"run": "qwen3 dp2xtp2 checkpoint -> tp4", **_compare(full(model), ref, "qwen3")}
    finally:
        meshwise.shutdown()


def _all_meshes(folder: str, fix: bool = True) -> list[dict]:
    """One 4-rank launch, several meshes: each run inits its mesh, trains, compares, shuts down."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import meshwise
    from meshwise.hf import plans as hf

    if not fix:  # the behaviour before: q_norm/k_norm (and MLA's rotary key) left whole, partial gradients unsummed
        hf.STYLES[hf.GRAD_ALLREDUCE] = hf.STYLES["mla_kv_a_proj"] = None
    out = []
    refs: dict[tuple[str, bool], dict[str, torch.Tensor]] = {}
    for index, (mesh, dp, family, clip) in enumerate(RUNS):
        ref = refs.setdefault((family, clip), one_process(family, clip))
        topo = meshwise.init(mesh, timeout=60)
        try:
            model = on_mesh(topo, family, dp, clip)
            if index == 0:
                dcp.save(get_model_state_dict(model), checkpoint_id=folder)
            got = full(model)
        finally:
            meshwise.shutdown()
        out.append({"run": f"{family} {mesh} {dp}" + (" clipped" if clip else ""), **_compare(got, ref, family)})
    out.append(_reload(folder, refs[("qwen3", True)]))
    return out


def test_grad_allreduce_moe_and_every_translated_string_match_one_process(tmp_path):
    results = run_distributed(_all_meshes, 4, str(tmp_path / "ckpt"), timeout=240)
    for r in results[0]:
        print(f"{r['run']}: max |param - one process| {r['diff']:.2e} ({r['worst']}), q/k_norm {r['norms']:.2e}")
    for rank in results:
        by_run = {r["run"]: r for r in rank}
        for r in rank:
            assert r["moved"] > 1e-3, r  # training moved the parameters: the comparison is not trivial
            if not r["run"].startswith("gemma3"):
                assert r["diff"] <= 1e-12, r
        # Gemma3's RMSNorm computes its weight's gradient in float32 (weight.float()) inside the float64 model, so
        # any split of its sums rounds differently: data parallel alone is as far from one process as tp
        baseline = by_run["gemma3 {'dp': 4} fsdp"]["diff"]
        assert 1e-10 < baseline < 1e-7, baseline
        for name in ("gemma3 {'tp': 4} fsdp", "gemma3 {'dp': 2, 'tp': 2} fsdp"):
            assert by_run[name]["diff"] < 1e-7, by_run[name]  # without the gradient sum: 5e-2


# --------------------------------------------------------------------------- one process: the plan strings


def installed_plan_strings() -> dict[str, str]:
    """Every plan string the installed transformers declares or registers, with one place that uses it: each
    config class's ``base_model_tp_plan`` (and ``base_model_ep_plan``), each auto-mapped model class's ``_tp_plan``,
    and every style its ``ALL_PARALLEL_STYLES`` registers."""
    import transformers
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    used = {name: "ALL_PARALLEL_STYLES" for name in ALL_PARALLEL_STYLES.valid_keys()}
    for model_type in CONFIG_MAPPING.keys():
        config_class = CONFIG_MAPPING[model_type]
        for attr in ("base_model_tp_plan", "base_model_ep_plan"):
            for key, name in (getattr(config_class, attr, None) or {}).items():
                used[name] = f"{config_class.__name__}.{attr}[{key!r}]"
    classes = {
        n
        for mapping in dir(modeling_auto)
        if mapping.startswith("MODEL_") and mapping.endswith("_MAPPING_NAMES")
        for names in getattr(modeling_auto, mapping).values()
        for n in ((names,) if isinstance(names, str) else names)
    }
    for class_name in sorted(classes):
        model_class = getattr(transformers, class_name, None)
        for key, name in (getattr(model_class, "_tp_plan", None) or {}).items():
            used[name] = f"{class_name}._tp_plan[{key!r}]"
    return used


def test_every_installed_plan_string_is_translated_or_refused():
    from torch.distributed.tensor.parallel import ParallelStyle

    from meshwise.errors import ParallelError
    from meshwise.hf.plans import REFUSED, STYLES, hf_tp_plan

    used = installed_plan_strings()
    unknown = {name: where for name, where in used.items() if name not in STYLES and name not in REFUSED}
    assert not unknown, f"plan strings meshwise neither translates nor refuses: {unknown}"
    assert not set(STYLES) & set(REFUSED)
    assert set(STYLES) <= TESTED  # each translated string trains in the launch above
    config = build("deepseek_v3").config  # the factories read the config (mla_kv_a_proj: its rotary width)
    for name, factory in STYLES.items():
        assert factory is None or isinstance(factory(config), ParallelStyle), name
    for name in REFUSED:  # each refused string, given to a module, is refused naming the string and the module
        model = build("qwen3")
        model.tp_plan = {**model.tp_plan, "model.layers.*.self_attn.q_proj": name}
        with pytest.raises(ParallelError, match=rf"'model.layers.0.self_attn.q_proj'.*style '{name}'.*refuses: "):
            hf_tp_plan(model, 2)


def test_translation_of_the_variant_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from meshwise.hf.plans import ReplicatedWithGradAllReduce, hf_tp_plan

    plan = hf_tp_plan(build("qwen3_variants"), 2)
    assert "model.norm" not in plan and "model.layers.*.input_layernorm" not in plan  # 'replicate': left whole
    assert isinstance(plan["model.embed_tokens"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.q_norm"], ReplicatedWithGradAllReduce)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["lm_head"], RowwiseParallel)


def test_unmatched_keys_are_skipped_but_a_plan_matching_nothing_is_refused():
    from meshwise.errors import ParallelError
    from meshwise.hf.plans import hf_tp_plan

    for family in ("qwen2_moe", "qwen3_moe"):  # every layer sparse: the dense mlp.* keys name nothing
        model = build(family)
        plan = hf_tp_plan(model, 2)
        assert "model.layers.*.mlp.gate_proj" in model.tp_plan and "model.layers.*.mlp.gate_proj" not in plan
        assert "model.layers.*.self_attn.q_proj" in plan
    model = build("qwen3")
    model.tp_plan = {"model.layers.*.mlp.nope": "colwise", "model.blocks.*.up": "rowwise"}
    with pytest.raises(ParallelError, match=r"none of Qwen3ForCausalLM's tp plan entries .* names a submodule"):
        hf_tp_plan(model, 2)
    from transformers import AutoModelForCausalLM

    config = build("deepseek_v3").config
    config.moe_intermediate_size = 3  # 2 shared experts of 3: 6 columns, which 4 ranks cannot split evenly
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with pytest.raises(ParallelError, match=r"'model.layers.1.mlp.shared_experts.gate_proj' along a dim of 6.*tp=4"):
        hf_tp_plan(model, 4)  # heads, intermediate_size and the vocabulary divide: only this split is refused
    model = build("qwen3_moe")  # an entry naming a bare parameter would shard what torch's styles cannot place
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.experts.gate_up_proj": "colwise"}
    with pytest.raises(ParallelError, match=r"parameter 'model.layers.0.mlp.experts.gate_up_proj'.*'colwise'"):
        hf_tp_plan(model, 2)


class _TpTopology:
    """Just the fields parallelize() reads before it shards: it raises before any collective."""

    replica_dims, split_dims, stage_dims, metric_dims = ("tp",), (), (), ()

    def size(self, dims: Any) -> int:
        return 2 if dims else 1


def test_gpt2_is_refused_for_its_conv1d():
    from transformers import GPT2Config, GPT2LMHeadModel

    import meshwise
    from meshwise.errors import ParallelError

    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0)
    with pytest.raises(
        ParallelError, match=r"no tensor-parallel plan, and 'transformer.h.0.attn.c_attn' is a .*Conv1D"
    ):
        meshwise.parallelize(GPT2LMHeadModel(config), _TpTopology(), tp_plan="auto")
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(ParallelError, match=r"'transformer.h.0.attn.c_attn', a Conv1D, .* only nn.Linear"):
        plan = {"transformer.h.*.attn.c_attn": ColwiseParallel()}  # a hand-written plan meets the same wall
        meshwise.parallelize(GPT2LMHeadModel(config), _TpTopology(), tp_plan=plan)


def test_a_parameter_meeting_sharded_activations_in_no_plan_entry_is_refused():
    """A whole parameter that meets colwise-sharded activations and no plan entry would get a partial gradient on
    each tp rank (Apertus's xIELU alpha_p/alpha_n, Param2MoE's q_norm/k_norm): refused before any sharding, naming
    the parameters and the entry to add; with the entry (Qwen3's own plan) the model is planned."""
    from meshwise.errors import ParallelError
    from meshwise.hf.plans import hf_tp_plan

    model = build("qwen3")
    hf_tp_plan(model, 2)  # its own plan gives q_norm/k_norm replicated_with_grad_allreduce
    model.tp_plan = {k: v for k, v in model.tp_plan.items() if not k.endswith(("q_norm", "k_norm"))}
    with pytest.raises(
        ParallelError,
        match=r"leaves \['model.layers.0.self_attn.k_norm.weight', 'model.layers.0.self_attn.q_norm.weight'.*"
        r"in no plan entry.*\['model.layers.\*.self_attn.k_norm', 'model.layers.\*.self_attn.q_norm'\].*"
        r"replicated_with_grad_allreduce",
    ):
        hf_tp_plan(model, 2)
