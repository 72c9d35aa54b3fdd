"""Benchmark node-set parts of a graph (``meshwise.data.node_parts``): bytes read, halo share, read rate, exchange.

A jittered ``--side`` x ``--side`` triangle mesh (two triangles a cell, edges both ways; ``--side 1024``: 1,048,576
nodes), node ids shuffled, one node field of ``--features`` float32 written to Zarr (chunks of ``--chunk`` nodes),
then rewritten in partition order by ``reorder_nodes``. Split over 4 ranks along the Morton curve, 1-hop halo:

* ``graph_bytes_ratio_s4``: the most bytes a rank reads (owned + halo rows) over the whole field's bytes
  (goal <= 0.25 + halo share + 0.02); ``graph_halo_share_s4``: halo rows over owned rows, the largest part's
  (goal <= 0.05);
* ``graph_read_ratio``: rows/s of ``read_nodes`` of a part from the reordered Zarr field against a contiguous slice
  of as many rows, median of ``--repeats`` (goal >= 0.8);
* ``graph_exchange_ratio``: the time of one ``node_halo_exchange`` of the field's features at split=4 (4 gloo
  processes) over an all-gather of every node's features, medians of ``--repeats`` (goal <= 0.5).

Final line: ``RESULT graph_bytes_ratio_s4=… graph_halo_share_s4=… graph_read_ratio=… graph_exchange_ratio=…``.

    .venv/bin/python benchmarks/bench_graph.py [--side 1024] [--features 8] [--chunk 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from meshwise.data import node_parts, read_nodes, reorder_nodes


def triangle_mesh(side: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Edges [2, E] and coords [N, 2] of a jittered grid triangulation with shuffled node ids (vectorised)."""
    rng = np.random.default_rng(seed)
    i, j = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    grid = np.stack([i.ravel(), j.ravel()], axis=1).astype(np.float64)
    perm = rng.permutation(len(grid))  # node k sits at grid point perm[k]
    ids = np.argsort(perm)
    g = np.arange(side * side).reshape(side, side)
    a, b, c, d = g[:-1, :-1].ravel(), g[1:, :-1].ravel(), g[:-1, 1:].ravel(), g[1:, 1:].ravel()
    pairs = np.concatenate([np.stack(p) for p in ((a, b), (b, c), (c, a), (b, d), (d, c))], axis=1)
    both = np.unique(np.concatenate([pairs, pairs[::-1]], axis=1), axis=1)
    coords = grid[perm] + rng.uniform(-0.3, 0.3, grid.shape)
    return ids[both], coords


def _exchange_ranks(folder: str, repeats: int) -> dict:
    """On each of 4 ranks (domain=4): median seconds of one node halo exchange and of an all-gather of all nodes."""
    import torch.distributed as dist

    import meshwise
    from meshwise.parallel import node_halo_exchange

    topo = meshwise.init({"domain": 4}, timeout=300)
    edges = np.load(Path(folder, "edges.npy"))
    field = np.load(Path(folder, "u.npy"), mmap_mode="r")
    part = node_parts(edges, len(field), 4)[topo.coordinate("domain")]
    x = torch.from_numpy(np.ascontiguousarray(field[part.owned]))
    everyone = [torch.empty((-(-len(field) // 4), x.shape[1]), dtype=x.dtype) for _ in range(4)]
    padded = torch.zeros_like(everyone[0])
    padded[: len(x)] = x
    times: dict[str, list[float]] = {"exchange": [], "gather": []}
    for _ in range(repeats):
        for name in ("exchange", "gather"):
            dist.barrier()
            t = time.perf_counter()
            if name == "exchange":
                node_halo_exchange(x, part, topo, "domain")
            else:
                dist.all_gather(everyone, padded)
            times[name].append(time.perf_counter() - t)
    meshwise.shutdown()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", type=int, default=1024)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import zarr

    from meshwise.testing import run_distributed

    t0 = time.perf_counter()
    edges, coords = triangle_mesh(args.side)
    n = len(coords)
    field = np.random.default_rng(1).standard_normal((n, args.features)).astype(np.float32)
    print(f"mesh: {n:,} nodes, {edges.shape[1]:,} edges ({time.perf_counter() - t0:.1f} s)")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        report = reorder_nodes(Path(tmp, "ordered"), edges, {"u": field}, 4, coords=coords)
        print(
            f"reorder_nodes in {time.perf_counter() - t0:.1f} s: runs of rows a part reads "
            f"{report['runs_before']} before, {report['runs_after']} after"
        )
        ordered_edges = np.load(Path(tmp, "ordered", "edges.npy"))
        u = np.load(Path(tmp, "ordered", "u.npy"))
        chunks = (args.chunk, args.features)
        z = zarr.open(str(Path(tmp, "u.zarr")), mode="w", shape=u.shape, chunks=chunks, dtype=u.dtype)
        z[:] = u
        parts = node_parts(ordered_edges, n, 4)
        nbytes = [read_nodes(z, part)[1] for part in parts]
        bytes_ratio = max(nbytes) / u.nbytes
        halo_share = max(part.halo_share for part in parts)
        print(f"split=4: bytes per rank {nbytes} of {u.nbytes} ({bytes_ratio:.4f}); halo share {halo_share:.4f}")
        part = max(parts, key=lambda q: len(q.nodes))
        rows, start = len(part.nodes), int(part.owned[0])
        start = min(start, n - rows)
        read, slice_ = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            read_nodes(z, part)
            read.append(time.perf_counter() - t)
            t = time.perf_counter()
            np.asarray(z[start : start + rows])
            slice_.append(time.perf_counter() - t)
        read_ratio = statistics.median(slice_) / statistics.median(read)
        print(
            f"read_nodes {statistics.median(read) * 1e3:.1f} ms, a slice of {rows:,} rows "
            f"{statistics.median(slice_) * 1e3:.1f} ms: ratio {read_ratio:.3f}"
        )
        ranks = run_distributed(_exchange_ranks, 4, str(Path(tmp, "ordered")), args.repeats, timeout=600)
        exchange = max(r["exchange"] for r in ranks)
        gather = max(r["gather"] for r in ranks)
        print(f"node halo exchange {exchange * 1e3:.2f} ms, all-gather of every node {gather * 1e3:.2f} ms")
    print(
        f"RESULT graph_bytes_ratio_s4={bytes_ratio:.4f} graph_halo_share_s4={halo_share:.4f} "
        f"graph_read_ratio={read_ratio:.3f} graph_exchange_ratio={exchange / gather:.3f}"
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
