"""Checkpoint cost: Checkpointer.save against plain torch.save of the same per-rank state, async blocking, load time.

Runs 2 gloo ranks (FSDP2 over dp=2) on a 4-layer MLP with Adam. Each time is that of the slowest rank; the
ratios are medians over repeats of the ratio within one repeat. The baseline writes each rank's local shards of
model and optimizer with one ``torch.save`` to a new file per save (as a step-numbered checkpoint would).
Final line: ``RESULT save_ratio=... async_block_ratio=... load_s=...``.

    .venv/bin/python benchmarks/bench_checkpoint.py [--width 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def _quiet() -> None:
    """Start each timed operation with no dirty pages pending (the previous one's writeback would slow it)."""
    os.sync()
    dist.barrier()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _bench(topo, root: str, width: int, layers: int, repeats: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    import meshwise

    model = _model(width, layers)
    fully_shard(model, mesh=topo.submesh("dp"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, width)

    def train_step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    train_step()
    base = Path(root)
    sync = meshwise.Checkpointer(base / "sync", topo, keep_last=1, verbose=False)
    asyn = meshwise.Checkpointer(base / "async", topo, keep_last=1, async_save=True, verbose=False)
    plain_dir = base / "plain"
    plain_dir.mkdir(exist_ok=True)

    def local_state() -> dict:
        msd, osd = get_state_dict(model, opt)
        local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in msd.items()}
        ostate = {
            fqn: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in st.items()}
            for fqn, st in osd["state"].items()
        }
        return {"model": local, "optim": {"state": ostate, "param_groups": osd["param_groups"]}}

    times: dict[str, list[float]] = {
        "plain": [],
        "dcp": [],
        "sync": [],
        "async_call": [],
        "async_total": [],
        "load": [],
    }
    state_bytes = sum(t.numel() * t.element_size() for t in local_state()["model"].values()) * 3
    for rep in range(repeats):
        train_step()
        _quiet()
        t = time.perf_counter()
        torch.save(local_state(), plain_dir / f"step-{rep}-rank-{topo.rank}.pt")  # a new file, as a checkpoint
        dist.barrier()  # done when every rank's file is written, as for a checkpoint
        times["plain"].append(_slowest(time.perf_counter() - t))
        if rep:
            os.remove(plain_dir / f"step-{rep - 1}-rank-{topo.rank}.pt")  # keep one, as keep_last=1 does

        _quiet()
        t = time.perf_counter()  # DCP alone (same writer settings as a sync save): what meshwise builds on
        msd, osd = get_state_dict(model, opt)
        dcp.save(
            {"model": msd, "optimizer": osd},
            storage_writer=FileSystemWriter(str(base / f"dcp-{rep}"), sync_files=False),
        )
        dist.barrier()
        times["dcp"].append(_slowest(time.perf_counter() - t))

        _quiet()
        t = time.perf_counter()
        sync.save(rep + 1, model=model, optimizer=opt)
        times["sync"].append(_slowest(time.perf_counter() - t))  # the loop waits until here; fsync runs behind
        sync.latest_step()  # let rank 0 finish that fsync before the next measurement

        _quiet()
        t = time.perf_counter()
        asyn.save(rep + 1, model=model, optimizer=opt)
        times["async_call"].append(_slowest(time.perf_counter() - t))  # how long training is blocked
        asyn.wait()
        times["async_total"].append(_slowest(time.perf_counter() - t))

        fresh = _model(width, layers)
        fully_shard(fresh, mesh=topo.submesh("dp"))
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
        _quiet()
        t = time.perf_counter()
        sync.load(model=fresh, optimizer=fresh_opt)
        times["load"].append(_slowest(time.perf_counter() - t))
    asyn.close()
    return {"times": times, "state_bytes": state_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nprocs", type=int, default=2)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from meshwise.testing import run_distributed

    root = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        out = run_distributed(
            _bench, a.nprocs, root, a.width, a.layers, a.repeats, mesh={"dp": a.nprocs}, timeout=600, pg_timeout=120
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    mib = out["state_bytes"] / 2**20
    load = os.getloadavg()[0]
    print(f"{a.nprocs} ranks, {a.layers} x Linear({a.width}) + Adam: {mib:.1f} MiB/rank; load average {load:.1f}")
    for k, v in med.items():
        print(f"  {k:12s} median {v * 1000:8.1f} ms   ({', '.join(f'{x * 1000:.0f}' for x in out['times'][k])})")
    # ratios of the same repeat, then their median: the load of a shared machine drifts between repeats
    t = out["times"]
    save_ratio = statistics.median(s / p for s, p in zip(t["sync"], t["plain"]))
    block_ratio = statistics.median(a / s for a, s in zip(t["async_call"], t["sync"]))
    dcp_ratio = statistics.median(d / p for d, p in zip(t["dcp"], t["plain"]))
    print(f"DCP alone / torch.save: {dcp_ratio:.2f}; meshwise sync save / DCP alone: {med['sync'] / med['dcp']:.2f}")
    print(
        f"RESULT save_ratio={save_ratio:.2f} async_block_ratio={block_ratio:.2f} load_s={med['load']:.3f} "
        f"dcp_ratio={dcp_ratio:.2f}"
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
