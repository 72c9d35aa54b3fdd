"""Benchmark meshwise's map-style, streaming and packing sources against the plain-torch way of doing each.

Writes ``--mb`` MB (200 by default) of variable-length int64 token rows (64..1023 tokens, column ``input_ids``) as
an Arrow dataset (``Dataset.from_dict`` in chunks, ``save_to_disk``) to a temp folder and reloads it memory-mapped
with ``load_from_disk``. Then:

* ``arrow_rows_ratio``: rows/s of ``mesh_dataloader`` (one process, dp=1) over the dataset against a plain
  ``torch.utils.data.DataLoader`` over the same ``datasets.Dataset`` with the same collate (``pad_collate``), batch
  size and rows (the loader's own plan as the ``batch_sampler``); CPU time of this process, the two sides
  interleaved, median over ``--repeats`` (goal >= 0.9);
* ``rss_ratio_dp4``: resident memory added (``/proc/self/status``, before/after iterating; anonymous and
  file-backed printed apart) by the worst of 4 data ranks reading their quarter of an epoch, against one process
  at dp=1 reading the same number of rows; every rank and the baseline is a fresh process (a map-style
  ``read="each"`` loader runs no collective, so a topology without a process group is a real rank for it)
  (goal <= 1.1: no rank copies the table);
* ``stream_resume_exact``: local JSONL shards through ``load_dataset("json", streaming=True)`` and
  ``mesh_dataloader``; a run stopped after ``--stop-step`` steps and resumed from ``state_dict`` into a fresh
  loader yields exactly the batches of an unbroken run (1) or not (0);
* ``pack_tokens_ratio``: tokens/s of ``meshwise.data.pack`` against a plain Python loop that builds the same
  ``input_ids``/``position_ids``/``document_ids`` rows document by document (``--pack-docs`` documents, outputs
  checked equal) (goal >= 1.0);
* ``collate_speedup``: CPU time of the previous ``pad_collate`` (kept here as ``pad_collate_per_token``: a Python
  ``isinstance`` check per token, then one ``torch.as_tensor`` and one row copy per sample) over the current one
  (token lists of a field joined and typed in C, one ``np.fromiter``), on the same ``--steps`` batches of
  ``--batch`` rows read from the dataset, outputs checked equal, sides interleaved, medians (goal >= 3).

Quick run: ``--mb 20``. Final line:
``RESULT arrow_rows_ratio=… rss_ratio_dp4=… stream_resume_exact=… pack_tokens_ratio=… collate_speedup=…``.

    .venv/bin/python benchmarks/bench_sources.py [--mb 200] [--repeats 5] [--steps 60] [--batch 32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from meshwise.data import mesh_dataloader, pack, pad_collate
from meshwise.environment import Environment
from meshwise.layout import Layout
from meshwise.topology import Topology

DP = 4
CHUNK_ROWS = 4096  # rows built per from_dict call: the generator never holds the whole dataset as Python objects


def topology(mesh: dict, rank: int) -> Topology:
    """A real Topology for one rank of ``mesh`` without a process group (enough for read='each')."""
    world = int(np.prod(list(mesh.values())))
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    return Topology(Layout.resolve(mesh, world), env, torch.device("cpu"), "gloo", datetime.timedelta(seconds=60), None)


def make_arrow(root: Path, mb: float) -> Path:
    """``mb`` MB of int64 tokens in rows of 64..1023 tokens, saved with save_to_disk; returns the folder."""
    import datasets
    import pyarrow as pa

    rng = np.random.default_rng(0)
    target = int(mb * 1e6 / 8)  # tokens
    chunks, total = [], 0
    while total < target:
        lengths = rng.integers(64, 1024, CHUNK_ROWS)
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), target - total)) + 1]  # stop near --mb
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = pa.array(rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int64))
        chunks.append(datasets.Dataset.from_dict({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), values)}))
        total += int(offsets[-1])
    path = root / "tokens"
    datasets.concatenate_datasets(chunks).save_to_disk(str(path))
    return path


def rss_bytes() -> dict[str, int]:
    """Resident bytes of this process: in all, anonymous (a table copy would land here) and file-backed (the map)."""
    with open("/proc/self/status") as f:
        kb = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k.startswith("Rss")}
    return {"added": kb["RssAnon"] + kb["RssFile"] + kb["RssShmem"], "anon": kb["RssAnon"], "file": kb["RssFile"]}


def added(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


# ---------------------------------------------------------------- rows/s


def rows_per_s(ds, batch: int, steps: int, repeats: int) -> dict:
    """mesh_dataloader against a plain DataLoader on the same rows, interleaved, CPU-time medians."""
    ld = mesh_dataloader(ds, topology({"dp": 1}, 0), global_batch_size=batch, mode="train")
    mesh_t, plain_t = [], []
    for repeat in range(repeats + 1):  # repeat 0 warms both sides (page faults of the mapping, imports)
        ld.set_epoch(repeat)
        plan = [b.tolist() for b in ld.sampler.plan()[:steps]]  # the rows the loader is about to read
        plain = torch.utils.data.DataLoader(ds, batch_sampler=plan, collate_fn=pad_collate)
        for which in ("mesh", "plain") if repeat % 2 else ("plain", "mesh"):  # alternate: neither always goes first
            t = time.process_time()  # CPU time: the machine is shared, wall time would count other jobs
            rows = 0
            source = ld if which == "mesh" else plain
            for step, b in enumerate(source):
                rows += b["input_ids"].shape[0]
                if step + 1 == steps:
                    break
            elapsed = time.process_time() - t
            if repeat:
                (mesh_t if which == "mesh" else plain_t).append(elapsed)
    rows = steps * batch
    mesh_s, plain_s = statistics.median(mesh_t), statistics.median(plain_t)
    return {"mesh_rps": rows / mesh_s, "plain_rps": rows / plain_s, "ratio": plain_s / mesh_s}


# ---------------------------------------------------------------- RSS per rank


def rss_child(path: str, dp: int, rank: int, batch: int) -> None:
    """One fresh process: load the dataset mapped, read one epoch's share at data size ``dp``, print RSS added."""
    import datasets

    ds = datasets.load_from_disk(path)
    ld = mesh_dataloader(ds, topology({"dp": dp}, rank), global_batch_size=batch, mode="train")
    before = rss_bytes()
    rows = sum(b["input_ids"].shape[0] for b in ld)
    print(json.dumps({**added(before, rss_bytes()), "rows": rows, "steps": len(ld)}))


def mib(runs: list[dict], key: str = "added") -> str:
    return " ".join(f"{x[key] / 2**20:.1f}" for x in runs)


def rss_child_rows(path: str, rows: int, batch: int) -> None:
    """The baseline: one process at dp=1 reading ``rows`` rows (the same count as one rank at dp=4)."""
    import datasets

    ds = datasets.load_from_disk(path)
    ld = mesh_dataloader(ds, topology({"dp": 1}, 0), global_batch_size=batch, mode="train")
    before = rss_bytes()
    read = 0
    for b in ld:
        read += b["input_ids"].shape[0]
        if read >= rows:
            break
    print(json.dumps({**added(before, rss_bytes()), "rows": read}))


# ---------------------------------------------------------------- stream resume


def stream_resume(root: Path, stop: int) -> dict:
    """An unbroken streaming run against one stopped at ``stop`` and resumed from state_dict in a fresh loader."""
    from datasets import load_dataset

    rng = np.random.default_rng(2)
    files = []
    for shard in range(4):
        f = root / f"stream-{shard}.jsonl"
        with f.open("w") as out:
            for _ in range(120):
                doc = rng.integers(0, 50_000, int(rng.integers(8, 64))).tolist()
                out.write(json.dumps({"input_ids": doc}) + "\n")
        files.append(str(f))

    def loader():
        ds = load_dataset("json", data_files=files, split="train", streaming=True)
        return mesh_dataloader(ds, topology({"dp": 1}, 0), global_batch_size=8, mode="train")

    def rows(batch) -> list[list[int]]:
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        return [ids[i][mask[i]].tolist() for i in range(len(ids))]

    unbroken = [r for b in loader() for r in rows(b)]
    first = loader()
    head: list[list[int]] = []
    for step, b in enumerate(first):
        head += rows(b)
        if step + 1 == stop:
            state = first.state_dict()
            break
    second = loader()
    second.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint would store it
    resumed = head + [r for b in second for r in rows(b)]
    return {"exact": int(resumed == unbroken), "samples": len(unbroken), "stop": stop}


# ---------------------------------------------------------------- collate


def pad_collate_per_token(samples: list[dict]) -> dict[str, torch.Tensor]:
    """The baseline: pad_collate as it was, for dicts of 1-D int lists (a type check per token, a copy per row)."""
    out: dict[str, torch.Tensor] = {}
    lengths: dict[str, torch.Tensor] = {}
    for name in samples[0]:
        values = []
        for row in samples:
            v = row[name]
            assert isinstance(v, list) and all(isinstance(t, (int, float, np.number)) for t in v)
            values.append(torch.as_tensor(v))
        if len({tuple(v.shape) for v in values}) == 1:
            out[name] = torch.stack(values)
            continue
        width = max(len(v) for v in values)
        batch = torch.full((len(values), width), -100 if name == "labels" else 0, dtype=values[0].dtype)
        for i, v in enumerate(values):
            batch[i, : len(v)] = v.to(batch.dtype)
        out[name], lengths[name] = batch, torch.tensor([len(v) for v in values])
    key = "input_ids" if "input_ids" in lengths else next(iter(lengths), None)
    if key is not None:
        out["attention_mask"] = (torch.arange(out[key].shape[1]) < lengths[key][:, None]).to(torch.int64)
    return out


def collate_speed(ds, batch: int, steps: int, repeats: int) -> dict:
    """pad_collate against its per-token predecessor on the same row batches (Python lists from one Arrow take)."""
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(steps):
        columns = ds[rng.integers(0, len(ds), batch).tolist()]
        batches.append([{k: v[i] for k, v in columns.items()} for i in range(batch)])
    for rows in batches[:3]:
        a, b = pad_collate(rows), pad_collate_per_token(rows)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the two collates differ"
    ours, base = [], []
    for repeat in range(repeats + 1):
        for which in ("new", "old") if repeat % 2 else ("old", "new"):
            fn = pad_collate if which == "new" else pad_collate_per_token
            t = time.process_time()
            for rows in batches:
                fn(rows)
            elapsed = time.process_time() - t
            if repeat:
                (ours if which == "new" else base).append(elapsed)
    rows = steps * batch
    ours_s, base_s = statistics.median(ours), statistics.median(base)
    return {"new_rps": rows / ours_s, "old_rps": rows / base_s, "ratio": base_s / ours_s}


# ---------------------------------------------------------------- packing


def pack_python(docs: list[list[int]], seq_len: int) -> dict[str, np.ndarray]:
    """The baseline: the same rows built with a plain Python loop over documents."""
    tokens: list[int] = []
    positions: list[int] = []
    doc_ids: list[int] = []
    for d, doc in enumerate(docs):
        tokens.extend(doc)
        positions.extend(range(len(doc)))
        doc_ids.extend([d] * len(doc))
    n = len(tokens) // seq_len * seq_len
    return {
        "input_ids": np.array(tokens[:n], dtype=np.int64).reshape(-1, seq_len),
        "position_ids": np.array(positions[:n], dtype=np.int64).reshape(-1, seq_len),
        "document_ids": np.array(doc_ids[:n], dtype=np.int64).reshape(-1, seq_len),
    }


def packing(ds, docs: int, seq_len: int, repeats: int) -> dict:
    import datasets

    sub = datasets.Dataset(ds.data.slice(0, docs))  # the first docs rows, no indices mapping
    ours, base = [], []
    for repeat in range(repeats + 1):
        for which in ("pack", "python") if repeat % 2 else ("python", "pack"):
            t = time.process_time()
            if which == "pack":
                a = pack(sub, seq_len)
            else:
                b = pack_python(sub["input_ids"], seq_len)  # the read from Arrow is in both sides' time
            elapsed = time.process_time() - t
            if repeat:
                (ours if which == "pack" else base).append(elapsed)
    for k, v in b.items():
        assert np.array_equal(np.asarray(a.sources[k].array), v), f"pack and the Python loop differ in {k}"
    tokens = b["input_ids"].size
    ours_s, base_s = statistics.median(ours), statistics.median(base)
    return {"pack_tps": tokens / ours_s, "python_tps": tokens / base_s, "ratio": base_s / ours_s, "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=200, help="MB of int64 tokens in the Arrow dataset")
    p.add_argument("--batch", type=int, default=32, help="batch of the rows/s run; local batch of the RSS run")
    p.add_argument("--steps", type=int, default=60, help="batches timed per side and repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stop-step", type=int, default=7, help="the streaming run stops after this many steps")
    p.add_argument("--pack-docs", type=int, default=20_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rss-child", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--rss-base", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.rss_child:
        path, dp, rank, gbs = args.rss_child
        return rss_child(path, int(dp), int(rank), int(gbs))
    if args.rss_base:
        path, rows, batch = args.rss_base
        return rss_child_rows(path, int(rows), int(batch))
    import datasets

    datasets.disable_progress_bars()  # keep the output to the figures
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = make_arrow(Path(tmp), args.mb)
        ds = datasets.load_from_disk(str(path))
        nbytes = sum(f.stat().st_size for f in path.glob("*.arrow"))
        print(f"data: {len(ds)} rows, {nbytes / 1e6:.0f} MB of Arrow ({time.perf_counter() - t:.1f}s to write)")

        r = rows_per_s(ds, args.batch, args.steps, args.repeats)
        print(
            f"rows/s, batch {args.batch}, {args.steps} steps, median of {args.repeats}: mesh_dataloader "
            f"{r['mesh_rps']:.0f} vs torch DataLoader {r['plain_rps']:.0f} -> {r['ratio']:.3f} (goal >= 0.9)"
        )

        ranks = []
        for rank in range(DP):
            cmd = [sys.executable, __file__, "--rss-child", str(path), str(DP), str(rank), str(args.batch * DP)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            ranks.append(json.loads(out.strip().splitlines()[-1]))
        rows = ranks[0]["rows"]
        base = []
        for _ in range(2):  # the baseline twice: its median is the denominator
            cmd = [sys.executable, __file__, "--rss-base", str(path), str(rows), str(args.batch)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            base.append(json.loads(out.strip().splitlines()[-1]))
        base_added = statistics.median(b["added"] for b in base)
        rss_ratio = max(x["added"] for x in ranks) / base_added
        print(
            f"RSS added reading {rows} rows: dp={DP} ranks "
            f"[{mib(ranks)}] MiB vs one process at dp=1 "
            f"[{mib(base)}] MiB (dataset {nbytes / 2**20:.0f} MiB) -> "
            f"{rss_ratio:.3f} (goal <= 1.1); of which anonymous [{mib(ranks, 'anon')}] vs [{mib(base, 'anon')}] MiB, "
            f"file-backed (the shared map) [{mib(ranks, 'file')}] vs [{mib(base, 'file')}] MiB"
        )

        s = stream_resume(Path(tmp), args.stop_step)
        print(f"stream: {s['samples']} samples, stopped after step {s['stop']} and resumed: exact={s['exact']}")

        k = packing(ds, min(args.pack_docs, len(ds)), args.seq_len, args.repeats)
        print(
            f"pack {k['tokens']} tokens, seq_len {args.seq_len}: pack {k['pack_tps'] / 1e6:.1f} M tokens/s vs Python "
            f"loop {k['python_tps'] / 1e6:.1f} M tokens/s -> {k['ratio']:.2f} (goal >= 1.0)"
        )
        c = collate_speed(ds, args.batch, args.steps, args.repeats)
        print(
            f"pad_collate, {args.steps} batches of {args.batch} rows: {c['new_rps']:.0f} rows/s vs the per-token "
            f"version {c['old_rps']:.0f} rows/s -> {c['ratio']:.2f} (goal >= 3)"
        )
        print(
            f"RESULT arrow_rows_ratio={r['ratio']:.3f} rss_ratio_dp4={rss_ratio:.3f} "
            f"stream_resume_exact={s['exact']} pack_tokens_ratio={k['ratio']:.2f} collate_speedup={c['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
