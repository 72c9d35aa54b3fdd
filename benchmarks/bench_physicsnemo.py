"""PhysicsNeMo mesh: bytes read per rank at model_parallel=4, meshwise tiles vs a whole-field read, one launch.

    .venv/bin/python benchmarks/bench_physicsnemo.py [--samples 16] [--size 256] [--halo 1]

4 gloo processes start PhysicsNeMo's ``DistributedManager`` (``meshwise.physicsnemo.initialize_manager``),
build its mesh with ``manager.initialize_mesh((1, 4), ("data_parallel", "model_parallel"))`` and adopt it. A
2-D field ``[N, 2, size, size]`` float32 ``.npy`` is read one epoch twice by ``mesh_dataloader``: ``Shard(2,
halo)`` (each rank's columns plus the halo) and ``Replicate()`` (the whole field, what a rank reads without
tiles); the ratio of their ``bytes_read`` is measured on each rank in the same run. Goal: the largest ratio
<= 1/4 + halo share (``2 * halo / size``: an interior tile's two halos).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def _rank(path: str, batch: int, halo: int) -> dict:
    from meshwise import physicsnemo as mwp
    from meshwise.data import ArrayDataset, Replicate, Shard, mesh_dataloader

    manager = mwp.initialize_manager()
    manager.initialize_mesh((1, 4), ("data_parallel", "model_parallel"))
    topo = mwp.adopt(roles={"model_parallel": "split"})
    out: dict = {"coordinate": topo.coordinate("model_parallel")}
    for mode, part in (("whole", Replicate()), ("tiles", Shard(2, halo=halo))):
        loader = mesh_dataloader(ArrayDataset({"field": path}), topo, global_batch_size=batch, mode="eval",
                                 parts={"field": part})  # fmt: skip
        widths = {batch_["field"].shape[-1] for batch_ in loader}  # every batch read, so bytes_read is the epoch
        out[mode] = {"bytes": loader.bytes_read, "widths": sorted(widths)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--size", type=int, default=256, help="cells a side")
    parser.add_argument("--batch", type=int, default=4, help="global batch size")
    parser.add_argument("--halo", type=int, default=1)
    args = parser.parse_args()

    from meshwise.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "field.npy")
        field = np.random.default_rng(0).standard_normal((args.samples, 2, args.size, args.size)).astype(np.float32)
        np.save(path, field)
        start = time.perf_counter()
        results = run_distributed(_rank, 4, path, args.batch, args.halo, timeout=300, pg_timeout=120)
        wall = time.perf_counter() - start
    ratios = [r["tiles"]["bytes"] / r["whole"]["bytes"] for r in results]
    halo_share = 2 * args.halo / args.size
    goal = 1 / 4 + halo_share
    worst = max(ratios)
    print(
        f"mesh data_parallel=1 x model_parallel=4 (DistributedManager's, adopted), {args.samples} samples "
        f"2x{args.size}x{args.size} float32 .npy, halo {args.halo}; launch {wall:.1f}s"
    )
    for r, ratio in zip(results, ratios):
        print(
            f"model_parallel rank {r['coordinate']}: whole {r['whole']['bytes'] / 2**20:.3f} MiB, tiles "
            f"{r['tiles']['bytes'] / 2**20:.3f} MiB ({r['tiles']['widths']} columns read), ratio {ratio:.4f}"
        )
    print(f"largest ratio {worst:.4f}; goal <= 1/4 + halo share = {goal:.4f}: {'met' if worst <= goal else 'MISSED'}")
    print(f"RESULT bytes_ratio_mp4={worst:.4f} goal={goal:.4f} halo_share={halo_share:.4f}")


if __name__ == "__main__":
    main()
