"""Checkpoint cost: Checkpointer.save against plain torch.save of the same per-rank state, async blocking, load time.

Runs 2 gloo ranks (FSDP2 over dp=2) on a 4-layer MLP with Adam, sized by ``--mib``: the model + optimizer state
held by each rank (parameters and Adam's two moments; 128 MiB by default, ~45 s; ``--mib 512`` takes ~3 min). The
baseline writes each rank's local shards of model and optimizer with one ``torch.save`` to a new file per save (as a
step-numbered checkpoint would). Both sides write the same tensors (the bytes each wrote are printed) to files
under the same folder (``--dir``, default the system temp folder), into the page cache: neither side's timed part
fsyncs (meshwise fsyncs in a thread of rank 0 after the call returns), and every timed operation starts after an
``os.sync()`` so no earlier writeback is pending. Each time is that of the slowest rank; one untimed warm-up
repeat first (the async stager allocates its buffers then); the ratios are medians over repeats of the ratio
within one repeat. After an async ``save()`` returns, the next training step (zero_grad, forward, backward,
``opt.step()``, whose pre-hook waits for the background staging copy) runs at once, and is compared with a step
without a pending save, timed just before in the same repeat. ``async_block`` = ``async_call`` +
``hook_wait`` (the time the next ``opt.step()`` spent in the checkpointer's pre-hook, timed by a pre-hook of the
bench's own registered after it); ``step_extra`` is all that ``opt.step()`` took beyond the baseline step's, and
``async_loop`` = ``async_call`` + ``next_extra`` (what the whole training step took beyond the baseline: also the
background write competing for the cores). The same for ``async_save="stage-first"`` (``first_*``: everything
staged before ``save()`` returns). A second baseline is the same ``torch.save``
without the zip CRC32 (``torch.load`` never checks it; meshwise's shard files skip it): ``nocrc_ratio`` is the
sync save against that one. One more, untimed, sync save counts the collectives a save runs. Final line:
``RESULT save_ratio=... async_block_ratio=... async_call_ratio=... async_loop_ratio=... stage_first_block_ratio=...
stage_first_loop_ratio=... load_s=... dcp_ratio=... nocrc_ratio=... sync_collectives=...``.

    .venv/bin/python benchmarks/bench_checkpoint.py [--mib 128] [--repeats 5] [--warmup 1] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

# the torch.distributed calls DCP and meshwise make (DCP calls them as attributes of torch.distributed)
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
)


def _width_for(mib: float, layers: int, nprocs: int) -> int:
    """The width (a multiple of 64) whose model + Adam state per rank is closest to ``mib`` MiB (fp32, FSDP2)."""
    # per rank: 3 copies (param, exp_avg, exp_avg_sq) of 4-byte floats of 1/nprocs of layers * (w*w + w) values
    w = math.sqrt(mib * 2**20 * nprocs / (12 * layers))
    return max(64, int(round(w / 64)) * 64)


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


def _total(values: float) -> float:
    t = torch.tensor([values], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _bench(topo, root: str, width: int, layers: int, batch: int, repeats: int, warmup: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    import meshwise

    model = _model(width, layers)
    fully_shard(model, mesh=topo.submesh("dp"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    hooked: list[float] = []  # when the step pre-hooks before the bench's own had run (the checkpointer's wait)

    def train_step() -> tuple[float, float, float]:
        """One step; the seconds of zero_grad + forward + backward, of ``opt.step()``, and of its pre-hooks."""
        hooked.clear()
        t = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        return t1 - t, t2 - t1, (hooked[0] - t1) if hooked else 0.0

    train_step()
    base = Path(root)
    sync = meshwise.Checkpointer(base / "sync", topo, keep_last=1, verbose=False)
    asyn = meshwise.Checkpointer(base / "async", topo, keep_last=1, async_save=True, verbose=False)
    first = meshwise.Checkpointer(base / "first", topo, keep_last=1, async_save="stage-first", verbose=False)
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

    names = ("plain", "plain_nocrc", "dcp", "sync", "async_call", "hook_wait", "async_block", "next_extra")
    names += ("async_loop", "async_total", "first_call", "first_hook_wait", "first_block", "first_next_extra")
    names += ("first_loop", "first_total", "step_extra", "step")
    names += ("step", "load")
    times: dict[str, list[float]] = {k: [] for k in names}
    written: dict[str, int] = {}  # bytes on disk of the last repeat, all ranks together
    st = local_state()
    state_bytes = sum(
        t.numel() * t.element_size()
        for part in (st["model"], *st["optim"]["state"].values())
        for t in part.values()
        if isinstance(t, torch.Tensor)
    )
    del st

    def record(rep: int, name: str, seconds: float) -> None:
        if rep >= warmup:
            times[name].append(seconds)

    def settle() -> None:
        """No deletion of an older checkpoint left running (meshwise prunes in background threads)."""
        for ckpt in (sync, asyn, first):
            ckpt.folder.join_deletions()

    def plain_save(rep: int) -> None:
        _quiet()
        t = time.perf_counter()
        torch.save(local_state(), plain_dir / f"step-{rep}-rank-{topo.rank}.pt")  # a new file, as a checkpoint
        dist.barrier()  # done when every rank's file is written, as for a checkpoint
        record(rep, "plain", _slowest(time.perf_counter() - t))
        written["plain"] = int(_total(_size(plain_dir / f"step-{rep}-rank-{topo.rank}.pt")))
        if rep:
            os.remove(plain_dir / f"step-{rep - 1}-rank-{topo.rank}.pt")  # keep one, as keep_last=1 does

    def plain_nocrc_save(rep: int) -> None:
        """The same torch.save without the zip CRC32 that torch.load never checks (meshwise's shards skip it)."""
        _quiet()
        torch.serialization.set_crc32_options(False)
        try:
            t = time.perf_counter()
            torch.save(local_state(), plain_dir / f"nocrc-{rep}-rank-{topo.rank}.pt")
            dist.barrier()
            record(rep, "plain_nocrc", _slowest(time.perf_counter() - t))
        finally:
            torch.serialization.set_crc32_options(True)
        if rep:
            os.remove(plain_dir / f"nocrc-{rep - 1}-rank-{topo.rank}.pt")

    def dcp_save(rep: int) -> None:
        _quiet()
        t = time.perf_counter()  # DCP alone (same writer settings as a sync save): what meshwise builds on
        msd, osd = get_state_dict(model, opt)
        dcp.save(
            {"model": msd, "optimizer": osd},
            storage_writer=FileSystemWriter(str(base / f"dcp-{rep}"), sync_files=False),
        )
        dist.barrier()
        record(rep, "dcp", _slowest(time.perf_counter() - t))
        if topo.rank == 0:
            written["dcp"] = _size(base / f"dcp-{rep}")
            if rep:
                shutil.rmtree(base / f"dcp-{rep - 1}")  # keep one, as the others do
        dist.barrier()

    def sync_save(rep: int) -> None:
        _quiet()
        t = time.perf_counter()
        sync.save(rep + 1, model=model, optimizer=opt)
        record(rep, "sync", _slowest(time.perf_counter() - t))  # the loop waits until here; fsync runs behind
        sync.latest_step()  # let rank 0 finish that fsync (and prune) before the next measurement
        settle()

    def timed_async(rep: int, ckpt, at: int) -> None:
        _quiet()
        base = train_step()  # a step without a pending save, the same moment's baseline
        _quiet()
        t = time.perf_counter()
        ckpt.save(rep + 1, model=model, optimizer=opt)
        call = time.perf_counter() - t
        if at == 4 and not bench_hook:  # after the checkpointer's own hook, which that save registered
            bench_hook.append(opt.register_step_pre_hook(lambda *_: hooked.append(time.perf_counter())))
        after = train_step()  # at once: its opt.step() waits for the staging copy (and the write runs beside it)
        extra, wait = sum(after[:2]) - sum(base[:2]), after[2]
        # blocked: the call plus the wait of the next opt.step()'s pre-hook for the staging copy; loop: the call
        # plus what the whole next training step took beyond one without a pending save
        ckpt.wait()
        total = time.perf_counter() - t
        values = (call, wait, call + wait, extra, call + extra, total)
        for name, value in zip(names[at : at + 6], values):
            record(rep, name, _slowest(value))
        if at == 4:
            record(rep, "step", _slowest(sum(base[:2])))
            record(rep, "step_extra", _slowest(after[1] - base[1]))  # all of opt.step()'s extra, hook included
        settle()

    bench_hook: list = []

    def async_save(rep: int) -> None:
        timed_async(rep, asyn, 4)

    def stage_first_save(rep: int) -> None:
        """The blocking staging (async_save="stage-first"): everything copied before save() returns."""
        timed_async(rep, first, 10)

    saves = [plain_save, plain_nocrc_save, dcp_save, sync_save, async_save, stage_first_save]
    fresh = fresh_opt = None
    for rep in range(warmup + repeats):
        train_step()
        turn = rep % len(saves)
        for op in saves[turn:] + saves[:turn]:  # each save first in turn: no order effect
            op(rep)
        del fresh, fresh_opt
        fresh = _model(width, layers)
        fully_shard(fresh, mesh=topo.submesh("dp"))
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
        _quiet()
        t = time.perf_counter()
        sync.load(model=fresh, optimizer=fresh_opt)  # from the page cache: the files were just written
        record(rep, "load", _slowest(time.perf_counter() - t))
    from meshwise.testing import CollectiveCounter

    with CollectiveCounter(COLLECTIVES) as counter:  # untimed: how many collectives one sync save runs
        sync.save(warmup + repeats + 1, model=model, optimizer=opt)
    sync.latest_step()
    for handle in bench_hook:
        handle.remove()
    asyn.close()
    first.close()
    sync.close()
    if topo.rank == 0:
        written["sync"] = _size(sync.step_path(warmup + repeats + 1))  # the counted save: a replayed one
        written["async"] = _size(asyn.step_path(warmup + repeats))
    return {
        "times": times,
        "state_bytes": _total(state_bytes) / topo.world_size,
        "written": written,
        "collectives": counter.calls,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=128, help="model + Adam state per rank, MiB (sets the width)")
    p.add_argument("--width", type=int, default=None, help="the MLP's width, instead of --mib")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="rows of the training step's input")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--dir", default=None, help="folder for the checkpoints (default: the system temp folder)")
    a = p.parse_args()
    width = a.width or _width_for(a.mib, a.layers, a.nprocs)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from meshwise.testing import run_distributed

    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=a.dir)
    started = time.perf_counter()
    try:
        out = run_distributed(
            _bench,
            a.nprocs,
            root,
            width,
            a.layers,
            a.batch,
            a.repeats,
            a.warmup,
            mesh={"dp": a.nprocs},
            timeout=1800,
            pg_timeout=600,
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - started
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    mib = out["state_bytes"] / 2**20
    load = os.getloadavg()[0]
    print(
        f"{a.nprocs} ranks, {a.layers} x Linear({width}) + Adam: {mib:.1f} MiB/rank; {a.repeats} repeats "
        f"(+{a.warmup} warm-up) in {wall:.0f} s; load average {load:.1f}"
    )
    print("  written, all ranks: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in out["written"].items()))
    for k, v in med.items():
        print(f"  {k:12s} median {v * 1000:8.1f} ms   ({', '.join(f'{x * 1000:.0f}' for x in out['times'][k])})")
    # ratios of the same repeat, then their median: the load of a shared machine drifts between repeats
    t = out["times"]
    save_ratio = statistics.median(s / p for s, p in zip(t["sync"], t["plain"]))

    def ratio(name: str) -> float:
        return statistics.median(a / s for a, s in zip(t[name], t["sync"]))

    block_ratio, call_ratio, loop_ratio = ratio("async_block"), ratio("async_call"), ratio("async_loop")
    first_ratio, first_loop_ratio = ratio("first_block"), ratio("first_loop")
    dcp_ratio = statistics.median(d / p for d, p in zip(t["dcp"], t["plain"]))
    nocrc_ratio = statistics.median(s / p for s, p in zip(t["sync"], t["plain_nocrc"]))
    print(f"DCP alone / torch.save: {dcp_ratio:.2f}; meshwise sync save / DCP alone: {med['sync'] / med['dcp']:.2f}")
    print(f"meshwise sync save / torch.save without CRC32: {nocrc_ratio:.2f}")
    print(f"collectives of one sync save: {', '.join(out['collectives'])}")
    print(
        f"RESULT save_ratio={save_ratio:.2f} async_block_ratio={block_ratio:.2f} async_call_ratio={call_ratio:.2f} "
        f"async_loop_ratio={loop_ratio:.2f} stage_first_block_ratio={first_ratio:.2f} "
        f"stage_first_loop_ratio={first_loop_ratio:.2f} "
        f"load_s={med['load']:.3f} "
        f"dcp_ratio={dcp_ratio:.2f} nocrc_ratio={nocrc_ratio:.2f} sync_collectives={len(out['collectives'])}"
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
