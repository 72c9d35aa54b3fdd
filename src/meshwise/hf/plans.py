"""Turn a Hugging Face transformers model's own tensor-parallel plan (``tp_plan="auto"``) into torch ParallelStyles,
after checking that the model's sizes divide by the tensor-parallel size; refuse the plan strings meshwise cannot
make equal to one process, naming the string and the module."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from meshwise import compat
from meshwise.errors import ParallelError

__all__ = [
    "GRAD_ALLREDUCE",
    "REFUSED",
    "MlaKvAProjParallel",
    "SIZE_FIELDS",
    "STYLES",
    "ReplicatedWithGradAllReduce",
    "check_divisible",
    "hf_plan_strings",
    "hf_tp_plan",
    "is_hf_model",
]

# The config sizes a TP plan cuts: heads (q/k/v columns, o rows), the MLP width, the vocabulary (embedding, lm_head)
SIZE_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")

GRAD_ALLREDUCE = "replicated_with_grad_allreduce"


def _colwise(gather: bool) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(output_layouts=Replicate()) if gather else ColwiseParallel()


def _rowwise(replicated_input: bool) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(input_layouts=Replicate()) if replicated_input else RowwiseParallel()


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (every rank gets the same sum)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # never reduce into autograd's own buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReplicatedWithGradAllReduce(ParallelStyle):
    """transformers' ``replicated_with_grad_allreduce``: the module's parameters stay whole (plain tensors) on every
    tensor-parallel rank, and their gradient is summed over the tensor-parallel ranks inside backward.

    For a module that sees only this rank's slice of a sharded axis (Qwen3's and Gemma3's per-head
    ``q_norm``/``k_norm`` normalise only the rank's heads), each rank's weight gradient is a partial sum; one
    process's gradient is their sum. The sum is taken in the autograd graph, before the gradient reaches the
    parameter, so it holds whatever tensor the module holds at forward time: FSDP2 and ``replicate`` register
    their own unsharded parameters there (a hook on the original ``nn.Parameter`` would be lost), and they then
    reduce an already-summed gradient over the data-parallel ranks. The gradients are identical on every
    tensor-parallel rank, so ``clip_grad_norm`` counts them once and checkpoints hold plain replicated tensors.
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group = device_mesh.get_group()
        names = [n for n, _ in module.named_parameters(recurse=False)]
        stack: list[dict[str, Any]] = []

        def swap_in(mod: nn.Module, args: Any) -> None:
            slots, saved = compat.parameter_slots(mod), {}
            if torch.is_grad_enabled():
                for name in names:
                    p = slots.get(name)
                    if isinstance(p, DTensor):  # its gradient would be summed over more than the tp ranks
                        raise ParallelError(
                            f"{type(mod).__name__}.{name} is already a DTensor: replicated_with_grad_allreduce keeps "
                            "plain whole parameters; build the model with plain parameters"
                        )
                    if p is not None and p.requires_grad:
                        saved[name] = p
                        # the module computes with a view whose gradient is summed, then reaches p
                        slots[name] = _SumGradOver.apply(p, group)
            stack.append(saved)

        def swap_out(mod: nn.Module, args: Any, output: Any) -> None:
            if stack:
                compat.parameter_slots(mod).update(stack.pop())

        module.register_forward_pre_hook(swap_in)
        module.register_forward_hook(swap_out, always_call=True)
        return module


class MlaKvAProjParallel(ParallelStyle):
    """transformers' ``mla_kv_a_proj``: multi-head latent attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2/V3) stays
    whole, and the gradient of its output's last ``rope_dim`` features is summed over the tensor-parallel ranks.

    Its output is ``[kv_lora_rank | qk_rope_head_dim]``: the first part reaches the colwise ``kv_b_proj``, whose
    input gradient torch's style already sums, while the rotary key part goes straight into attention, shared by
    every head, so each rank's gradient of it covers only its own heads.
    """

    def __init__(self, rope_dim: int) -> None:
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group, rope = device_mesh.get_group(), self.rope_dim

        def sum_rope_grad(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            if not (torch.is_grad_enabled() and output.requires_grad):
                return output
            latent, rotary = output.split([output.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, _SumGradOver.apply(rotary, group)], dim=-1)

        module.register_forward_hook(sum_rope_grad)
        return module


def _mla(config: Any) -> MlaKvAProjParallel:
    rope = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(rope, int):
        raise ParallelError(
            f"the tp plan string 'mla_kv_a_proj' needs config.qk_rope_head_dim (the rotary key width), which "
            f"{type(config).__name__} lacks: pass tp_plan= as a dict"
        )
    return MlaKvAProjParallel(rope)


# transformers' plan strings (its ALL_PARALLEL_STYLES) and, as a function of the model's config, the torch style
# with the same input/output layouts. None: the parameters stay whole on every tensor-parallel rank, their gradient
# taken as the same on each.
STYLES: dict[str, Callable[[Any], Any] | None] = {
    "colwise": lambda config: _colwise(False),  # Replicate in, Shard(-1) out: the heads / MLP columns split
    "colwise_gather_output": lambda config: _colwise(True),  # Replicate out: e.g. lm_head's full logits
    "colwise_rep": lambda config: _colwise(True),
    "rowwise": lambda config: _rowwise(False),  # Shard(-1) in (the colwise output), all-reduced out
    "rowwise_split_input": lambda config: _rowwise(True),  # a replicated input is split here first
    "rowwise_rep": lambda config: _rowwise(True),
    "embedding_rowwise": lambda config: _rowwise(True),  # vocab-parallel embedding: partial lookups summed
    "embedding_colwise": lambda config: _colwise(True),  # hidden-split embedding, gathered
    # transformers' unit styles replicate heads only when there are fewer key/value heads than ranks, which
    # check_divisible refuses: with whole heads on every rank they are colwise/rowwise
    "unit_colwise": lambda config: _colwise(False),
    "unit_rowwise": lambda config: _rowwise(False),
    "replicate": None,  # every rank keeps the whole parameter (its input is replicated: same gradient everywhere)
    GRAD_ALLREDUCE: lambda config: ReplicatedWithGradAllReduce(),  # whole, gradient summed over the tp ranks
    "mla_kv_a_proj": _mla,  # whole, the rotary key slice's gradient summed over the tp ranks
}

# The strings meshwise refuses, and why: each needs a layout torch's ColwiseParallel/RowwiseParallel cannot give.
REFUSED: dict[str, str] = {
    "local_params": "it shards a bare nn.Parameter of the module (e.g. attention sinks) through its own plan entry, "
    "and torch's parallel styles shard only nn.Linear and nn.Embedding",
    "packed_colwise": "a fused (packed) weight holds several projections side by side, and an even column split "
    "would give each rank the wrong mix of them",
    "packed_rowwise": "a fused (packed) weight holds several projections side by side, and an even row split would "
    "give each rank the wrong mix of them",
    "moe_tp_experts": "transformers' deprecated tensor-parallel experts (each rank a slice of every expert, the "
    "routing weights' gradient summed by hand) have no torch style",
    "sequence_parallel": "sequence parallel needs the activations between the styles sharded along the sequence, "
    "which the rest of a transformers plan does not produce",
    "all_reduce": "an all-reduce of a module's partial output has no torch style matching its gradient",
    "grouped_gemm": "it belongs to transformers' expert-parallel plan (experts spread over ranks), which meshwise "
    "does not apply",
    "ep_dispatch_experts": "it belongs to transformers' expert-parallel plan (tokens dispatched to experts on other "
    "ranks), which meshwise does not apply",
}


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (it has a config and a base model prefix)."""
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


def _conv1d_refusal(model: nn.Module, what: str) -> ParallelError:
    return ParallelError(
        f"{what} is a transformers Conv1D (GPT-2 style: weight stored [in, out], q/k/v fused in one c_attn), which "
        "torch's ColwiseParallel/RowwiseParallel cannot shard and transformers declares no tensor-parallel plan "
        f"for: train {type(model).__name__} with data parallel only (a mesh without tp, or tp=1), or use a model "
        "built from nn.Linear (docs/hf.md, 'Tensor parallel')"
    )


def hf_plan_strings(model: nn.Module) -> dict[str, str]:
    """The model's own plan, keys relative to ``model``: the instance's ``_tp_plan`` when transformers built it,
    else ``config.base_model_tp_plan`` under the base model's prefix plus the class's ``_tp_plan`` (lm_head)."""
    if not is_hf_model(model):
        raise ParallelError(
            f"tp_plan='auto' reads a Hugging Face model's own plan, but {type(model).__name__} is not a transformers "
            "PreTrainedModel: pass a dict name -> ColwiseParallel()/RowwiseParallel() instead"
        )
    own = getattr(model, "tp_plan", None)
    if own and any(k.startswith(f"{model.base_model_prefix}.") for k in own):
        return dict(own)
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    prefix = model.base_model_prefix
    inner = getattr(model, prefix, None) if prefix else None
    if isinstance(inner, nn.Module) and inner is not model:
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    plan = {**base, **compat.hf_class_tp_plan(type(model))}
    if not plan:
        conv = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
        if conv:
            raise _conv1d_refusal(model, f"{type(model).__name__} declares no tensor-parallel plan, and {conv[0]!r}")
        raise ParallelError(
            f"{type(model).__name__} declares no tensor-parallel plan (config.base_model_tp_plan is empty): pass "
            "tp_plan= as a dict name -> ColwiseParallel()/RowwiseParallel()"
        )
    return plan


def check_divisible(config: Any, tp: int) -> None:
    """Refuse a tensor-parallel size that does not divide the sizes the plan cuts, naming the sizes that work."""
    sizes = {f: getattr(config, f) for f in SIZE_FIELDS if isinstance(getattr(config, f, None), int)}
    bad = {f: n for f, n in sizes.items() if n % tp}
    if bad:
        common = math.gcd(*sizes.values())
        works = [d for d in range(1, common + 1) if common % d == 0]
        raise ParallelError(
            f"tensor parallel over {tp} ranks cannot split "
            + ", ".join(f"{f}={n}" for f, n in bad.items())
            + f" (every rank must hold whole heads and equal slices; sizes: {sizes}): use a tp size among {works}"
        )


def _matches(names: Any, key: str) -> list[str]:
    """The names ``key`` selects as transformers matches them: each layer number of a name (``.3.``, or ``.3`` at
    the end) read as ``*``, then the whole name equal to the key. ``parallelize_module``'s per-atom wildcards then
    reach the same modules."""
    return [n for n in names if n and re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), n) == key]


def _check_module(model: nn.Module, key: str, name: str, modules: list[tuple[str, nn.Module]], tp: int) -> None:
    """Refuse what the string cannot do on these modules (a refused string, a module its torch style cannot shard)."""
    where = f"{type(model).__name__}'s tp plan gives {key!r} (e.g. {modules[0][0]!r}) the style {name!r}"
    if name in REFUSED:
        raise ParallelError(
            f"{where}, which meshwise refuses: {REFUSED[name]}. Train this model without tensor parallel, or pass "
            "tp_plan= as a dict of torch styles that leaves it whole (docs/hf.md, 'Tensor parallel')"
        )
    if name not in STYLES:
        raise ParallelError(
            f"{where}, which meshwise does not translate to a torch ParallelStyle (known: {sorted(STYLES)}; refused: "
            f"{sorted(REFUSED)}): pass tp_plan= as a dict instead"
        )
    if STYLES[name] is None or name in (GRAD_ALLREDUCE, "mla_kv_a_proj"):
        return
    for mod_name, module in modules:
        if type(module).__name__ == "Conv1D":
            raise _conv1d_refusal(model, repr(mod_name))
        if not isinstance(module, nn.Linear | nn.Embedding):
            raise ParallelError(
                f"{mod_name!r} is a {type(module).__name__}; torch's {name} style shards only nn.Linear and "
                "nn.Embedding: pass tp_plan= as a dict without it"
            )
        # the dim the style splits: a Linear's out (colwise) or in (rowwise) features, an Embedding's rows or columns
        rows = ("colwise" in name) == isinstance(module, nn.Linear)
        size = module.weight.shape[0 if rows else 1]
        if size % tp:
            raise ParallelError(
                f"{where}, which splits {mod_name!r} along a dim of {size}, not a multiple of tp={tp}: every rank "
                "must hold an equal slice; use a tp size that divides it"
            )


def hf_tp_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """The torch plan (name -> ParallelStyle) for ``model``'s own transformers plan over ``tp`` ranks.

    Entries that name nothing in this model are skipped, as transformers skips them (an MoE model whose every
    layer is sparse has no dense ``mlp.gate_proj``), as long as some entry names a module. Raises
    :class:`ParallelError` for sizes that do not divide by ``tp``, a plan string meshwise refuses (:data:`REFUSED`)
    or does not know, an entry naming a bare parameter, a module torch cannot shard (e.g. GPT-2's ``Conv1D``), and
    a plan that names nothing in the model. A sharded ``lm_head`` tied to the input embedding stays whole.
    """
    strings = hf_plan_strings(model)
    check_divisible(model.config, tp)
    tied = getattr(model.config, "tie_word_embeddings", False)
    named = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters()]
    plan: dict[str, Any] = {}
    matched = False
    for key, name in strings.items():
        modules = [(n, named[n]) for n in _matches(named, key)]
        if not modules:
            owned = _matches(params, key)
            if owned and name != "replicate":  # a whole parameter needs no style; any other would shard it
                raise ParallelError(
                    f"{type(model).__name__}'s tp plan gives the parameter {owned[0]!r} (key {key!r}) the style "
                    f"{name!r}: torch's parallel styles place modules, not bare parameters, so meshwise cannot shard "
                    "it; train this model without tensor parallel (docs/hf.md, 'Tensor parallel')"
                )
            matched = matched or bool(owned)
            continue  # names nothing here: transformers skips it too
        matched = True
        _check_module(model, key, name, modules, tp)
        factory = STYLES[name]
        if factory is None:
            continue
        if tied and any(isinstance(m, nn.Linear) for _, m in modules) and key.split(".")[-1] == "lm_head":
            # one weight in two modules: sharding lm_head's rows would also reshape the embedding it shares
            continue
        plan[key] = factory(model.config)
    if not matched:
        raise ParallelError(
            f"none of {type(model).__name__}'s tp plan entries ({sorted(strings)}) names a submodule: the plan does "
            "not fit this model; pass tp_plan= as a dict of names from model.named_modules()"
        )
    check_unplanned(model, strings, named)
    if tied:
        # a tied embedding keeps its whole weight: sharding it would shard the lm_head that shares it
        for key in [k for k in plan if all(isinstance(named[n], nn.Embedding) for n in _matches(named, k))]:
            del plan[key]
    return plan


_SHARDED_OUT = ("colwise", "unit_colwise")  # their output is this rank's features only
_REPLICATED_OUT = tuple(
    n for n in STYLES if "rowwise" in n or n in ("colwise_gather_output", "colwise_rep", "embedding_colwise")
)  # whole: gathered or all-reduced


def check_unplanned(model: nn.Module, strings: dict[str, str], named: dict[str, nn.Module]) -> None:
    """Refuse parameters in no plan entry that meet activations a colwise entry shards, proven on the autograd
    graph of one forward of 8 fixed tokens in this process (before any sharding; the same on every rank).

    Under tp such a parameter is whole on every rank but meets only the rank's features (a norm of the local heads,
    a learned activation between colwise and rowwise, Doge's per-head mask parameters): its gradient is a partial
    sum nothing adds up, or its shapes follow the config's head count. Skipped on the meta device."""
    params = list(model.parameters())
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if not params or any(p.device.type == "meta" for p in params) or vocab < 16:
        return
    planned = {n for key in strings for n in _matches(named, key)}
    covered = lambda n: any(n == p or n.startswith(p + ".") for p in planned)  # noqa: E731
    loose = {
        id(p): f"{mn}.{pn}" if mn else pn
        for mn, m in named.items()
        if not covered(mn)
        for pn, p in m.named_parameters(recurse=False)
    }
    if not loose:
        return
    sharded, whole, hooks = set(), set(), []
    for key, name in strings.items():
        for n in _matches(named, key):
            mark = sharded if name in _SHARDED_OUT else whole if name in _REPLICATED_OUT else None
            if mark is not None:
                hooks.append(named[n].register_forward_hook(lambda m, a, out, mark=mark: _mark(out, mark)))
    inputs: set = set()  # the embeddings' outputs: where activations enter the graph (input ids have none)
    hooks += [
        m.register_forward_hook(lambda m, a, out: _mark(out, inputs))
        for m in named.values()
        if isinstance(m, nn.Embedding)
    ]
    ids = ((torch.arange(8, device=params[0].device) * 5 + 3) % (vocab - 3) + 3)[None]
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            out = model(input_ids=ids)
            out = (
                out
                if isinstance(out, torch.Tensor)
                else out.logits
                if getattr(out, "logits", None) is not None
                else out[0]
            )
            met = _meets_sharded(out.grad_fn, sharded, whole, inputs, loose)
    except Exception:  # noqa: BLE001 - a model the probe cannot run: its first step shows what it does
        return
    finally:
        for h in hooks:
            h.remove()
    if met:
        names = sorted(loose[i] for i in met)
        keys = sorted({re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), n.rsplit(".", 1)[0]) for n in names})
        raise ParallelError(
            f"{type(model).__name__}'s tp plan leaves {names[:4]}{' ...' if len(names) > 4 else ''} in no plan "
            "entry, but they meet activations a colwise entry shards (only this rank's heads or features): each "
            "tp rank would compute a partial gradient that nothing sums, or shapes that follow the config's head "
            f"count. Give {keys[:4]} a plan entry: 'replicated_with_grad_allreduce' where the parameter acts on "
            "the sharded features elementwise (a norm of the heads, a learned activation), else train without "
            "tensor parallel (docs/hf.md, 'Tensor parallel')"
        )


def _mark(out: Any, into: set) -> None:
    for t in out if isinstance(out, tuple | list) else (out,):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            into.add(t.grad_fn)


def _meets_sharded(root: Any, sharded: set, whole: set, inputs: set, loose: dict[int, str]) -> set[int]:
    """The ``loose`` parameters (by id) that an autograd node combines, as parameters (reached without passing an
    activation: ``inputs``), with a sharded activation."""
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)] if root is not None else []
    while stack:  # post-order over the graph: each node after the nodes it reads
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k, _ in node.next_functions if k is not None and id(k) not in seen)
    sh: dict[Any, bool] = {}
    pure: dict[Any, frozenset | None] = {}
    met: set[int] = set()
    for node in order:
        kids = [k for k, _ in node.next_functions if k is not None]
        var = getattr(node, "variable", None)
        if var is not None:  # AccumulateGrad: a leaf parameter
            sh[node], pure[node] = False, frozenset({id(var)})
            continue
        sh[node] = node in sharded or (node not in whole and any(sh.get(k, False) for k in kids))
        sets = [pure.get(k) for k in kids]
        pure[node] = None if node in inputs or not sets or any(s is None for s in sets) else frozenset().union(*sets)
        if any(sh.get(k, False) for k in kids):
            for k in kids:
                if not sh.get(k, False) and pure.get(k):
                    met |= {i for i in pure[k] if i in loose}
    return met
