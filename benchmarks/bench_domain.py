"""Domain parallelism: bytes read per rank and step time, meshwise tiles vs every rank reading whole samples.

    .venv/bin/python benchmarks/bench_domain.py [--domain 2] [--samples 40] [--size 256]

Both runs train the same sharded HeatNet on the same heat-diffusion Zarr data in one launch. ``tiles``: the loader
reads only each rank's columns plus the input halo (``Shard(2, halo=1)``). ``whole``: every rank reads whole
samples and cuts its tile in memory. Goal: bytes per rank <= (1/domain + halo share) x whole + 2%.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "domain"


def _example(name: str, file: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _rank(topo, data: str, batch: int, halo: int, width: int) -> dict:
    import torch
    from ignite.engine import Events

    import meshwise
    from meshwise.data import Replicate, Shard, chunk_bounds, mesh_dataloader

    train = _example("domain_train", "train.py")
    model_mod = _example("domain_model", "model.py")
    ds = train.open_dataset(data, "train")
    n_cols = ds.sample_shape("input")[-1]
    i, k = topo.coordinate("domain"), topo.size("domain")
    lo, hi = chunk_bounds(n_cols, k, i)
    out = {}
    for mode in ("whole", "tiles") * 3:  # three times each, interleaved: the machine's load drifts
        torch.manual_seed(0)
        net = model_mod.HeatNet(model_mod.HeatNetConfig(width=width, depth=4, halo=halo))
        net.shard(topo, "domain", axis=-1, input_halo=halo)
        net = meshwise.parallelize(net, topo, dp="replicate")
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        if mode == "tiles":
            parts = {"input": Shard(2, halo=halo), "target": Shard(2)}
            prepare = None
        else:
            parts = {"input": Replicate(), "target": Replicate()}
            rlo, rhi = max(0, lo - halo), min(n_cols, hi + halo)

            def prepare(b, rlo=rlo, rhi=rhi):
                return {**b, "input": b["input"][..., rlo:rhi], "target": b["target"][..., lo:hi]}

        loader = mesh_dataloader(ds, topo, global_batch_size=batch, parts=parts)
        trainer = meshwise.create_trainer(net, opt, train.mse, topo, loss_weight="tokens", prepare=prepare)
        stamps, fetch = [], []
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e, s=stamps: s.append(time.perf_counter()))
        trainer.add_event_handler(Events.GET_BATCH_STARTED, lambda e, s=fetch: s.append(-time.perf_counter()))
        trainer.add_event_handler(
            Events.GET_BATCH_COMPLETED, lambda e, s=fetch: s.append(s.pop() + time.perf_counter())
        )
        trainer.run(loader, max_epochs=1)
        steps = len(stamps)
        entry = out.setdefault(
            mode, {"bytes_per_step": loader.bytes_read / steps, "times": [], "fetch": [], "loss": []}
        )
        entry["times"] += [b - a for a, b in zip(stamps, stamps[1:])]  # data loading included, first step not
        entry["fetch"] += fetch[1:]
        entry["loss"].append(trainer.state.output)
    # The ideal: each field's share of columns read (tile + input halo), weighted by the field's bytes
    rlo, rhi = max(0, lo - halo), min(n_cols, hi + halo)
    fields = {n: ds.sources[n] for n in ("input", "target")}
    full = sum(s.dtype.itemsize * int(torch.tensor(s.shape[1:]).prod()) for s in fields.values())
    ideal_in = fields["input"].dtype.itemsize * int(torch.tensor(fields["input"].shape[1:]).prod()) * (rhi - rlo)
    ideal_t = fields["target"].dtype.itemsize * int(torch.tensor(fields["target"].shape[1:]).prod()) * (hi - lo)
    out["ideal_fraction"] = (ideal_in + ideal_t) / n_cols / full
    out["tile_fraction"] = (hi - lo) / n_cols
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", type=int, default=2)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="global batch size")
    parser.add_argument("--halo", type=int, default=1)
    parser.add_argument("--width", type=int, default=8, help="conv channels")
    parser.add_argument("--chunk-width", type=int, default=4, help="Zarr chunk width (columns)")
    args = parser.parse_args()

    from meshwise.testing import run_distributed

    generate = _example("domain_generate", "generate.py")
    with tempfile.TemporaryDirectory() as tmp:
        inputs, targets = generate.generate(args.samples, args.size, steps=8, seed=0)
        generate.write(Path(tmp), "train", inputs, targets, args.chunk_width, meta={"size": args.size})
        start = time.perf_counter()
        results = run_distributed(
            _rank,
            args.domain,
            tmp,
            args.batch,
            args.halo,
            args.width,
            mesh={"dp": -1, "domain": args.domain},
            timeout=600,
            pg_timeout=120,
        )
        wall = time.perf_counter() - start
    whole = statistics.mean(r["whole"]["bytes_per_step"] for r in results)
    tiles = statistics.mean(r["tiles"]["bytes_per_step"] for r in results)
    ideal = statistics.mean(r["ideal_fraction"] for r in results)
    t_whole = statistics.median([t for r in results for t in r["whole"]["times"]])
    t_tiles = statistics.median([t for r in results for t in r["tiles"]["times"]])
    f_whole = statistics.median([t for r in results for t in r["whole"]["fetch"]])
    f_tiles = statistics.median([t for r in results for t in r["tiles"]["fetch"]])
    bytes_ratio, time_ratio = tiles / whole, t_tiles / t_whole
    goal = ideal + 0.02
    print(
        f"mesh dp=1 x domain={args.domain}, {args.samples} samples {args.size}x{args.size}, global batch {args.batch}, "
        f"halo {args.halo}, Zarr chunks of {args.chunk_width} columns; launch {wall:.1f}s"
    )
    print(f"bytes per rank per step: whole samples {whole / 2**20:.2f} MiB, tiles {tiles / 2**20:.3f} MiB")
    print(
        f"tile + halo share of the columns (bytes-weighted): {ideal:.4f}; goal <= {goal:.4f}: "
        f"{'met' if bytes_ratio <= goal else 'MISSED'}"
    )
    print(f"median step time (loading included): whole {t_whole * 1e3:.0f} ms, tiles {t_tiles * 1e3:.0f} ms")
    print(f"median batch fetch time: whole {f_whole * 1e3:.1f} ms, tiles {f_tiles * 1e3:.1f} ms")
    losses = {m: sorted({round(x, 9) for r in results for x in r[m]["loss"]}) for m in ("whole", "tiles")}
    print(f"final loss of each run (same data, same model: one value each, the same): {losses}")
    fetch_ratio = f_tiles / f_whole
    print(f"RESULT bytes_ratio={bytes_ratio:.4f} step_time_ratio={time_ratio:.3f} fetch_time_ratio={fetch_ratio:.3f}")


if __name__ == "__main__":
    main()
