"""Float64 promotion of a family's low-precision islands: a torch function mode under which every float32 (or
16-bit) computation a float64 model asks for runs in float64 instead, so that one process and a mesh can be held
to float64's bound (1e-12) even for a family that computes parts in float32 (Gemma's norms, routers kept in
float32, rotary frequencies, softmax in float32, a float32 logit softcap); ``in_forwards`` applies it around a
model's forwards only. Also the probe that notices such islands."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

LOW = (torch.float32, torch.float16, torch.bfloat16)
_TO_DOUBLE = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}
_TAKES_DTYPE = {torch.Tensor.to, torch.Tensor.type, torch.Tensor.new_tensor, torch.Tensor.new_empty}
_REWRITTEN = _TO_DOUBLE | _TAKES_DTYPE


def _low(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype in LOW


def _outputs(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class Float32Parts(TorchFunctionMode):
    """Notes whether any torch call returns a floating tensor that is not float64 (a float32 island)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in _outputs(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.seen.add(str(t.dtype).removeprefix("torch."))
        return out


class Float64(TorchFunctionMode):
    """Runs a float64 model's float32 islands in float64: a ``dtype=`` keyword or a positional dtype of
    ``float32``/``float16``/``bfloat16`` becomes ``float64``, ``Tensor.float()`` (``half``, ``bfloat16``) becomes
    ``Tensor.double()``, and what is still low after that (``type_as`` of a low tensor, a factory with the default
    dtype) is cast up on the way out; while it is on, the default dtype is float64 (``torch.add(0.3333, mask)``
    of a boolean mask computes in it). ``rewrote`` names the calls it changed."""

    def __init__(self) -> None:
        super().__init__()
        self.rewrote: set[str] = set()
        self._default: list[torch.dtype] = []

    def __enter__(self) -> Float64:
        self._default.append(torch.get_default_dtype())
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.set_default_dtype(self._default.pop())
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _REWRITTEN or (kwargs and kwargs.get("dtype") in LOW):
            func, args, kwargs = self._rewritten(func, args, dict(kwargs or {}))
        out = func(*args, **kwargs) if kwargs else func(*args)  # the common path: nothing to do but look at out
        if isinstance(out, torch.Tensor):
            return out.double() if out.dtype in LOW and self._cast(func) else out
        if isinstance(out, (tuple, list)) and any(_low(t) for t in out) and self._cast(func):
            return type(out)([t.double() if _low(t) else t for t in out])
        return out

    def _rewritten(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        name = getattr(func, "__name__", str(func))
        if func in _TO_DOUBLE:
            func = torch.Tensor.double
            self.rewrote.add(name)
        if kwargs.get("dtype") in LOW:
            kwargs["dtype"] = torch.float64
            self.rewrote.add(f"{name}(dtype=)")
        if func in _TAKES_DTYPE and any(isinstance(a, torch.dtype) and a in LOW for a in args[1:]):
            args = tuple(torch.float64 if isinstance(a, torch.dtype) and a in LOW else a for a in args)
            self.rewrote.add(f"{name}(dtype)")
        return func, args, kwargs

    def _cast(self, func: Any) -> bool:
        """Whether a low result of ``func`` is cast up: not for in-place ones, which write into a low tensor."""
        name = getattr(func, "__name__", str(func))
        if name.endswith("_"):
            return False
        self.rewrote.add(f"{name} (output)")
        return True


@contextlib.contextmanager
def in_forwards(model: torch.nn.Module) -> Iterator[Float64]:
    """``Float64`` around every forward of ``model``'s modules, and nowhere else: not around backward (whose dtypes
    follow the forward's), the optimizer, or the mesh's own hooks and collectives, which it would only slow down
    (by 1.3 to 2 times under FSDP2 and the pipeline schedules)."""
    mode, inside = Float64(), []  # the modules whose forward runs, outermost first

    def enter(module: Any, args: Any) -> None:
        if not inside:
            mode.__enter__()
        inside.append(module)

    def leave(module: Any, args: Any, out: Any) -> None:
        if inside and inside[-1] is module:  # not for a forward whose pre-hooks raised before ``enter``
            inside.pop()
            if not inside:
                mode.__exit__(None, None, None)

    handles = []
    for m in model.modules():  # always_call: a forward that raises leaves too, in order (meshwise's probes catch it)
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave, always_call=True)]
    try:
        yield mode
    finally:
        for h in handles:
            h.remove()
        if inside:
            inside.clear()
            mode.__exit__(None, None, None)
