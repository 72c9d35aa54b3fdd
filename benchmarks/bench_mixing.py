"""Benchmark meshwise's data mixtures (``meshwise.data.mix``): read rate, proportions and resume on other meshes.

Three array sources of ``--rows`` rows in all (50/30/20 %), each row ``--width`` int32 tokens, in ``.npy`` files
read through memory maps (as pretraining reads token files). Then:

* ``mix_rows_ratio``: rows/s of ``mesh_dataloader`` (one process, dp=1, global batch ``--batch``) over a mixture
  of the three sources at weights 0.5/0.3/0.2, against the same loader over one ``.npy`` file holding all the
  rows; an epoch each, the two sides interleaved, CPU time of this process, median over ``--repeats`` after a
  first pair that warms the page cache (goal >= 0.95). The mixture's side includes computing its order (the
  blending rule, run once an epoch from the cursor; numba compiles it where installed). The same ratio for
  64-token rows held in memory, where a read costs nothing and only the mixture's own work is left, is printed
  too (not in the RESULT line);
* ``mix_proportion_error``: the largest deviation, in samples, of any source's count from its declared share
  over every prefix of three epochs of the order, with weights changed on a resume mid-run and a linear
  Schedule (goal <= 1);
* ``mix_resume_exact``: a mixture stopped at dp=4 after ``--stop-step`` steps and resumed at dp=2 x tp=2 and
  at one process (each from the state dict, through JSON) yields exactly the global batches of an unbroken run
  (1) or not (0). Ranks are real ``Topology`` objects of each mesh without a process group (an array loader
  with ``read="each"`` runs no collective);
* ``stream_resize_exact``: a mixture of three streams (torch ``IterableDataset``s, ``exhausted="stop"``) read by
  4 gloo processes at dp=4 for ``--stop-step`` steps, then resumed from the state dict at dp=2 x tp=2 to the end
  of the pass: every sample of the pass exactly once over the data ranks, the rest in the global batches of an
  unbroken one-process pass (1) or not (0).

Final line: ``RESULT mix_rows_ratio=… mix_proportion_error=… mix_resume_exact=… stream_resize_exact=…``.

    .venv/bin/python benchmarks/bench_mixing.py [--rows 50000] [--width 2048] [--batch 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from meshwise.data import ArrayDataset, Schedule, mesh_dataloader, mix
from meshwise.environment import Environment
from meshwise.layout import Layout
from meshwise.topology import Topology

SHARES = {"web": 0.5, "code": 0.3, "math": 0.2}


def topology(mesh: dict, rank: int) -> Topology:
    """A real Topology for one rank of ``mesh`` without a process group (enough for read='each')."""
    world = int(np.prod(list(mesh.values())))
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    return Topology(Layout.resolve(mesh, world, None), env, torch.device("cpu"), "gloo", datetime.timedelta(30), None)


def sources(rows: int, width: int, folder: str | None = None) -> tuple[dict[str, ArrayDataset], ArrayDataset]:
    """The three sources and one source of the same rows: in memory, or ``.npy`` files in ``folder`` read through
    memory maps (as token files are read in pretraining)."""
    rng = np.random.default_rng(0)
    arrays = {}
    for s, (name, share) in enumerate(SHARES.items()):
        n = int(rows * share)
        tokens = rng.integers(0, 50000, size=(n, width), dtype=np.int32)
        tokens[:, 0] = s * 10_000_000 + np.arange(n)  # where each row comes from
        arrays[name] = tokens
    arrays["all"] = np.concatenate(list(arrays.values()))
    if folder is not None:
        for name, a in arrays.items():
            np.save(os.path.join(folder, f"{name}.npy"), a)
        arrays = {name: np.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r") for name in arrays}
    one = ArrayDataset({"input_ids": arrays.pop("all")})
    return {name: ArrayDataset({"input_ids": a}) for name, a in arrays.items()}, one


def epoch_cpu(loader) -> tuple[float, int]:
    start, rows = time.process_time(), 0
    for batch in loader:
        rows += len(batch["input_ids"])
    return time.process_time() - start, rows


def rows_ratio(args, srcs, one) -> tuple[float, float, float]:
    topo = topology({"dp": 1}, 0)
    mixed, single = [], []
    for _ in range(args.repeats + 1):  # the first pair warms the page cache and compiles the rule: not counted
        cpu, rows = epoch_cpu(mesh_dataloader(mix(srcs, SHARES, seed=1), topo, global_batch_size=args.batch))
        mixed.append(rows / cpu)
        cpu, rows = epoch_cpu(mesh_dataloader(one, topo, global_batch_size=args.batch, seed=1))
        single.append(rows / cpu)
    m, s = statistics.median(mixed[1:]), statistics.median(single[1:])
    return m / s, m, s


def deviation(order: list[int], start_counts: np.ndarray, weights: np.ndarray) -> float:
    """Largest |count - target| over every prefix of ``order`` (targets from ``start_counts`` on)."""
    counts = start_counts + np.cumsum(np.eye(weights.shape[1])[order], axis=0)
    target = start_counts + np.cumsum(weights, axis=0)
    return float(np.abs(counts - target).max())


def proportion_error(srcs_small) -> float:
    topo, names = topology({"dp": 1}, 0), list(SHARES)
    loader = mesh_dataloader(mix(srcs_small, SHARES, seed=1), topo, global_batch_size=16)
    order = [int(s) for _ in range(3) for b in loader for s in b["source"]]
    worst = deviation(order, np.zeros(3), np.tile(list(SHARES.values()), (len(order), 1)))
    state = loader.state_dict()  # new weights on resume: targets from each source's count at the resume
    new = {"web": 0.1, "code": 0.2, "math": 0.7}
    resumed = mesh_dataloader(mix(srcs_small, new, seed=1), topo, global_batch_size=16)
    resumed.load_state_dict(state)
    order = [int(s) for _ in range(2) for b in resumed for s in b["source"]]
    counts = np.array([state["counts"][n] for n in names], dtype=np.float64)
    worst = max(worst, deviation(order, counts, np.tile(list(new.values()), (len(order), 1))))
    total = sum(len(d) for d in srcs_small.values()) // 16 * 16
    linear = Schedule([(0, {"web": 1.0}), (total, {"math": 1.0})], interpolate="linear")
    scheduled = mesh_dataloader(mix(srcs_small, linear, seed=1), topo, global_batch_size=16)
    order = [int(s) for b in scheduled for s in b["source"]]
    step = np.array([[1 - j / total, 0, j / total] for j in range(len(order))])  # the weights of sample j
    return max(worst, deviation(order, np.zeros(3), step))


def global_batches(mesh: dict, srcs, steps: int, state=None) -> tuple[list[list[int]], dict]:
    """``steps`` global batches (rows' first token) read by every data rank of ``mesh``, and the state after."""
    tp, dp = mesh.get("tp", 1), mesh["dp"]
    per_rank, end = [], None
    for rank in range(0, dp * tp, tp):
        loader = mesh_dataloader(mix(srcs, SHARES, seed=1), topology(mesh, rank), global_batch_size=32)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        batches = (b for _ in range(100) for b in loader)
        per_rank.append([next(batches)["input_ids"][:, 0].tolist() for _ in range(steps)])
        end = loader.state_dict()
    return [sum((r[i] for r in per_rank), []) for i in range(steps)], end


def resume_exact(srcs_small, stop: int) -> int:
    unbroken, _ = global_batches({"dp": 1}, srcs_small, 3 * stop)
    first, state = global_batches({"dp": 4}, srcs_small, stop)
    ok = first == unbroken[:stop]
    for mesh in ({"dp": 2, "tp": 2}, {"dp": 1}):
        rest, _ = global_batches(mesh, srcs_small, 2 * stop, state)
        ok = ok and rest == unbroken[stop:]
    return int(ok)


class Stream(torch.utils.data.IterableDataset):
    """A user's stream: sample k of source s has id s * 10_000_000 + k."""

    def __init__(self, source: int, n: int) -> None:
        self.source, self.n = source, n

    def __iter__(self):
        for k in range(self.n):
            yield {"id": torch.tensor(self.source * 10_000_000 + k)}


def stream_mixture():
    streams = {name: Stream(s, int(600 * share)) for s, (name, share) in enumerate(SHARES.items())}
    return mix(streams, SHARES, exhausted="stop")


def _stream_ranks(stop: int) -> dict:
    """On each of 4 ranks: ids read at dp=4 for ``stop`` steps, then at dp=2 x tp=2 from the saved state."""
    import meshwise

    out = {}
    topo = meshwise.init({"dp": 4}, timeout=60)
    loader = mesh_dataloader(stream_mixture(), topo, global_batch_size=32)
    out["first"] = [int(i) for _, b in zip(range(stop), loader) for i in b["id"]]
    state = json.loads(json.dumps(loader.state_dict()))
    meshwise.shutdown()
    topo = meshwise.init({"dp": 2, "tp": 2}, timeout=60)
    loader = mesh_dataloader(stream_mixture(), topo, global_batch_size=32)
    loader.load_state_dict(state)
    out["rest"] = [[int(i) for i in b["id"]] for b in loader]
    meshwise.shutdown()
    return out


def stream_resize_exact(stop: int) -> int:
    from meshwise.testing import run_distributed

    ranks = run_distributed(_stream_ranks, 4, stop, timeout=300)
    one = mesh_dataloader(stream_mixture(), topology({"dp": 1}, 0), global_batch_size=32)
    unbroken = [[int(i) for i in b["id"]] for b in one]
    first = sorted(i for r in ranks for i in r["first"])
    rest = [sorted(a + b) for a, b in zip(ranks[0]["rest"], ranks[2]["rest"])]  # the two data ranks' halves
    seen = first + [i for batch in rest for i in batch]
    once = len(seen) == len(set(seen)) == sum(len(b) for b in unbroken)
    same = first == sorted(i for b in unbroken[:stop] for i in b) and rest == [sorted(b) for b in unbroken[stop:]]
    return int(once and same and ranks[1]["rest"] == ranks[0]["rest"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stop-step", type=int, default=7)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        ratio, mixed, single = rows_ratio(args, *sources(args.rows, args.width, folder))
    print(
        f"rows/s (CPU time), {args.width}-token rows from .npy files: mixture {mixed:,.0f}, one source "
        f"{single:,.0f}, ratio {ratio:.3f}"
    )
    small_ratio, mixed, single = rows_ratio(args, *sources(args.rows * 4, 64))
    print(
        f"rows/s (CPU time), 64-token rows in memory (no reading cost): mixture {mixed:,.0f}, one source "
        f"{single:,.0f}, ratio {small_ratio:.3f}"
    )
    small, _ = sources(1000, 4)
    error = proportion_error(small)
    print(f"largest deviation from the declared shares over every prefix: {error:.3f} samples")
    exact = resume_exact(small, args.stop_step)
    print(f"stopped at dp=4, resumed at dp=2 x tp=2 and at one process: {'exact' if exact else 'DIFFERENT'}")
    streams = stream_resize_exact(args.stop_step)
    print(f"stream mixture stopped at dp=4, resumed at dp=2 x tp=2: {'each sample once' if streams else 'WRONG'}")
    print(
        f"RESULT mix_rows_ratio={ratio:.3f} mix_proportion_error={error:.3f} mix_resume_exact={exact} "
        f"stream_resize_exact={streams}"
    )


if __name__ == "__main__":
    main()
