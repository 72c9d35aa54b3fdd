"""Pretrain the example GPT on a Hugging Face dataset: JSON lines -> bytes -> packed rows -> dp x tp training.

The script makes its own corpus (no download): the paragraphs of the Python standard library's ``json``
package, written as a few JSON-lines shard files into the run folder. ``datasets.load_dataset("json", ...)``
reads them, each paragraph is tokenised to its bytes (``input_ids`` of variable length), and
``meshwise.data.pack`` concatenates the documents into fixed rows of ``block_size + 1`` tokens (input = the
first ``block_size``, target = the next). The GPT of examples/gpt/model.py trains with
``meshwise.create_trainer`` under its tensor-parallel plan, and a ``Checkpointer`` saves the loader's cursor
with the model, so a run stopped mid-epoch resumes with exactly the next batch.

    meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 examples/hf_pretrain/train.py --steps 20
    # simulate a kill after 8 steps, then resume to 20 in the same run folder:
    meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 examples/hf_pretrain/train.py --steps 20 --stop-at 8
    meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 examples/hf_pretrain/train.py --steps 20
    # a mixture of two sources whose weights change from 80/20 to 50/50 over the run (meshwise.data.mix):
    meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 examples/hf_pretrain/train.py --steps 20 --mix

One process works too: ``python examples/hf_pretrain/train.py --mesh dp=1``. Rank 0 prints one line per
step, ``step <i> loss <float repr>``, and a last line ``done steps <a>-<b> loss <float repr>``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import sysconfig
from pathlib import Path

import torch
from ignite.engine import Events

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))  # the example GPT and its TP plan
from model import GPT, Block, GPTConfig, check_tp_degree, token_loss, tp_plan  # noqa: E402

import meshwise  # noqa: E402
from meshwise.data import Schedule, mesh_dataloader, mix, pack  # noqa: E402

SHARDS = 4  # shard files: a multiple of the data size lets a streaming reader give each rank whole files


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default=None, help="mesh, e.g. dp=2,tp=2 (default: meshwise run --mesh)")
    p.add_argument("--run-dir", default="runs/hf_pretrain", help="data shards, HF cache and checkpoints go here")
    p.add_argument("--steps", type=int, default=20, help="train to this global step (resuming if checkpointed)")
    p.add_argument("--stop-at", type=int, default=0, help="stop (and checkpoint) after this step: a simulated kill")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (rows per step)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--double", action="store_true", help="float64 model (resume checks to 1e-12)")
    p.add_argument(
        "--streaming",
        action="store_true",
        help="stream the shards (load_dataset(streaming=True)): one padded document a row, no packing",
    )
    p.add_argument(
        "--mix",
        action="store_true",
        help="train on a mixture of two sources (stdlib json and email), weights scheduled from 80/20 to 50/50",
    )
    return p.parse_args(argv)


# --------------------------------------------------------------------------- the corpus, as a HF dataset


def write_corpus(data_dir: Path, package: str = "json") -> list[str]:
    """Paragraphs of a stdlib package (``json``) as JSON lines, dealt round-robin into SHARDS files."""
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / package).glob("*.py"))
    paragraphs = [p for f in files for p in f.read_text().split("\n\n") if p.strip()]
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = [data_dir / f"part-{i}.jsonl" for i in range(SHARDS)]
    for i, path in enumerate(paths):
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in paragraphs[i::SHARDS]))
    return [str(p) for p in paths]


def to_bytes(batch: dict) -> dict:
    """Byte-level tokens: every document becomes the list of its UTF-8 bytes (vocab 256)."""
    return {"input_ids": [list(t.encode()) for t in batch["text"]]}


def load_corpus(run_dir: Path, topo: meshwise.Topology, streaming: bool = False, package: str = "json"):
    """The tokenised ``datasets.Dataset`` (or ``IterableDataset`` when streaming). Rank 0 writes the shards and
    fills the HF cache first, so the other ranks only read the cache instead of racing to write it."""
    import datasets

    datasets.disable_progress_bars()  # per-rank bars would drown the step lines

    data = run_dir / ("data" if package == "json" else f"data-{package}")
    paths = [str(data / f"part-{i}.jsonl") for i in range(SHARDS)]
    ds = None
    for turn in (True, False):  # the leader's turn, then everyone else's
        if topo.is_leader() == turn:
            if turn:
                write_corpus(data, package)
            cache = str(run_dir / "hf_cache")
            ds = datasets.load_dataset("json", data_files=paths, split="train", cache_dir=cache, streaming=streaming)
            ds = ds.map(to_bytes, batched=True, remove_columns=["text"])
        topo.barrier()
    return ds


def to_shifted(sample: dict, block_size: int) -> dict:
    """Streaming: one document a row, cut to block_size + 1 bytes; labels are the next bytes (already shifted,
    as loss_weight="labels" wants), and pad_collate pads them with -100 so padding is never scored."""
    ids = sample["input_ids"][: block_size + 1]
    return {"input_ids": ids[:-1], "labels": ids[1:]}


def as_lm_batch(batch: dict) -> dict:
    """A packed row of block_size + 1 tokens: the input is its first block_size, the target the next."""
    ids = batch["input_ids"]
    if "labels" in batch:  # streaming: the rows are already shifted and padded
        return {**batch, "input": ids, "target": batch["labels"]}
    return {**batch, "input": ids[:, :-1], "target": ids[:, 1:]}


def loss_context(tp: int) -> contextlib.AbstractContextManager:
    """The vocab-sharded head's loss (and its backward) runs under ``loss_parallel()``."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if tp > 1 else contextlib.nullcontext()


# --------------------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    topo = meshwise.init(args.mesh)
    torch.manual_seed(args.seed)  # the same full weights on every rank before sharding
    if args.double:
        torch.set_default_dtype(torch.float64)
    run_dir = Path(args.run_dir)
    tp = topo.size(topo.replica_dims) if topo.replica_dims else 1

    # ---- data: documents of any length, packed into rows of exactly block_size + 1 tokens; or, streaming, one
    # document a row padded to the batch's longest (pad_collate, the stream loader's default collate)
    docs = load_corpus(run_dir, topo, args.streaming)
    if args.streaming:
        docs = docs.filter(lambda d: len(d["input_ids"]) >= 2)  # a label needs a next byte
        rows = docs.map(to_shifted, fn_kwargs={"block_size": args.block_size}, remove_columns=["input_ids"])
    else:
        rows = pack(docs, seq_len=args.block_size + 1)
    if args.mix:  # two sources, from 80/20 at step 0 to 50/50 at the last step
        email = pack(load_corpus(run_dir, topo, package="email"), seq_len=args.block_size + 1)
        weights = Schedule(
            [(0, {"json": 0.8, "email": 0.2}), (args.steps, {"json": 0.5, "email": 0.5})],
            unit="steps",
            interpolate="linear",
        )
        rows = mix({"json": rows, "email": email}, weights, seed=args.seed)
    loader = mesh_dataloader(rows, topo, global_batch_size=args.batch_size, mode="train", seed=args.seed)

    # ---- model: the example GPT, sharded by its TP plan over tp and FSDP2 over dp
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model)
    check_tp_degree(cfg, tp)
    model = meshwise.parallelize(GPT(cfg), topo, tp_plan=tp_plan if tp > 1 else None, dp="fsdp", fsdp_units=Block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    trainer = meshwise.create_trainer(
        model,
        optimizer,
        token_loss,
        topo,
        # the mean over every scored target token of the global batch, as one process (padding is -100)
        loss_weight="labels" if args.streaming else "tokens",
        step_context=lambda: loss_context(tp),
        prepare=as_lm_batch,
    )

    # ---- resume: the loader is in the checkpoint, so the next batch is the one after the last trained
    checkpointer = meshwise.Checkpointer(run_dir / "checkpoints", topo)
    state = {"model": model, "optimizer": optimizer, "engine": trainer, "loader": loader}
    start = 0
    if checkpointer.latest_step() is not None:
        checkpointer.load("latest", **state)
        start = trainer.state.iteration
    stop = min(args.steps, args.stop_at) if args.stop_at else args.steps
    if topo.is_leader():
        what = "streamed documents" if args.streaming else f"{len(rows)} packed rows of {args.block_size + 1}"
        print(f"{what}; steps {start}-{stop}", flush=True)

    # ---- the loop: trainer.run drives the steps; each one prints its global-batch loss on rank 0
    losses: list[float] = []

    @trainer.on(Events.ITERATION_COMPLETED)
    def _log(engine) -> None:
        losses.append(float(engine.state.output))
        if topo.is_leader():
            print(f"step {engine.state.iteration} loss {losses[-1]!r}", flush=True)

    if not args.streaming:
        # a full pass moves the cursor on by itself; the epoch number keeps the shuffle of the next pass fresh
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: loader.set_epoch(e.state.epoch))
    # A stream has no length: ignite learns it when the first pass ends, and meshwise's trainer resumes a run saved
    # before that too (create_trainer's MeshEngine), so both kinds of source take the same plain run().
    if stop > start:
        trainer.run(loader, max_iters=stop)
        checkpointer.save(trainer.state.iteration, **state)
    checkpointer.close()  # every rank: the checkpoint is committed and "latest" points at it
    if topo.is_leader():
        if args.mix:  # what the run drew of each source so far (also in the trainer's observed values, mix/<name>)
            print("mixture", " ".join(f"{k}={v}" for k, v in loader.sampler.realised().items()))
        print(f"done steps {start}-{trainer.state.iteration} loss {losses[-1] if losses else float('nan')!r}")
    meshwise.shutdown()
    return losses


if __name__ == "__main__":
    main()
