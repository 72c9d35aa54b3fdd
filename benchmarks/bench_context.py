"""Context parallel: bytes read per rank, attention's activation memory per rank, balance of the causal work.

    .venv/bin/python benchmarks/bench_context.py [--window 4096] [--windows 64]

One launch of 4 processes, two meshes (dp=2 x cp=2, then cp=4); at each, both kinds of attention (all-gather and
ring). Baselines, measured in the same run: every rank reading whole windows (``parts=None``) for the bytes, one
process's ``F.scaled_dot_product_attention`` over the whole window for the memory, the mean over the split ranks
for the balance (and, for contrast, plain contiguous chunks ``Shard(0)``). Memory of one attention call, forward
and backward: ``activation`` = the q/k/v it is given (autograd keeps them) + the CPU allocator's peak above them
(torch.profiler's memory events: saved extras, communication buffers, score tiles, gradients, kernel workspace);
``saved`` = the distinct storages autograd saves for backward. Goals: bytes <= 1/cp + 2 %, balance <= 1.05, ring
activation at cp=4 <= 0.35 of one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def _bytes_read(topo, path: str, window: int, balanced: bool) -> int:
    """This rank's bytes for one epoch of token windows: its balanced part, or whole windows."""
    import numpy as np

    from meshwise.data import ArrayDataset, Shard, mesh_dataloader

    tokens = np.load(path, mmap_mode="r")
    n = len(tokens) // (window + 1)
    w = tokens[: n * (window + 1)].reshape(n, window + 1)
    ds = ArrayDataset({"input": w[:, :-1], "target": w[:, 1:]})
    part = Shard(0, balanced=True)
    parts = {"input": part, "target": part} if balanced else None
    loader = mesh_dataloader(ds, topo, global_batch_size=8, mode="train", parts=parts)
    for _ in loader:
        pass
    return loader.bytes_read


def _memory(fn, inputs: list) -> dict:
    """One forward+backward of ``fn``: activation bytes (inputs + allocator peak above them), saved bytes, seconds.

    The seconds come from a second run without the profiler.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    grad = torch.ones_like(inputs[0])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        out.backward(grad)
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    for t in inputs:
        t.grad = None
    t0 = time.perf_counter()
    fn().backward(grad)
    seconds = time.perf_counter() - t0
    given = sum(t.untyped_storage().nbytes() for t in inputs)
    return {"activation": given + peak, "saved": sum(storages.values()), "s": seconds}


def _activations(topo, window: int) -> dict:
    """Memory of the attention at ``window`` tokens, each kind on this rank's cp part, and one process's SDPA."""
    import torch
    import torch.nn.functional as F

    from meshwise.data.parts import balanced_bounds
    from meshwise.parallel.context import attention

    k, i = topo.size("cp"), topo.coordinate("cp")
    pos = torch.cat([torch.arange(a, b) for a, b in balanced_bounds(window, k, i)])
    torch.manual_seed(0)
    shape = (1, 4, window, 32)  # one window, 4 heads of 32 (the GPT example's d_model 128)
    whole = [torch.randn(shape, requires_grad=True) for _ in range(3)]
    out = {"one": _memory(lambda: F.scaled_dot_product_attention(*whole, is_causal=True), whole)}
    for kind in ("gather", "ring"):
        part = [t.detach()[:, :, pos].clone().requires_grad_() for t in whole]
        out[kind] = _memory(lambda: attention(*part, pos, topo, kind=kind), part)  # noqa: B023 (called at once)
    return out


def _times(topo, windows: tuple[int, ...], repeats: int = 3) -> dict:
    """Best forward+backward seconds of each kind at short ``windows`` (where ``kind="auto"`` chooses)."""
    import torch

    from meshwise.data.parts import balanced_bounds
    from meshwise.parallel.context import attention

    k, i = topo.size("cp"), topo.coordinate("cp")
    out = {}
    for window in windows:
        pos = torch.cat([torch.arange(a, b) for a, b in balanced_bounds(window, k, i)])
        part = [torch.randn(1, 4, len(pos), 32, requires_grad=True) for _ in range(3)]
        for kind in ("gather", "ring"):
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                attention(*part, pos, topo, kind=kind).sum().backward()
                best = min(best, time.perf_counter() - t0)
            out[(kind, window)] = best
    return out


def _work(window: int, k: int) -> dict:
    """Causal score elements per rank, balanced chunks vs contiguous chunks (pure arithmetic of the runs)."""
    from meshwise.data import chunk_bounds
    from meshwise.data.parts import balanced_bounds
    from meshwise.parallel.context import score_elements

    out = {}
    for kind, ranks in (
        ("balanced", [[p for a, b in balanced_bounds(window, k, i) for p in range(a, b)] for i in range(k)]),
        ("contiguous", [list(range(*chunk_bounds(window, k, i))) for i in range(k)]),
    ):
        out[kind] = [score_elements(r, ranks) for r in ranks]  # each rank's runs, cut as the attention cuts them
    return out


def _init(mesh: dict):
    import meshwise

    return meshwise.init(mesh, timeout=60)


def _rank(path: str, window: int) -> dict:
    import meshwise

    out: dict = {}
    topo = _init({"dp": 2, "cp": 2})
    out["cp2"] = (_bytes_read(topo, path, window, True), _bytes_read(topo, path, window, False))
    out["act2"] = _activations(topo, window)
    meshwise.shutdown()
    topo = _init({"cp": 4})
    out["cp4"] = (_bytes_read(topo, path, window, True), _bytes_read(topo, path, window, False))
    out["act4"] = _activations(topo, window)
    out["times4"] = _times(topo, (256, 1024, 2048))
    meshwise.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=4096, help="tokens per window (divisible by 8)")
    p.add_argument("--windows", type=int, default=64, help="windows in the token file")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import numpy as np

    from meshwise.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens.npy")
        rng = np.random.default_rng(0)
        np.save(path, rng.integers(0, 50_000, args.windows * (args.window + 1), dtype=np.uint16))
        ranks = run_distributed(_rank, 4, path, args.window, timeout=600)
    ratios = {}
    for mesh in ("cp2", "cp4"):
        ratios[mesh] = max(r[mesh][0] for r in ranks) / max(r[mesh][1] for r in ranks)
        print(f"{mesh}: bytes per rank {[r[mesh][0] for r in ranks]} vs whole windows {[r[mesh][1] for r in ranks]}")
    act: dict = {}
    for k in (2, 4):
        one = ranks[0][f"act{k}"]["one"]
        print(
            f"cp={k}, attention at {args.window} tokens, 4 heads x 32, fp32, one process (SDPA): activation "
            f"{one['activation'] / 2**20:.2f} MiB, saved {one['saved'] / 2**20:.2f} MiB, forward+backward "
            f"{one['s'] * 1e3:.0f} ms"
        )
        for kind in ("gather", "ring"):
            worst = {m: max(r[f"act{k}"][kind][m] for r in ranks) for m in ("activation", "saved", "s")}
            act[(kind, k)] = worst["activation"] / one["activation"]
            act[(kind, k, "saved")] = worst["saved"] / one["saved"]
            print(
                f"cp={k} {kind}, largest rank: activation {worst['activation'] / 2**20:.2f} MiB "
                f"({act[(kind, k)]:.3f}), saved {worst['saved'] / 2**20:.2f} MiB ({act[(kind, k, 'saved')]:.3f}), "
                f"forward+backward {worst['s'] * 1e3:.0f} ms (loaded machine)"
            )
    times = {key: max(r["times4"][key] for r in ranks) for key in ranks[0]["times4"]}
    for w in sorted({w for _, w in times}):
        print(
            f"cp=4 at {w} tokens, forward+backward, slowest rank, best of 3: gather "
            f"{times[('gather', w)] * 1e3:.1f} ms, ring {times[('ring', w)] * 1e3:.1f} ms"
        )
    work = {k: _work(args.window, k) for k in (2, 4)}
    balance = {}
    for k, w in work.items():
        for kind, per_rank in w.items():
            balance[(k, kind)] = max(per_rank) / (sum(per_rank) / len(per_rank))
            print(
                f"cp={k} {kind}: causal score elements per rank and head {per_rank}, max/mean {balance[(k, kind)]:.3f}"
            )
    print(
        f"RESULT bytes_ratio_cp2={ratios['cp2']:.4f} bytes_ratio_cp4={ratios['cp4']:.4f} "
        + " ".join(f"activation_ratio_{kind}_cp{k}={act[(kind, k)]:.3f}" for kind in ("gather", "ring") for k in (2, 4))
        + " "
        + " ".join(
            f"saved_ratio_{kind}_cp{k}={act[(kind, k, 'saved')]:.3f}" for kind in ("gather", "ring") for k in (2, 4)
        )
        + "".join(
            f" ring_over_gather_time_cp4_w{w}={times[('ring', w)] / times[('gather', w)]:.2f}"
            for kind, w in times
            if kind == "ring"
        )
        + f" balance={max(balance[(k, 'balanced')] for k in work):.3f} "
        f"balance_contiguous_cp4={balance[(4, 'contiguous')]:.3f}"
    )


if __name__ == "__main__":
    main()
