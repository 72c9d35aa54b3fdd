"""Context parallel for transformers models: their attention routed through meshwise's context-parallel attention
by registering it with transformers' ``AttentionInterface`` (``attn_implementation="meshwise_cp"``), and the
checks of a call (global ``position_ids`` given, no ``labels=`` the model would shift inside a chunk).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from meshwise import compat
from meshwise.errors import ParallelError
from meshwise.hf.plans import is_hf_model
from meshwise.parallel.cp_attention import ENTRY_POINT, ContextAttention, attention
from meshwise.parallel.placement import on_parallelize

__all__ = ["ATTN_IMPLEMENTATION", "ROUTER", "hf_context_parallel"]


ATTN_IMPLEMENTATION = "meshwise_cp"  # the name registered with transformers' AttentionInterface


# Keyword arguments transformers' attention modules pass that do not change the attention's math (bookkeeping of
# the forward): anything else must be one meshwise applies (dropout, scaling, sliding_window, is_causal: checked
# below) or None, or the call is refused, naming it (softcap, s_aux sinks, a sparse indexer's indices, a bias ...).
_HARMLESS = frozenset(
    {
        "position_ids",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "cache_position",
        "past_key_values",
        "past_key_value",
        "layer_idx",
    }
)
_BUILT_MASKS: collections.deque[tuple[int, bool]] = collections.deque(maxlen=256)  # (storage, causal) of our masks


def _mask_function(*args: Any, **kwargs: Any) -> Any:
    """transformers' sdpa mask, noted as built by the model's own mask code (the attention function then knows a
    mask it may ignore from one a family computed itself, e.g. Doge's learned dynamic mask)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)
    if isinstance(mask, torch.Tensor):
        _BUILT_MASKS.append((mask.untyped_storage().data_ptr(), _causal(mask)))
    return mask


def _causal(mask: torch.Tensor) -> bool:
    """Whether a local sdpa mask ``[..., Tq, Tk]`` (bool: True attends; float: 0 attends) blocks every key after its
    query (a causal mask, padding allowed): meshwise's attention is causal by the true positions."""
    if mask.device.type == "meta" or mask.shape[-1] != mask.shape[-2]:
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return not bool(allowed.triu(diagonal=1).any())


def _refuse(module: nn.Module, what: str, fix: str) -> ParallelError:
    return ParallelError(
        f"{type(module).__name__} calls its attention with {what}, which meshwise's context-parallel attention "
        f"(plain softmax attention, causal by the tokens' global positions) does not compute: one process would "
        f"train differently. {fix}"
    )


_NO_CP = "Train this family without a token split dim (drop cp from the mesh)"


def _check_call(module: nn.Module, query: Any, attention_mask: Any, kwargs: dict, size: int) -> bool:
    """Refuse a call whose keyword arguments change the attention's math in a way meshwise does not apply; return
    whether the attention is causal. The same on every rank (the model's config and the mask code decide)."""
    for name, value in kwargs.items():
        if name in _HARMLESS or name in ("sliding_window", "is_causal") or value is None:
            continue
        if name == "softcap" and not value:
            continue
        what = {
            "softcap": f"attention logit softcapping (softcap={value})",
            "s_aux": "attention sinks (s_aux, a learned per-head logit in every softmax)",
        }.get(name, f"{name}={type(value).__name__} (an argument meshwise's attention does not apply)")
        raise _refuse(module, what, _NO_CP + ".")
    window = kwargs.get("sliding_window")
    tokens = query.shape[-2] * size  # the whole window's tokens: the same on every rank
    if isinstance(window, int) and not isinstance(window, bool) and 0 < window < tokens:
        raise _refuse(
            module,
            f"a sliding window of {window} tokens shorter than the {tokens}-token window",
            f"Train with windows of at most {window} tokens, or without a token split dim.",
        )
    if attention_mask is None:
        # no mask: transformers' mask code found the causal flag enough (a module's own is_causal attribute is not
        # trusted: a decoder's may read False while its mask code asked for a causal mask); only an explicit
        # is_causal=False asks for every token to see the whole window, which meshwise's attention computes
        return kwargs.get("is_causal") is not False
    if not isinstance(attention_mask, torch.Tensor):
        raise _refuse(module, f"an attention_mask of type {type(attention_mask).__name__}", _NO_CP + ".")
    ptr = attention_mask.untyped_storage().data_ptr()
    built = next((c for p, c in reversed(_BUILT_MASKS) if p == ptr), None)
    if built is None:
        raise _refuse(
            module,
            "an attention_mask its own forward computed (not the causal/padding mask transformers' mask code built, "
            "e.g. a learned dynamic mask)",
            _NO_CP + ".",
        )
    if not built:
        raise _refuse(module, "a mask that is not causal (bidirectional or another pattern)", _NO_CP + ".")
    return True


def _meshwise_cp_attention(
    module: nn.Module,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: Any = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention-function signature over meshwise's context-parallel attention.

    The causal/padding mask transformers' mask code built is not used: meshwise's attention is causal by the
    tokens' true positions, which a split window's local mask cannot express. Any argument that changes the
    attention's math otherwise (softcap, attention sinks, a sliding window shorter than the window, a mask the
    family computed itself, a bias) is refused, naming it, before this layer's attention runs.
    """
    attn = getattr(module, ENTRY_POINT, None)
    if attn is None:
        raise ParallelError(
            f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} without meshwise's attention: "
            "call meshwise.parallel.context.context_parallel(model, topo) on the model first"
        )
    if position_ids is None:
        raise ParallelError(
            f"{type(module).__name__} runs under context parallel without position_ids: call the model with "
            "model(input_ids=batch['input'], position_ids=batch['positions'])"
        )
    if dropout:
        raise ParallelError(f"attention dropout {dropout} under context parallel is not supported: set it to 0")
    causal = _check_call(module, query, attention_mask, kwargs, attn.topology.size(attn.dim))
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: each kv head serves `groups` query heads
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = attention(
        query,
        key,
        value,
        position_ids,
        attn.topology,
        dim=attn.dim,
        is_causal=causal,
        scale=scaling,
        kind=attn.kind,
        ring_above=attn.ring_above,
    )
    return out.transpose(1, 2).contiguous(), None


def _require_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("labels") is not None:
        # HF shifts labels inside the model, within this rank's chunk of each window: the chunk's last token
        # would be paired with the first of the next chunk it does not hold (2.2e-3 off one process, silently)
        raise ParallelError(
            f"{type(module).__name__} was called with labels= under context parallel, where each rank holds only "
            "chunks of every window and the model's own shift pairs tokens across chunk borders: shift the labels "
            "before the token split (a 'target' field, -100 where nothing is scored), call the model without "
            "labels, and train with loss_weight='labels' on its logits (docs/hf.md)"
        )
    if kwargs.get("position_ids") is None:
        raise ParallelError(
            f"{type(module).__name__} runs under context parallel: each rank holds only part of every window, so "
            "call it with its tokens' global positions, model(input_ids=..., position_ids=batch['positions'])"
        )


def hf_context_parallel(model: nn.Module, attn: Any) -> nn.Module:
    """Route a transformers model's attention through meshwise's context-parallel attention ``attn``.

    Registers :data:`ATTN_IMPLEMENTATION` with transformers' ``AttentionInterface`` (and the sdpa mask for it),
    points the config at it, and gives each attention module the ``context_attention`` entry point.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _meshwise_cp_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask_function)
    modules = [
        m
        for m in model.modules()
        if type(m).__module__.startswith("transformers.") and type(m).__name__.endswith("Attention")
    ]
    if not modules:
        raise ParallelError(f"{type(model).__name__} has no transformers attention module to route")
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        compat.set_attn_implementation(config, ATTN_IMPLEMENTATION)
    for m in modules:
        setattr(m, ENTRY_POINT, attn)
    model.register_forward_pre_hook(_require_position_ids, with_kwargs=True)
    return model


_INTERFACE = ("ALL_ATTENTION_FUNCTIONS", "_attn_implementation", "attention_interface")
_CALLS_INTERFACE: dict[type, bool] = {}


def _calls_interface(cls: type) -> bool:
    """Whether a transformers module class (or a transformers base of it) reads transformers' attention interface
    in its source: a class that never does computes its attention itself (GPT-Neo, MPT, Bloom ...)."""
    if cls not in _CALLS_INTERFACE:
        found = False
        for c in cls.__mro__:
            if not c.__module__.startswith("transformers."):
                break
            try:
                source = inspect.getsource(c)
            except (OSError, TypeError):
                found = True  # no source to read: the first forward's routing proof judges it
                break
            if any(w in source for w in _INTERFACE):
                found = True
                break
        _CALLS_INTERFACE[cls] = found
    return _CALLS_INTERFACE[cls]


def check_interface(model: nn.Module) -> None:
    """Refuse a model with a transformers attention module none of whose classes reads transformers' attention
    interface in its source (MPT, Bloom, GPT-Neo compute attention in their own forward): routing it would leave
    each rank attending only to its own tokens, or fail in transformers' mask code first (MPT)."""
    attention = [
        (n, m)
        for n, m in model.named_modules()
        if type(m).__module__.startswith("transformers.") and type(m).__name__.endswith("Attention")
    ]
    bypass = [n for n, m in attention if not any(_calls_interface(type(c)) for c in m.modules())]
    if bypass:
        raise ParallelError(
            f"context parallel refused {type(model).__name__}: its attention module(s) {bypass[:4]}"
            f"{' ...' if len(bypass) > 4 else ''} compute attention themselves, never through transformers' attention "
            f"interface, so each rank would attend only to its own tokens: {ROUTER.fix}"
        )


class _Router:
    """The :class:`~meshwise.parallel.context.AttentionRouter` of transformers models."""

    fix = (
        "this transformers family's attention does not call transformers' attention interface "
        "(config._attn_implementation), which is the only door meshwise has into it: train it without a "
        "split dim, or pick a family whose attention goes through the interface (Llama, Mistral, Qwen, ...)"
    )

    def claims(self, model: nn.Module) -> bool:
        return is_hf_model(model)

    def route(self, model: nn.Module, attn: ContextAttention) -> None:
        check_interface(model)  # before any forward: such a model may fail in transformers' mask code first (MPT)
        if attn.topology.size(attn.dim) > 1:
            probe_split(model)  # what no attention makes equal on split windows, proven in this process
        hf_context_parallel(model, attn)


ROUTER = _Router()
"""Registered with :func:`meshwise.parallel.context.on_attention_router` by :mod:`meshwise.hf`."""


# --------------------------------------------------------------------------- the one-process probe under a split

_PROBE = "meshwise_cp_probe"  # each token attends only to itself: what remains of cross-token flow is not attention
_RANDOM = frozenset(
    {
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "multinomial",
        "bernoulli",
        "normal",
        "poisson",
        "uniform_",
        "normal_",
        "exponential_",
        "bernoulli_",
        "random_",
        "geometric_",
        "cauchy_",
        "log_normal_",
    }
)


def _register_probe() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(_PROBE, _self_only_attention)
    AttentionMaskInterface.register(_PROBE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _self_only_attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any):
    groups = query.shape[1] // value.shape[1]
    return value.repeat_interleave(groups, dim=1).transpose(1, 2).contiguous(), None


class _RandomDraws(TorchFunctionMode):
    """Notes random sampling calls (a router's jitter or sampling), not dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _RANDOM:
            self.seen.add(name)
        return func(*args, **(kwargs or {}))


def _logits(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    kwargs = {} if positions is None else {"position_ids": positions}
    out = model(input_ids=ids, **kwargs)
    if not isinstance(out, torch.Tensor):
        out = out.logits if getattr(out, "logits", None) is not None else out[0]
    return out.detach().double()


def _attn_implementations(model: nn.Module) -> list[tuple[Any, Any]]:
    """Each config of ``model`` (sub-models have their own) with its attention implementation."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
    return [(c, getattr(c, "_attn_implementation", None)) for c in configs]


@contextlib.contextmanager
def _restored(model: nn.Module, own: list[tuple[Any, Any]]) -> Iterator[None]:
    """Give back what a probe changes: each config's attention implementation, each module's training mode."""
    modes = {m: m.training for m in model.modules()}
    try:
        yield
    finally:
        for c, name in own:
            compat.set_attn_implementation(c, name)
        for m, training in modes.items():
            m.train(training)


def _rng_devices(device: torch.device) -> list[torch.device]:
    return [device] if device.type == "cuda" else []


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-6 * (1.0 + a.abs().max()))


def probe_split(model: nn.Module) -> None:
    """Refuse, under a token split, a transformers model that cannot equal one process on split windows whatever
    its attention does, proven by forwards of an 8-token window in this process (the same on every rank: fixed
    tokens, the model's own weights, no collective of meshwise's): tokens mixed outside attention (with each token
    attending only to itself, changing the first token changes later logits: a convolution, a state-space or linear
    recurrence ...), positions of its own (given ``position_ids=0..T-1`` its logits differ from its own positions',
    RoBERTa's padding offset) or ignored (``position_ids`` that change nothing: positions built from the local
    length, BART), or a training forward that draws random numbers (:func:`check_random_draws`). Skipped for a
    model on the meta device."""
    params = [p for p in model.parameters()]
    if not params or any(p.device.type == "meta" for p in params):
        return
    _register_probe()
    own = _attn_implementations(model)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if vocab < 16:
        return
    device = params[0].device
    ids = (torch.arange(8, device=device) * 5 + 3) % (vocab - 3) + 3
    other = ids.clone()
    other[0] = 3 if ids[0] != 3 else 4
    pos = torch.arange(8, device=device)[None]
    found: list[str] = []
    draws = _RandomDraws()
    try:
        with _restored(model, own), torch.enable_grad(), torch.random.fork_rng(devices=_rng_devices(device)):
            model.train()
            with draws:
                _logits(model, ids[None], pos)  # in training mode, as the model will train
            model.eval()
            base = _logits(model, ids[None], pos)
            if not _same(base, _logits(model, ids[None], None)):
                found.append(
                    "its own positions differ from the global position_ids 0..T-1 meshwise passes (e.g. RoBERTa's "
                    "padding_idx + 1 offset): each rank would embed other positions than one process"
                )
            elif _same(base, _logits(model, ids[None], pos * 2)):
                found.append(
                    "it ignores the position_ids it is given (positions built from the input length, e.g. BART's "
                    "learned positions): each rank would embed its chunk at positions 0.. of its own"
                )
            for c, _ in own:
                compat.set_attn_implementation(c, _PROBE)
            mixed = _logits(model, ids[None], pos)[:, 1:] - _logits(model, other[None], pos)[:, 1:]
            if bool(mixed.abs().max() > 1e-6 * (1.0 + base.abs().max())):  # above float32 rounding
                found.append(
                    "it mixes tokens outside attention (with every token attending only to itself, changing the "
                    "first token changes later ones: a convolution along the sequence, a state-space or "
                    "linear-attention recurrence, a batch-wide router): each rank would mix only its own chunk"
                )
    except Exception:  # noqa: BLE001 - a model this probe cannot run is judged by the first forward's proof alone
        found = []
    if draws.seen:
        found.append(_draws_message(draws.seen))
    if found:
        raise ParallelError(
            f"context parallel refused {type(model).__name__}: it cannot equal one process on token-split windows, "
            "whatever meshwise's attention does: " + "; ".join(found) + ". Train it without a token split dim."
        )


def _draws_message(seen: set[str]) -> str:
    return (
        f"its training forward draws random numbers ({sorted(seen)}: a router's sampling or jitter noise, e.g. "
        "PhiMoE's sparsemixer), and a mesh that splits the batch (data parallel, a token split, micro-batches) "
        "draws for other tokens on each rank than one process would: disable them (e.g. config.router_jitter_noise "
        "= 0 and routing without sampling) or train on a mesh without batch-splitting dims"
    )


def check_random_draws(model: nn.Module, topology: Any) -> None:
    """Refuse a transformers model whose training forward samples random numbers other than dropout (PhiMoE's
    sparsemixer, a router's jitter noise) on a mesh that splits the batch (data parallel or a split dim) or cuts it
    into micro-batches (stages): each rank draws for other tokens than one process does, so no mesh can equal it.
    Proven by one training-mode forward of a fixed 8-token window in the calling process, each token attending only
    to itself (no collective; RNG state restored; not on the meta device); registered to run in ``parallelize``
    before any placement. A model routed for a token split was probed by ``context_parallel`` already."""
    if not is_hf_model(model) or topology.size(topology.metric_dims) * topology.size(topology.stage_dims) == 1:
        return
    own = _attn_implementations(model)
    if topology.size(topology.split_dims) > 1 and any(name == ATTN_IMPLEMENTATION for _, name in own):
        return
    params = list(model.parameters())
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if not params or any(p.device.type == "meta" for p in params) or vocab < 16:
        return
    _register_probe()
    device = params[0].device
    ids = ((torch.arange(8, device=device) * 5 + 3) % (vocab - 3) + 3)[None]
    draws = _RandomDraws()
    try:
        with _restored(model, own), torch.enable_grad(), torch.random.fork_rng(devices=_rng_devices(device)):
            for c, _ in own:
                compat.set_attn_implementation(c, _PROBE)
            model.train()
            with draws:
                _logits(model, ids, torch.arange(8, device=device)[None])
    except Exception:  # noqa: BLE001 - a model this probe cannot run is not judged here
        return
    if draws.seen:
        raise ParallelError(
            f"{type(model).__name__} cannot equal one process on this mesh: {_draws_message(draws.seen)}"
        )


on_parallelize(check_random_draws)
