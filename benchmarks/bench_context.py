"""Context parallel: bytes read per rank, attention's saved activations per rank, balance of the causal work.

    .venv/bin/python benchmarks/bench_context.py [--window 4096] [--windows 64]

One launch of 4 processes, two meshes (dp=2 x cp=2, then cp=4). Baselines, measured in the same run:
every rank reading whole windows (``parts=None``) for the bytes, one process's ``F.scaled_dot_product_attention``
over the whole window for the saved activations, the mean over the split ranks for the balance (and, for
contrast, plain contiguous chunks ``Shard(0)``). Goals: bytes <= 1/cp + 2 %, balance <= 1.05.
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


def _saved_bytes(fn) -> tuple[int, float]:
    """Bytes of the distinct storages autograd saves while ``fn`` runs forward, and its forward+backward seconds."""
    import torch

    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()
    return sum(storages.values()), time.perf_counter() - t0


def _activations(topo, window: int) -> dict:
    """Saved bytes of the attention at ``window`` tokens: this rank's cp part vs one process's whole window."""
    import torch
    import torch.nn.functional as F

    from meshwise.data.parts import balanced_bounds
    from meshwise.parallel.context import attention

    k, i = topo.size("cp"), topo.coordinate("cp")
    pos = torch.cat([torch.arange(a, b) for a, b in balanced_bounds(window, k, i)])
    torch.manual_seed(0)
    shape = (1, 4, window, 32)  # one window, 4 heads of 32 (the GPT example's d_model 128)
    q, kk, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    one, one_s = _saved_bytes(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True))
    part = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, kk, v)]
    mine, mine_s = _saved_bytes(lambda: attention(*part, pos, topo))
    return {"one": one, "cp": mine, "one_s": one_s, "cp_s": mine_s}


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
    out["act"] = _activations(topo, window)
    meshwise.shutdown()
    topo = _init({"cp": 4})
    out["cp4"] = (_bytes_read(topo, path, window, True), _bytes_read(topo, path, window, False))
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
    act = max(r["act"]["cp"] for r in ranks) / ranks[0]["act"]["one"]
    a = ranks[0]["act"]
    print(
        f"attention at {args.window} tokens, 4 heads x 32, fp32: saved {a['one'] / 2**20:.2f} MiB one process, "
        f"{max(r['act']['cp'] for r in ranks) / 2**20:.2f} MiB per cp=2 rank; forward+backward {a['one_s'] * 1e3:.0f} "
        f"ms one process, {max(r['act']['cp_s'] for r in ranks) * 1e3:.0f} ms per cp=2 rank (loaded machine)"
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
        f"activation_ratio_cp2={act:.3f} balance={max(balance[(k, 'balanced')] for k in work):.3f} "
        f"balance_contiguous_cp4={balance[(4, 'contiguous')]:.3f}"
    )


if __name__ == "__main__":
    main()
