"""The proof that a model's attention runs meshwise's context-parallel attention: counted in its first forward.

Setting an entry point proves nothing: a model may never call it (GPT-Neo's attention computes its own softmax
whatever transformers' attention interface holds), and then every rank attends only to its own tokens, with no
error. So :func:`arm` watches the model's first forward under a token split: meshwise's attention counts its calls
(:func:`note_call`), each attention module that should call it is checked to have called it at least once during
its own forward, every ``F.scaled_dot_product_attention`` that reaches torch is caught with the module that made
it, and (on the SDPA road, where the forward may build its own positions) every ``torch.arange`` of the local
token count that no position module consumes. The forward then ends in a :class:`ParallelError` naming the
modules, before any backward. Once a forward passes, the probe takes itself off (hooks removed, the forward
unwrapped): a routed model pays one integer increment a call after that.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshwise.errors import ParallelError

__all__ = ["RoutingProof", "arm", "attention_calls", "calls_sdpa", "note_call", "unwatched"]

_CALLS = [0]  # meshwise context-parallel attention calls in this process
_UNWATCHED = [0]  # > 0: meshwise's own torch calls, which the probe does not judge


def note_call() -> None:
    """Count one call of meshwise's context-parallel attention (what the proof watches)."""
    _CALLS[0] += 1


@contextlib.contextmanager
def unwatched() -> Iterator[None]:
    """meshwise's own torch calls inside a probed forward (e.g. comparing positions with an arange): not judged."""
    _UNWATCHED[0] += 1
    try:
        yield
    finally:
        _UNWATCHED[0] -= 1


def attention_calls() -> int:
    """Calls of meshwise's context-parallel attention in this process so far."""
    return _CALLS[0]


_CALLS_SDPA: dict[type, bool] = {}


def calls_sdpa(cls: type) -> bool:
    """Whether ``cls.forward``'s own source calls ``scaled_dot_product_attention`` (cached per class)."""
    if cls not in _CALLS_SDPA:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _CALLS_SDPA[cls] = "scaled_dot_product_attention" in source
    return _CALLS_SDPA[cls]


def _names(names: list[str], limit: int = 6) -> str:
    return f"{names[:limit]}{f' and {len(names) - limit} more' if len(names) > limit else ''}"


class _Watch(TorchFunctionMode):
    """During the probe forward: SDPA calls that reach torch, and aranges of the local token count."""

    def __init__(self, proof: RoutingProof) -> None:
        super().__init__()
        self.proof = proof

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if _UNWATCHED[0]:
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            self.proof.raw_sdpa.append(self.proof.current())
        out = func(*args, **kwargs)
        n = self.proof.local_tokens() if self.proof.local_tokens is not None else None
        if func is torch.arange and n and isinstance(out, torch.Tensor) and out.ndim == 1 and out.numel() == n:
            if out.device.type != "meta" and torch.equal(
                out.detach().cpu().double(), torch.arange(n, dtype=torch.float64)
            ):
                self.proof.aranges.append((out, self.proof.current()))
        return out


class _ProbeForward:
    """The model's forward while the proof is armed (an object, not a closure: a deep copy of the model gets its
    own proof)."""

    def __init__(self, proof: RoutingProof) -> None:
        self.proof = proof

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.proof._probe_forward(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # the model's own, for code that inspects model.forward
        return inspect.signature(self.proof.forward())


class RoutingProof:
    """What the first forward of ``model`` under a token split showed about its attention (see :func:`arm`)."""

    def __init__(
        self,
        model: nn.Module,
        expected: dict[str, nn.Module],
        fix: str,
        local_tokens: Callable[[], int | None] | None = None,
        positions_into: tuple[str, ...] = (),
    ) -> None:
        self.model, self.expected, self.fix = model, expected, fix
        self.cls = type(model).__name__  # before FSDP2 renames the class
        self.local_tokens, self.positions_into = local_tokens, positions_into
        self.proven: set[str] = set()
        self.bypassed: list[str] = []
        self.raw_sdpa: list[str] = []
        self.aranges: list[tuple[torch.Tensor, str]] = []
        self.consumers: dict[int, list[str]] = {}  # id(arange tensor) -> modules it was given to
        self.active = False
        self.stack: list[str] = []
        self._starts: dict[int, list[int]] = {}
        self._module_hooks: dict[str, list[Any]] = {}
        self._probe_hooks: list[Any] = []
        for name, m in expected.items():
            self._module_hooks[name] = [
                m.register_forward_pre_hook(functools.partial(self._pre, name)),
                m.register_forward_hook(functools.partial(self._post, name)),
            ]
        self._own_forward = model.__dict__.get("forward")
        model.forward = _ProbeForward(self)

    def forward(self) -> Callable:
        """The model's own forward (looked up at call time: FSDP2 changes the model's class)."""
        if self._own_forward is not None:
            return self._own_forward
        return functools.partial(type(self.model).forward, self.model)

    def current(self) -> str:
        return self.stack[-1] if self.stack else f"{self.cls}.forward"

    def _pre(self, name: str, module: nn.Module, args: tuple) -> None:
        self._starts.setdefault(id(module), []).append(_CALLS[0])

    def _post(self, name: str, module: nn.Module, args: tuple, out: Any) -> None:
        starts = self._starts.get(id(module))
        if not starts:
            return
        called = _CALLS[0] > starts.pop()
        if self.active:
            if called:
                self.proven.add(name)
            elif name not in self.bypassed:
                self.bypassed.append(name)
        elif not called:  # a module the first forward did not reach, called on its own later
            raise self._error([name], [], [])
        else:
            self._release(name)

    def _release(self, name: str) -> None:
        for h in self._module_hooks.pop(name, []):
            h.remove()

    def _name_pre(self, name: str, module: nn.Module, args: tuple) -> None:
        self.stack.append(name)
        for a in args:
            if isinstance(a, torch.Tensor):
                for t, _ in self.aranges:
                    if a is t:
                        self.consumers.setdefault(id(t), []).append(name)

    def _name_post(self, name: str, module: nn.Module, args: tuple, out: Any) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()

    def _probe_forward(self, *args: Any, **kwargs: Any) -> Any:
        self.active, self.stack, self.bypassed, self.raw_sdpa, self.aranges = True, [], [], [], []
        self.consumers, self._starts = {}, {}
        for name, m in self.model.named_modules():
            if m is self.model:
                continue
            # prepended: they see a position module's input before a positions_into hook replaces it
            self._probe_hooks += [
                m.register_forward_pre_hook(functools.partial(self._name_pre, name), prepend=True),
                m.register_forward_hook(functools.partial(self._name_post, name)),
            ]
        try:
            with _Watch(self):
                out = self.forward()(*args, **kwargs)
        finally:
            self.active = False
            for h in self._probe_hooks:
                h.remove()
            self._probe_hooks = []
        self._verdict()
        return out

    def _verdict(self) -> None:
        positional = [
            (where, self.consumers.get(id(t), []))
            for t, where in self.aranges
            if not any(c in self.positions_into for c in self.consumers.get(id(t), []))
        ]
        order = list(self.expected)
        self.bypassed.sort(key=order.index)
        if self.bypassed or self.raw_sdpa or positional:
            raise self._error(self.bypassed, sorted(set(self.raw_sdpa)), positional)
        for name in self.proven:
            self._release(name)
        if self._own_forward is not None:
            self.model.forward = self._own_forward
        else:
            del self.model.forward  # the class's forward again: nothing left on the path of a routed model

    def _error(self, bypassed: list[str], raw: list[str], positional: list[tuple[str, list[str]]]) -> ParallelError:
        cls, parts = self.cls, []
        if bypassed:
            parts.append(
                f"{cls}'s attention module(s) {_names(bypassed)} ran their forward without calling meshwise's "
                f"attention, so each rank attended only to its own part of every window: {self.fix}"
            )
        if raw:
            parts.append(
                f"F.scaled_dot_product_attention was called outside meshwise's attention by {_names(raw)}: it sees "
                "only this rank's tokens; route those modules: context_parallel(model, topo, sdpa=[their names]) "
                "(or give them the `context_attention` entry point)"
            )
        if positional:
            n = self.local_tokens() if self.local_tokens is not None else "?"
            where = sorted({w for w, _ in positional})
            takers = sorted({c for _, cs in positional for c in cs})
            into = f"positions_into={takers}" if takers else "positions_into=[the module that embeds positions]"
            parts.append(
                f"{cls}'s forward builds positions from the local token count (torch.arange({n}) in {_names(where)}"
                f"{f', given to {_names(takers)}' if takers else ''}), but each rank holds tokens at other global "
                "positions (the batch's 'positions'): pass them, model(x, positions=batch['positions']), and let "
                f"meshwise hand them to the position module, context_parallel(model, topo, sdpa=True, {into}), "
                "or use the `positions` argument in your forward instead of torch.arange"
            )
        return ParallelError(
            "context parallel refused the model at its first forward, before any backward: " + "; ".join(parts)
        )


def arm(
    model: nn.Module,
    expected: dict[str, nn.Module],
    fix: str,
    *,
    local_tokens: Callable[[], int | None] | None = None,
    positions_into: tuple[str, ...] = (),
) -> RoutingProof:
    """Watch ``model``'s first forward: every module of ``expected`` (name -> module) must call meshwise's attention.

    ``fix`` ends the message for modules that do not. ``local_tokens`` (the SDPA road): a callable giving this
    rank's token count for the forward under way; ``torch.arange`` of that length not given to a module named in
    ``positions_into`` is refused as positions built inside the forward.
    """
    return RoutingProof(model, expected, fix, local_tokens, positions_into)
