"""Train the example GPT with data x tensor x pipeline parallelism over a meshwise topology; evaluate,
checkpoint, resume.

One invocation is one phase. Train (and evaluate held-out loss exactly, and checkpoint) at dp=2 x tp=2:

    meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 examples/gpt/train.py --steps 250

Pipeline stages (the blocks cut evenly; the first stage reads only inputs, the last only targets):

    meshwise run --nproc-per-node 8 --mesh pp=2,dp=2,tp=2 examples/gpt/train.py --schedule 1F1B --microbatches 4

Context parallel (a cp dim: each rank reads and attends over two balanced chunks of every window):

    meshwise run --nproc-per-node 4 --mesh dp=2,cp=2 examples/gpt/train.py --steps 250

Resume that checkpoint on another mesh (the checkpoint reshards on load) for a few more steps:

    meshwise run --nproc-per-node 4 --mesh tp=4 examples/gpt/train.py --resume runs/gpt --steps 30

Each phase appends to the run folder (default runs/gpt): metrics.jsonl, TensorBoard events, loss.png,
summary.jsonl, checkpoints/. The summary table printed at the end lists every phase of the run folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import ignite.distributed as idist
import numpy as np
import torch
import torch.nn.functional as F
from ignite.engine import Events
from model import GPT, Block, GPTConfig, check_tp_degree, token_loss, tp_plan
from prepare import prepare

import meshwise
from meshwise import dryrun
from meshwise.data import ArrayDataset, Shard, mesh_dataloader
from meshwise.engine import PeriodicEvaluation, ProgressBar, RunLogger, TimeBudget
from meshwise.errors import DataError, MeshwiseError
from meshwise.metrics import MeanLoss
from meshwise.parallel.context import context_parallel, describe
from meshwise.parallel.precision import memory_per_rank
from meshwise.plot import plot_run

MODEL_KEYS = ("block_size", "n_layer", "n_head", "d_model")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default=None, help="mesh, e.g. dp=2,tp=2 (default: meshwise run --mesh / MESHWISE_MESH)")
    p.add_argument("--run-dir", default=None, help="run folder (default runs/gpt, or the --resume folder)")
    p.add_argument("--resume", default=None, help="run folder whose latest checkpoint to continue from")
    p.add_argument("--overwrite", action="store_true", help="start afresh in a run folder that holds a run")
    data = p.add_argument_group("data (default: the Python standard library's .py files, byte-level)")
    data.add_argument("--data-dir", default="data/gpt", help="where prepared train.npy/val.npy live")
    data.add_argument("--text", default=None, help="train on this text file instead (byte-level)")
    data.add_argument("--tokens", default=None, help="train on this 1-D .npy of token ids instead")
    data.add_argument("--source-dir", default=None, help="a folder of .py files instead of the standard library")
    data.add_argument("--val-fraction", type=float, default=0.05)
    data.add_argument(
        "--read",
        default="broadcast",
        choices=("each", "broadcast", "scatter"),
        help="how a tensor-parallel group gets its shared batch: every rank reads it, one reads and broadcasts "
        "(default), or each reads 1/tp and they all-gather",
    )
    model = p.add_argument_group("model (ignored with --resume: the run folder's config is used)")
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--n-layer", type=int, default=4)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--block-size", type=int, default=128)
    pipe = p.add_argument_group("pipeline stages (used when the mesh has a pp dim; checked and ignored otherwise)")
    pipe.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B (default) or Interleaved1F1B")
    pipe.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: stages)")
    pipe.add_argument("--stages-per-rank", type=int, default=None, help="Interleaved1F1B: stages a rank (2)")
    pipe.add_argument("--cut", default=None, help="comma-separated pieces each later stage starts at, e.g. blocks.2")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, default=250, help="optimizer steps in this invocation")
    opt.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="stop after this many seconds of training loop, periodic evaluations included (0: off)",
    )
    opt.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    opt.add_argument("--lr", type=float, default=2e-3)
    opt.add_argument("--warmup", type=int, default=20)
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (fp32 master weights; docs/precision.md)")
    opt.add_argument("--ac", default="none", help="activation checkpointing: none, full, k (every k-th block) or names")
    opt.add_argument("--compile", action="store_true", help="torch.compile each block")
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps (and at start and end)")
    ev.add_argument("--eval-samples", type=int, default=500, help="held-out windows to evaluate (0: all)")
    ev.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "eval_every", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.eval_samples < 0:
        p.error(f"--eval-samples must be 0 (all) or positive, got {args.eval_samples}")
    return args


# --------------------------------------------------------------------------- run folder and data


def open_run_folder(args: argparse.Namespace, topo: meshwise.Topology) -> Path:
    """The run folder of this phase; a new training phase refuses a folder that holds a run (unless --overwrite).

    A dry run (``meshwise run --dry-run``) never reads, refuses, clears or writes the run folder: it writes nothing
    there, so whatever the folder holds is no reason to stop, and ``--overwrite`` must not delete a real run."""
    run_dir = Path(args.run_dir or args.resume or "runs/gpt")
    if dryrun.active() is not None:
        return run_dir
    if not args.resume and not args.overwrite and (run_dir / "config.json").exists():
        raise MeshwiseError(
            f"run folder {run_dir} already holds a run: pass --resume {run_dir} to continue it, "
            "--overwrite to start afresh, or --run-dir elsewhere"
        )
    if args.resume and not (Path(args.resume) / "config.json").exists():
        raise MeshwiseError(f"--resume {args.resume}: no config.json there; give the run folder of a training phase")
    if args.overwrite and not args.resume and topo.is_leader() and run_dir.exists():
        shutil.rmtree(run_dir)
    topo.barrier()  # no rank looks into the folder while rank 0 may still be clearing it
    return run_dir


def prepare_data(args: argparse.Namespace, topo: meshwise.Topology) -> tuple[Path, dict]:
    """Rank 0 tokenises the corpus (or finds it up to date) while the others wait; then every rank checks and
    reads the same files, so a failure on rank 0 (a missing corpus) fails every rank with the same message."""
    out = Path(args.data_dir)
    if args.text or args.tokens or args.source_dir:
        kind = "text" if args.text else "tokens" if args.tokens else "src"
        out = out / f"{kind}-{Path(args.text or args.tokens or args.source_dir).stem}"
    corpus = dict(source_dir=args.source_dir, text=args.text, tokens=args.tokens, val_fraction=args.val_fraction)
    failure = None
    if topo.is_leader():
        try:
            prepare(out, **corpus)
        except (MeshwiseError, OSError) as exc:
            failure = exc
    topo.barrier()
    try:
        if failure is not None:
            raise failure
        return out, prepare(out, **corpus, write=False)
    except (MeshwiseError, OSError) as exc:
        raise DataError(f"could not prepare the corpus: {exc}") from exc


def windows(tokens_path: Path, block_size: int, limit: int = 0) -> dict[str, np.ndarray]:
    """Non-overlapping windows of block_size+1 tokens: input = the first block_size, target = the next."""
    tokens = np.load(tokens_path, mmap_mode="r")
    n = len(tokens) // (block_size + 1)
    if limit:
        n = min(n, limit)
    if n == 0:
        raise MeshwiseError(f"{tokens_path} holds {len(tokens)} tokens, fewer than one window of {block_size + 1}")
    w = tokens[: n * (block_size + 1)].reshape(n, block_size + 1)  # still a memmap view: nothing read yet
    return {"input": w[:, :-1], "target": w[:, 1:]}


def as_token_ids(batch: dict) -> dict:
    """Byte tokens arrive as uint8 (as stored); embeddings and cross-entropy want int64 ids. A pipeline stage
    gets only the fields it reads (the first the inputs, the last the targets, a middle one neither)."""
    return {**batch, **{k: batch[k].long() for k in ("input", "target") if k in batch}}


# --------------------------------------------------------------------------- losses and metrics


def loss_context(topo: meshwise.Topology) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` when the head is vocab-sharded; its backward must run inside it too.

    It does not nest: leaving an inner ``loss_parallel()`` switches it off for the outer one too.
    """
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if topo.replica_dims and topo.size(topo.replica_dims) > 1 else contextlib.nullcontext()


def per_token_loss(logits, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per token as a plain [B, T] tensor, for vocab-sharded logits too."""
    from torch.distributed.tensor import DTensor

    with loss_context(meshwise.current()):
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1).long(), reduction="none")
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss.view(target.shape)


def evaluation_hooks(pp: int) -> dict:
    """The evaluator's forward/select: the per-token loss ``[B, T]`` the metrics see, without or with stages."""
    if pp > 1:  # the schedule runs the stages; select runs on the last one
        return {"select": lambda logits, batch: (per_token_loss(logits, batch["target"]),)}
    return {
        "forward": lambda m, batch: per_token_loss(
            m(batch["input"], positions=batch.get("positions")), batch["target"]
        ),
        "select": lambda token_losses, batch: (token_losses,),
    }


class Perplexity(MeanLoss):
    """exp of the token-weighted mean loss."""

    def compute(self) -> torch.Tensor:
        return super().compute().exp()


# --------------------------------------------------------------------------- summary


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_summary(rows: list[dict]) -> str:
    head = ["phase", "mesh", "steps", "train loss", "held-out loss", "perplexity", "tokens/s", "bytes read per rank"]
    lines = [head]
    for r in rows:
        mb = ", ".join(_size(b) for b in r["bytes_read"])
        lines.append(
            [
                r["phase"],
                r["mesh"],
                f"{r['step_from']}-{r['step_to']}",
                f"{r['train_loss']:.3f}",
                f"{r['first_val_loss']:.3f} -> {r['val_loss']:.3f}",
                f"{r['val_ppl']:.2f}",
                f"{r['tokens_per_s']:,.0f}",
                mb,
            ]
        )
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_summary(run_dir: Path, row: dict, checkpoint: Path) -> None:
    """Append this phase's row to summary.jsonl, draw loss.png and print the table of every phase (rank 0)."""
    with open(run_dir / "summary.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    rows = [json.loads(x) for x in (run_dir / "summary.jsonl").read_text().splitlines() if x.strip()]
    png = plot_run(run_dir, run_dir / "loss.png")
    print("\n" + format_summary(rows), flush=True)
    print(
        f"\nrun folder {run_dir}: metrics.jsonl, tensorboard/ (tensorboard --logdir {run_dir}), "
        f"{Path(png).name}, checkpoint {checkpoint}",
        flush=True,
    )


# --------------------------------------------------------------------------- the phase


def make_loaders(args, topo, cfg: GPTConfig, data_dir: Path):
    """The train and held-out loaders: windows of ``block_size`` tokens, stage- and split-aware."""
    train_ds = ArrayDataset(windows(data_dir / "train.npy", cfg.block_size))
    val_ds = ArrayDataset(windows(data_dir / "val.npy", cfg.block_size, args.eval_samples))
    pp = topo.size(topo.stage_dims) if topo.stage_dims else 1
    # Pipeline stages read only what they use: the first stage the inputs, the last the targets.
    stages = {"stage_fields": {"first": ["input"], "last": ["target"]}} if pp > 1 else {}
    # Context parallel (a split dim, e.g. cp): each rank reads chunks i and 2k-1-i of every window, and the batch
    # carries their positions (docs/context.md).
    cp = bool(topo.split_dims)
    if cp:
        stages["parts"] = {"input": Shard(0, balanced=True), "target": Shard(0, balanced=True)}
    train_loader = mesh_dataloader(
        train_ds, topo, global_batch_size=args.batch_size, mode="train", seed=args.seed, read=args.read, **stages
    )
    val_loader = mesh_dataloader(
        val_ds, topo, global_batch_size=args.eval_batch_size, mode="eval", read=args.read, **stages
    )
    return train_ds, val_ds, train_loader, val_loader


def make_model(args, topo, cfg: GPTConfig, tp: int):
    """The GPT on this mesh, its AdamW, warm-up schedule and parameter count.

    Full weights under one seed on every rank, then cut into stages, sharded by the TP plan and FSDP2 and given
    the precision, activation-checkpointing and compile options.
    """
    model = GPT(cfg)
    n_params = model.num_parameters()  # before sharding: the whole model's count, for the header
    if topo.split_dims:  # its attention modules attend across the split ranks
        context_parallel(model, topo)
    plan = tp_plan(model) if tp > 1 else None  # without a tensor-parallel dim (or of size 1): data parallel only
    model = meshwise.parallelize(
        model,
        topo,
        tp_plan=plan,
        dp="fsdp",
        fsdp_units=Block,
        cut=args.cut.split(",") if args.cut else None,
        schedule=args.schedule,
        microbatches=args.microbatches,
        stages_per_rank=args.stages_per_rank,
        precision=args.precision,
        activation_checkpointing=None if args.ac == "none" else int(args.ac) if args.ac.isdigit() else args.ac,
        compile=args.compile,
    )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    return model, optimizer, scheduler, n_params


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    topo = meshwise.init(args.mesh)
    torch.manual_seed(args.seed)
    # The mesh as the summary shows it: dims of size 1 left out (dp=1 x tp=4 is a tp=4 run).
    mesh_name = "x".join(f"{d}={s}" for d, s in topo.sizes.items() if s > 1) or "x".join(
        f"{d}={s}" for d, s in topo.sizes.items()
    )
    run_dir = open_run_folder(args, topo)

    # ---- data and model size: from the options, or on --resume from the run folder's config (a dry run reads no run
    # folder: it plans the model the options describe)
    dry = dryrun.active() is not None
    if args.resume and not dry:
        saved = json.loads((Path(args.resume) / "config.json").read_text())
        cfg = GPTConfig(**saved["model"])
        for k in ("data_dir", "text", "tokens", "source_dir", "val_fraction", "eval_samples", "batch_size"):
            setattr(args, k, saved["args"][k])
    else:
        cfg = GPTConfig(**{k: getattr(args, k) for k in MODEL_KEYS})
    data_dir, meta = prepare_data(args, topo)
    tp = topo.size(topo.replica_dims) if topo.replica_dims else 1
    if not args.resume or dry:
        cfg.vocab_size = meta["vocab_size"] + (-meta["vocab_size"]) % tp  # padded ids never occur in the data
    check_tp_degree(cfg, tp)
    if topo.is_leader() and not args.resume and not dry:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "args": vars(args)}, indent=1))

    train_ds, val_ds, train_loader, val_loader = make_loaders(args, topo, cfg, data_dir)
    pp = topo.size(topo.stage_dims) if topo.stage_dims else 1
    cp = bool(topo.split_dims)
    model, optimizer, scheduler, n_params = make_model(args, topo, cfg, tp)

    # ---- trainer and evaluator. Every row holds block_size target tokens: the loss is the mean over the global
    # batch's tokens. The evaluator's forward computes the per-token loss from the vocab-sharded logits under
    # loss_parallel(), so the logits are never gathered; the metrics weigh every valid token once. Through
    # pipeline stages the last stage's logits arrive whole at select=, which computes the per-token loss there.
    trainer = meshwise.create_trainer(
        model,
        optimizer,
        token_loss,
        topo,
        grad_clip=args.grad_clip or None,
        loss_weight="tokens",
        step_context=lambda: loss_context(topo),
        prepare=as_token_ids,
        forward=(lambda m, b: m(b["input"], positions=b["positions"])) if cp else None,
    )
    evaluator = meshwise.create_evaluator(
        model,
        topo,
        metrics={"loss": MeanLoss(), "perplexity": Perplexity()},
        **evaluation_hooks(pp),
        prepare=as_token_ids,
    )
    checkpointer = meshwise.Checkpointer(run_dir / "checkpoints", topo)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "engine": trainer, "loader": train_loader}

    # ---- resume: the checkpoint reshards model and optimizer to this mesh; the loader continues its cursor
    start = 0
    if args.resume:
        source = checkpointer
        if Path(args.resume).resolve() != run_dir.resolve():
            source = meshwise.Checkpointer(Path(args.resume) / "checkpoints", topo)
        info = source.load("latest", **state)
        start = trainer.state.iteration
        if topo.is_leader():
            print(info.message, flush=True)
    if topo.is_leader():
        print(
            f"{'resume' if args.resume else 'train'} at {mesh_name} from step {start}: GPT {cfg.n_layer} layers x "
            f"d_model {cfg.d_model} ({n_params / 1e6:.2f}M params); {meta['train_tokens']:,} train tokens, "
            f"{len(val_ds)} held-out windows of {cfg.block_size}; global batch {args.batch_size}"
            + (f"; attention: {describe(model)}" if cp else ""),
            flush=True,
        )
        print(f"precision {args.precision}; rank 0 holds {memory_per_rank(model, optimizer).describe()}", flush=True)

    # ---- handlers: each step's time and loss, the scheduler, the log, held-out evaluation, bar and time budget
    phase = {"train_s": 0.0, "t0": 0.0, "losses": []}
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda _: phase.update(t0=time.perf_counter()))

    @trainer.on(Events.ITERATION_COMPLETED)
    def _after_step(engine):
        phase["train_s"] += time.perf_counter() - phase["t0"]
        phase["losses"].append(float(engine.state.output))
        scheduler.step()

    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda engine: train_loader.set_epoch(engine.state.epoch))
    logger = RunLogger(run_dir, topo).attach(trainer, evaluators={"val": evaluator})
    held_out = PeriodicEvaluation(evaluator, val_loader, every=args.eval_every, at_start=True).attach(trainer)
    if not args.no_progress:
        bar = ProgressBar(topo, total=args.steps, desc=f"{mesh_name} step ", file=sys.stdout, dynamic_ncols=True)
        bar.attach(trainer, evaluators={"held_out": evaluator})
    if args.time_budget:
        TimeBudget(args.time_budget, topo).attach(trainer)  # every rank stops at the same step

    # ---- train (evaluating at the start, every --eval-every steps and at the end), then checkpoint
    trainer.run(train_loader, max_iters=start + args.steps)
    end = trainer.state.iteration
    checkpoint = checkpointer.save(end, **state)
    checkpointer.close()  # every rank: the checkpoint is committed and "latest" points at it
    logger.close()

    # ---- this phase's summary row
    bytes_read = idist.all_gather(torch.tensor([train_loader.bytes_read + val_loader.bytes_read])).tolist()
    last = phase["losses"][-10:] or [float("nan")]
    val_losses = [h["metrics"]["loss"] for h in held_out.history]
    row = {
        "phase": "resume" if args.resume else "train",
        "mesh": mesh_name,
        "step_from": start,
        "step_to": end,
        "train_loss": sum(last) / len(last),
        "first_val_loss": val_losses[0],
        "val_loss": val_losses[-1],
        "val_ppl": math.exp(val_losses[-1]),
        "tokens_per_s": (end - start) * args.batch_size * cfg.block_size / max(phase["train_s"], 1e-9),
        "bytes_read": bytes_read,
        "train_seconds": phase["train_s"],
    }
    if topo.is_leader() and not dry:
        write_summary(run_dir, row, checkpoint)
    meshwise.shutdown()
    return row


if __name__ == "__main__":
    try:
        main()
    except MeshwiseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
