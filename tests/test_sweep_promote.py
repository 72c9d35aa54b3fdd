"""The conformance sweep's judging of float32-heavy families (tests/sweep/promote.py, conformance.verdict): the
float64 promotion of a model's float32 parts leaves nothing in float32 and matches a float64 computation, and a
cell above 1e-12 passes only in float64 or against a data-parallel baseline as far off, within float64 rounding.
One process, no launch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "sweep"))  # conformance imports its siblings by name

import conformance  # noqa: E402
import promote  # noqa: E402


def _islands(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32 islands of Hugging Face models inside a float64 one: a Gemma norm, a float32 softmax, a float32
    router, rotary frequencies from a float32 arange, a float32 factory with the default dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())
    h = h.type_as(x) + F.linear(x.to(torch.float32), w.float().expand(4, -1)).sum(-1, keepdim=True).to(x.dtype)
    p = F.softmax(h, dim=-1, dtype=torch.float32).to(x.dtype)
    freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    return p * freq.repeat(2).to(x.dtype) + torch.ones(8).to(x.device)


def test_promotion_leaves_nothing_in_float32_and_computes_in_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    probe = promote.Float32Parts()
    with probe:
        _islands(x, w).sum().backward()
    assert probe.seen == {"float32"}  # as is: float32 parts
    as_is = x.grad.clone()

    x.grad, w.grad = None, None
    mode, probe = promote.Float64(), promote.Float32Parts()
    with mode, probe:
        out = _islands(x, w)
        out.sum().backward()
    assert probe.seen == set(), probe.seen
    assert {"float", "to(dtype)", "softmax(dtype=)", "arange(dtype=)"} <= mode.rewrote, mode.rewrote
    promoted = x.grad.clone()

    # the same computation written in float64 throughout
    x.grad = None
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)
    h = h + F.linear(x, w.expand(4, -1)).sum(-1, keepdim=True)
    freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    (F.softmax(h, dim=-1) * freq.repeat(2) + 1).sum().backward()
    assert (promoted - x.grad).abs().max() <= 1e-15
    assert (as_is - x.grad).abs().max() > 1e-12  # float32 rounding, which promotion removes


def test_a_cell_above_the_bound_passes_only_in_float64_or_against_a_rounding_baseline():
    ref = {"float32": []}  # the reference of the record: for a promoted one, nothing left in float32
    ran = {"verdict": "ran", "diff": 7.2e-12, "worst": "q_proj.weight", "promoted": True}
    assert conformance.verdict({**ran, "diff": 1e-13, "promoted": False}, ref)["verdict"] == "equal"
    promoted = conformance.verdict({**ran, "diff": 1e-13}, ref, as_is=3.5e-5)
    assert promoted["verdict"] == "float32" and promoted["as_is"] == 3.5e-5, promoted
    halves = conformance.verdict({**ran, "diff": 1e-13}, ref, halves=3.6e-5)  # promoted from the start
    assert halves["verdict"] == "float32" and halves["halves"] == 3.6e-5 and "as_is" not in halves, halves
    failed = conformance.verdict(ran, ref, as_is=3.5e-5)
    assert failed["verdict"] == "FAIL" and "7.20e-12" in failed["error"] and "3.50e-05" in failed["error"], failed
    passed = conformance.verdict(ran, ref, {"verdict": "ran", "diff": 1.1e-11}, as_is=3.5e-5)
    assert passed["verdict"] == "float32" and passed["baseline"] == 1.1e-11, passed
    cpu = conformance.verdict({**ran, "diff": 4e-11}, ref, {"verdict": "ran", "diff": 1.67e-12})  # another CPU
    assert cpu["verdict"] == "float32" and cpu["baseline"] == 1.67e-12, cpu
    far = conformance.verdict({**ran, "diff": 2e-8}, ref, {"verdict": "ran", "diff": 1.1e-11})  # a float32 part
    assert far["verdict"] == "FAIL" and "1.10e-11" in far["error"], far
    alone = conformance.verdict({**ran, "diff": 4e-11}, ref)  # no baseline: the bound stays EQUAL
    assert alone["verdict"] == "FAIL", alone
    wrong = conformance.verdict({**ran, "diff": 5e-2}, ref, {"verdict": "ran", "diff": 5e-2})
    assert wrong["verdict"] == "FAIL", wrong  # a baseline as wrong as the cell vouches for nothing
    left = conformance.verdict({**ran, "diff": 0.0}, {"float32": ["float32"]})
    assert left["verdict"] == "FAIL" and "left after promotion" in left["error"], left


def test_promotion_in_forwards_only():
    class Norm(torch.nn.Module):  # Gemma's: float32 inside a float64 model
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight.float())).type_as(x)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8, dtype=torch.float64), Norm())
    x = torch.randn(3, 8, dtype=torch.float64)
    probe = promote.Float32Parts()
    with promote.in_forwards(model) as mode:
        with probe:
            model(x).sum().backward()
        outside = torch.ones(2).float()  # not in a forward: left alone
    assert probe.seen == set() and "float" in mode.rewrote, (probe.seen, mode.rewrote)
    assert outside.dtype == torch.float32
    with probe:  # the hooks are gone
        model(x)
    assert probe.seen == {"float32"}

    def broken(module: torch.nn.Module, args: tuple) -> None:
        if broken.once:
            broken.once = False
            raise RuntimeError("a forward that raises")

    broken.once = True
    model[1].register_forward_pre_hook(broken)
    with promote.in_forwards(model) as mode:
        try:
            with promote.Float32Parts():  # another mode around a forward that raises (meshwise's probes)
                model(x)
        except RuntimeError:
            pass
        assert torch._C._len_torch_function_stack() == 0  # each mode left in order
        probe = promote.Float32Parts()
        with probe:
            model(x)  # the next forward is promoted again
        assert probe.seen == set(), probe.seen
