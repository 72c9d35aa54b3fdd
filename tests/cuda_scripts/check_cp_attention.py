"""GPU check: meshwise's context-parallel attention equals one process's SDPA, under each SDPA backend.

Mesh ``dp=-1, cp`` (cp 2 where the world is even; one GPU: cp=1). Every rank builds the same q, k, v over a
whole window and keeps its balanced part (chunks ``i`` and ``2cp-1-i``); ``meshwise.parallel.context.attention``
(each ``kind`` it offers: gather, ring) runs forward and backward on the parts, causal. The reference is one
process's ``F.scaled_dot_product_attention(is_causal=True)`` over the whole window on the same device, forced to
one backend at a time with ``torch.nn.attention.sdpa_kernel``: MATH in float64 (outputs and q/k/v gradients of
this rank's rows within 1e-12), and every backend that runs in bfloat16 (FLASH_ATTENTION, EFFICIENT_ATTENTION,
CUDNN_ATTENTION, MATH) within bf16's tolerance. On CUDA, FLASH and EFFICIENT must run; CUDNN is reported.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from _common import device_kind, init, report, two_if

import meshwise

B, H, T, HD = 2, 4, 64, 32
# bf16 keeps 8 significant bits (2^-8 = 3.9e-3 per rounding); compared relative to each tensor's largest value.
# On CPU (torch 2.13) SDPA's bf16 backends are 0.5% of it from float64; meshwise's attention is 1.2-1.6% from them at
# cp=1 and 2.6% (ring) at cp=2: it rounds scores, log-sum-exp and the ring's partial outputs to bf16. 5% bounds that.
BF16_RTOL = 5e-2


def inputs(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    q, k, v, grad = (torch.randn(B, H, T, HD, generator=g, dtype=torch.float64) for _ in range(4))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, grad)]


def sdpa(backend: object, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor] | str:
    """One process over the whole window under ``backend``: output, dq, dk, dv (float64), or why it cannot run."""
    from torch.nn.attention import sdpa_kernel

    q, k, v, grad = inputs(device, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)
    except RuntimeError as exc:  # "No available kernel" (or cuDNN's own words): not for this dtype and device
        return f"unavailable: {str(exc).splitlines()[0][:160]}"
    return [t.double() for t in (out, q.grad, k.grad, v.grad)]


def meshwise_cp(
    topo: meshwise.Topology, dtype: torch.dtype, kind: str | None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """meshwise's attention on this rank's balanced part: output, dq, dk, dv of its rows (float64), and the rows."""
    from meshwise.data.parts import balanced_bounds
    from meshwise.parallel.context import attention

    (a, b), (c, d) = balanced_bounds(T, topo.size("cp"), topo.coordinate("cp"))
    rows = torch.cat([torch.arange(a, b), torch.arange(c, d)]).to(topo.device)
    q, k, v, grad = (t.index_select(-2, rows).contiguous() for t in inputs(topo.device, dtype))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = {} if kind is None else {"kind": kind}
    out = attention(q, k, v, rows, topo, dim="cp", is_causal=True, **kw)
    out.backward(grad)
    return [t.double() for t in (out, q.grad, k.grad, v.grad)], rows


def worst(mine: list[torch.Tensor], ref: list[torch.Tensor], rows: torch.Tensor, relative: bool = False) -> float:
    """The largest difference over output, dq, dk, dv on ``rows``; ``relative``: to each reference's largest value."""
    diffs = []
    for m, r in zip(mine, ref):
        r = r.index_select(-2, rows)
        diffs.append((m - r).abs().max().item() / (r.abs().max().item() if relative else 1.0))
    return max(diffs)


def main() -> None:
    from torch.nn.attention import SDPBackend

    from meshwise.parallel.context import attention

    topo = init({"dp": -1, "cp": two_if(2)})
    dev = topo.device
    kinds = [None]
    if "kind" in inspect.signature(attention).parameters:
        kinds = ["gather", "ring"]
    exact = sdpa(SDPBackend.MATH, dev, torch.float64)
    assert not isinstance(exact, str), f"SDPA's MATH backend in float64: {exact}"
    results: dict[str, object] = {}
    for kind in kinds:
        mine, rows = meshwise_cp(topo, torch.float64, kind)
        diff = worst(mine, exact, rows)
        assert diff <= 1e-12, f"cp attention ({kind}) in float64: {diff:.3e} from SDPA MATH in one process"
        results[f"{kind or 'cp'}_fp64_vs_math"] = diff
    ran = []
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        ref = sdpa(getattr(SDPBackend, backend), dev, torch.bfloat16)
        if isinstance(ref, str):
            results[f"{backend}_bf16"] = ref
            continue
        ran.append(backend)
        results[f"{backend}_bf16_vs_fp64"] = worst(ref, exact, torch.arange(T, device=dev), relative=True)
        for kind in kinds:
            mine, rows = meshwise_cp(topo, torch.bfloat16, kind)
            diff = worst(mine, ref, rows, relative=True)
            assert diff <= BF16_RTOL, f"cp attention ({kind}) in bf16: {diff:.3e} (relative) from SDPA {backend}"
            results[f"{kind or 'cp'}_bf16_vs_{backend}"] = diff
    if device_kind() == "cuda":
        missing = {"FLASH_ATTENTION", "EFFICIENT_ATTENTION"} - set(ran)
        why = {b: results[f"{b}_bf16"] for b in sorted(missing)}
        assert not missing, f"SDPA backends that did not run in bf16 on {torch.cuda.get_device_name()}: {why}"
    assert "MATH" in ran, ran
    report("cp_attention", topo, backends=ran, **results)
    meshwise.shutdown()


if __name__ == "__main__":
    main()
