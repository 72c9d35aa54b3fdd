"""Benchmark meshwise.data on a field dataset split 4 ways: bytes read per rank and samples/s against raw slicing.

Writes N samples of 1 x S x S float32 as .npy and as Zarr (uncompressed, one shard a sample, inner chunks of
``halo`` rows) to a temp dir, then, for a split dim of size 4 with ``Shard(1, halo)``:

* bytes read per rank by the loader against every rank reading whole samples (both sources);
* samples/s of the loader against raw slicing of the same region (``np.stack`` of memmap slices; Zarr
  slices for Zarr), same indices, same process, best of ``--repeats`` in CPU time (alternating order);
* the three read strategies side by side on a tp=2 x cp=2 mesh (4 gloo processes);
* bytes read per rank on a 2 x 2 grid (split dims x, y) of 3-D volumes, Zarr chunks of ``halo x halo`` cells on
  the two sharded axes, against a whole-sample read: goal <= 1/4 + the halo shell + 2 %.

Quick run: ``--samples 32 --size 256``. Final line: ``RESULT bytes_ratio=… throughput_ratio=… grid_bytes_ratio=…``
(worst rank; ``grid_bytes_ratio`` is Zarr's).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from meshwise.data import ArrayDataset, Shard, mesh_dataloader
from meshwise.environment import Environment
from meshwise.layout import Layout
from meshwise.topology import Topology

SPLIT = 4


def topology(mesh: dict, rank: int, roles: dict | None = None) -> Topology:
    """A real Topology for one rank of ``mesh`` without a process group (enough for read='each')."""
    world = int(np.prod(list(mesh.values())))
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    layout = Layout.resolve(mesh, world, roles)
    return Topology(layout, env, torch.device("cpu"), "gloo", datetime.timedelta(seconds=60), None)


def make_data(root: Path, n: int, size: int, halo: int) -> tuple[Path, Path]:
    import zarr

    rng = np.random.default_rng(0)
    npy = root / "field.npy"
    mm = np.lib.format.open_memmap(npy, mode="w+", dtype=np.float32, shape=(n, 1, size, size))
    for i in range(0, n, 16):
        mm[i : i + 16] = rng.standard_normal((min(16, n - i), 1, size, size), dtype=np.float32)
    mm.flush()
    zpath = root / "field.zarr"
    z = zarr.create_array(
        str(zpath),
        shape=mm.shape,
        dtype="float32",
        chunks=(1, 1, max(halo, 1), size),
        shards=(1, 1, size, size),
        compressors=None,
    )
    for i in range(0, n, 16):
        z[i : i + 16] = mm[i : i + 16]
    del mm
    return npy, zpath


def loader_epoch(ld) -> int:
    rows = 0
    for b in ld:
        rows += b["index"].shape[0]  # train mode with drop_last: no padded rows
    return rows


def raw_epoch(array, plans, region) -> int:
    """The baseline: slice the same region of the same samples, stack, hand out as a tensor."""
    rows = 0
    for idx in plans:
        batch = torch.from_numpy(np.stack([np.asarray(array[(int(i), *region)]) for i in idx]))
        rows += batch.shape[0]
    return rows


def measure(source, raw_array, n: int, batch: int, halo: int, repeats: int) -> dict:
    full = n * raw_array[0].nbytes
    per_rank = []
    for rank in range(SPLIT):
        ld = mesh_dataloader(
            ArrayDataset({"input": source}),
            topology({"cp": SPLIT}, rank),
            global_batch_size=batch,
            mode="train",
            parts={"input": Shard(1, halo=halo)},
        )
        loader_epoch(ld)
        per_rank.append(ld.bytes_read / full)
    # throughput on an interior rank (the largest part), loader and raw alternating
    ld = mesh_dataloader(
        ArrayDataset({"input": source}),
        topology({"cp": SPLIT}, 1),
        global_batch_size=batch,
        mode="train",
        parts={"input": Shard(1, halo=halo)},
    )
    region = ld.parts["input"].region
    best_loader = best_raw = float("inf")
    for repeat in range(repeats + 1):  # the first round warms both mappings; order alternates (cache effects)
        plans = ld.sampler.plan()  # the epoch the loader is about to read
        for which in ("loader", "raw") if repeat % 2 else ("raw", "loader"):
            t = time.process_time()  # CPU time of this process: the machine may be shared with other jobs
            if which == "loader":
                rows = loader_epoch(ld)
            else:
                rows_raw = raw_epoch(raw_array, plans, region)
            elapsed = time.process_time() - t
            if repeat and which == "loader":
                best_loader = min(best_loader, elapsed)
            elif repeat:
                best_raw = min(best_raw, elapsed)
        assert rows == rows_raw
    return {
        "bytes_per_rank": per_rank,
        "loader_sps": rows / best_loader,
        "raw_sps": rows / best_raw,
        "throughput_ratio": best_raw / best_loader,
    }


def grid(root: Path, n: int, depth: int, size: int, halo: int) -> dict:
    """Bytes read per rank on a 2 x 2 grid (dims x, y) of ``1 x depth x size x size`` volumes, halo on (H, W).

    Zarr: one shard a sample, uncompressed inner chunks of ``depth x halo x halo``; npy for comparison. Each rank
    reads one epoch; bytes are over every rank reading whole samples.
    """
    import zarr

    rng = np.random.default_rng(1)
    data = rng.standard_normal((n, 1, depth, size, size), dtype=np.float32)
    np.save(root / "volume.npy", data)
    z = zarr.create_array(
        str(root / "volume.zarr"),
        shape=data.shape,
        dtype="float32",
        chunks=(1, 1, depth, halo, halo),
        shards=(1, 1, depth, size, size),
        compressors=None,
    )
    z[...] = data
    parts = {"volume": [Shard(2, halo=halo, dim="x"), Shard(3, halo=halo, dim="y")]}
    out = {}
    for kind, source in (("npy", str(root / "volume.npy")), ("zarr", z)):
        per_rank = []
        for rank in range(4):
            topo = topology({"x": 2, "y": 2}, rank, {"x": "split", "y": "split"})
            ld = mesh_dataloader({"volume": source}, topo, global_batch_size=4, mode="eval", parts=parts)
            loader_epoch(ld)
            per_rank.append(ld.bytes_read / data.nbytes)
        out[kind] = per_rank
    half = -(-size // 2)
    out["shell"] = ((half + halo) ** 2 - half**2) / size**2  # the halo cells of a corner tile, over a whole sample
    return out


def strategies(topo, npy: str, batch: int, halo: int, repeats: int) -> dict:
    out = {}
    for read in ("each", "broadcast", "scatter"):
        best, nbytes = float("inf"), 0
        for _ in range(repeats):
            ld = mesh_dataloader(
                ArrayDataset({"input": npy}),
                topo,
                global_batch_size=batch,
                mode="eval",
                parts={"input": Shard(1, halo=halo)},
                read=read,
            )
            torch.distributed.barrier()
            t = time.perf_counter()
            rows = loader_epoch(ld)
            best = min(best, time.perf_counter() - t)
            nbytes = ld.bytes_read
        out[read] = {"bytes": nbytes, "sps": rows / best}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--size", type=int, default=512, help="samples are 1 x size x size float32")
    p.add_argument("--halo", type=int, default=8, help="halo rows (also the Zarr inner chunk height)")
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--strategy-samples", type=int, default=64, help="samples read in the read-strategy run")
    p.add_argument("--no-strategies", action="store_true")
    p.add_argument("--grid-samples", type=int, default=32, help="3-D volumes for the 2 x 2 grid run")
    p.add_argument("--grid-size", type=int, default=96, help="volumes are 1 x depth x size x size float32")
    p.add_argument("--grid-depth", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import zarr

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        npy, zpath = make_data(Path(tmp), args.samples, args.size, args.halo)
        print(
            f"data: {args.samples} x 1x{args.size}x{args.size} float32 in npy and Zarr ({time.perf_counter() - t:.1f}s)"
        )
        halo_share = 2 * args.halo / args.size
        goal = 1 / SPLIT + halo_share + 0.02
        results = {}
        for kind, source, raw in (
            ("npy", str(npy), np.load(npy, mmap_mode="r")),
            ("zarr", zarr.open_array(str(zpath), mode="r"), zarr.open_array(str(zpath), mode="r")),
        ):
            r = measure(source, raw, args.samples, args.batch, args.halo, args.repeats)
            results[kind] = r
            ranks = " ".join(f"{b:.4f}" for b in r["bytes_per_rank"])
            print(
                f"{kind:5s} bytes/rank vs every-rank-reads-all: [{ranks}] (goal <= {goal:.4f}); "
                f"loader {r['loader_sps']:.0f} samples/s vs raw slicing {r['raw_sps']:.0f} samples/s "
                f"-> ratio {r['throughput_ratio']:.3f} (goal >= 0.9)"
            )
        g = grid(Path(tmp), args.grid_samples, args.grid_depth, args.grid_size, args.halo)
        grid_goal = 1 / 4 + g["shell"] + 0.02
        for kind in ("npy", "zarr"):
            ranks = " ".join(f"{b:.4f}" for b in g[kind])
            print(
                f"grid  2x2 of {args.grid_samples} x 1x{args.grid_depth}x{args.grid_size}x{args.grid_size}, halo "
                f"{args.halo}, {kind}: bytes/rank vs whole samples [{ranks}] (goal <= 1/4 + shell {g['shell']:.4f} "
                f"+ 0.02 = {grid_goal:.4f})"
            )
        if not args.no_strategies:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from meshwise.testing import run_distributed

            n = min(args.strategy_samples, args.samples)
            sub = Path(tmp) / "strategy.npy"
            np.save(sub, np.load(npy, mmap_mode="r")[:n])
            res = run_distributed(
                _strategies_entry,
                4,
                str(sub),
                args.batch,
                args.halo,
                args.repeats,
                mesh={"tp": 2, "cp": 2},
                timeout=300,
            )
            full = n * 4 * args.size * args.size
            for read in ("each", "broadcast", "scatter"):
                per = [r[read]["bytes"] / full for r in res]
                sps = min(r[read]["sps"] for r in res)
                print(
                    f"read={read:9s} tp=2 x cp=2, {n} samples: bytes/rank [{' '.join(f'{b:.3f}' for b in per)}] "
                    f"of one full copy; slowest rank {sps:.0f} samples/s"
                )
        npy_r = results["npy"]
        print(
            f"RESULT bytes_ratio={max(npy_r['bytes_per_rank']):.4f} throughput_ratio={npy_r['throughput_ratio']:.3f} "
            f"zarr_bytes_ratio={max(results['zarr']['bytes_per_rank']):.4f} "
            f"zarr_throughput_ratio={results['zarr']['throughput_ratio']:.3f} bytes_goal={goal:.4f} "
            f"grid_bytes_ratio={max(g['zarr']):.4f} grid_npy_bytes_ratio={max(g['npy']):.4f} "
            f"grid_bytes_goal={grid_goal:.4f}"
        )


def _strategies_entry(topo, npy, batch, halo, repeats):
    return strategies(topo, npy, batch, halo, repeats)


if __name__ == "__main__":
    main()
