"""Before a pipeline runs: the stages agree on each step's input shape (one small all-reduce over the stage group),
and each new shape is first run through every stage's forward on meta tensors, on every rank, so a forward that
calls a piece its stage does not hold is refused on every stage alike instead of failing on one while the
others wait for the timeout."""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from meshwise.errors import ParallelError
from meshwise.rendezvous import WIRE_DTYPES

__all__ = ["agree_input", "meta_copy", "probe_stages"]

_MAX_DIMS = 8


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors (no data is copied); ties kept."""
    memo: dict[int, torch.Tensor] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for _, b in model.named_buffers(remove_duplicate=False):
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return copy.deepcopy(model, memo)  # type: ignore[arg-type]


def agree_input(value: torch.Tensor | None, group: dist.ProcessGroup, device: torch.device) -> tuple:
    """The first stage's input ``(shape, dtype)``, known to every stage of the group after one all-reduce.

    ``value`` is the input on the rank holding the first stage, None on the others. torch's stages size their
    receive buffers from the first micro-batch they see, so a batch whose padded length changes needs stages
    built for its shape: every rank must learn the shape before the schedule runs.
    """
    vec = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    if value is not None:
        vec[0] = value.ndim if value.ndim <= _MAX_DIMS else -1000
        vec[1] = WIRE_DTYPES.index(value.dtype) + 1 if value.dtype in WIRE_DTYPES else -1000
        if value.ndim <= _MAX_DIMS:
            vec[2 : 2 + value.ndim] = torch.tensor(value.shape, dtype=torch.int64)
    dist.all_reduce(vec, group=group)
    ndim, code, *dims = vec.tolist()
    if ndim < 0 or code <= 0:
        raise ParallelError(
            f"the first pipeline stage's input must be a tensor of at most {_MAX_DIMS} dims of a standard dtype "
            "(the stages agree on its shape before each step): reshape it, or pass the other fields through the "
            "model's pieces"
        )
    return tuple(dims[:ndim]), WIRE_DTYPES[code - 1]


def _user_line(error: BaseException) -> str:
    """``file:line: code`` of the innermost frame outside torch and meshwise (the model's own forward)."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno}: `{(f.line or '').strip()}`"


def probe_stages(stages: Sequence[nn.Module], units: Sequence[Sequence[str]], shape: tuple, dtype: torch.dtype) -> None:
    """Run each stage's forward on meta tensors of ``shape`` (one micro-batch), chaining outputs as the schedule
    does; a stage whose forward fails is refused, naming it, the line and the pieces it does not hold.

    Every rank runs the same probe on the same agreed shape, so every rank raises alike before any stage sends
    anything. An op meta tensors cannot run (data-dependent control flow) skips the probe: nothing is known then.
    """
    args: tuple = (torch.empty(shape, dtype=dtype, device="meta"),)
    for index, stage in enumerate(stages):
        try:
            with torch.no_grad():
                out = stage(*args)
        except NotImplementedError:
            return
        except Exception as e:  # noqa: BLE001 - any failure here would fail the real step on this stage only
            if "meta" in str(e).lower():
                return
            held = set(units[index])
            others = [u for k, part in enumerate(units) if k != index for u in part if u not in held]
            listing = ", ".join(others[:8]) + (f", ... ({len(others)} in all)" if len(others) > 8 else "")
            raise ParallelError(
                f"pipeline stage {index} of {len(stages)} (holding {list(units[index])}) fails in the model's own "
                f"forward{_user_line(e)}: {type(e).__name__}: {e}. Each stage runs the model's forward with only "
                f"its pieces; the others ({listing}) are None on this stage, or removed from their container. "
                "Make the forward skip the pieces a stage does not hold and take the previous stage's output "
                "as its input (e.g. `if 'wte' in self.transformer: x = self.transformer.wte(idx)`, "
                "`if self.lm_head is not None: x = self.lm_head(x)`; docs/pipeline.md, 'Unmodified forwards'), "
                "or cut where the forward's pieces are whole. Checked on meta tensors before any stage ran."
            ) from e
        args = out if isinstance(out, tuple) else (out,)
