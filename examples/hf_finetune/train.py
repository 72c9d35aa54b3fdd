"""Fine-tune a Hugging Face causal LM on a mesh: from a ``save_pretrained`` folder, sharded, resumable, exported.

Everything is made here, nothing is downloaded: on its first run the script builds a small random Llama
(``LlamaForCausalLM`` from a ``LlamaConfig``, float64) and writes it with ``save_pretrained`` into
``<run-dir>/pretrained``, the "pretrained" start. Every run then builds the model on the meta device (no rank
holds the whole model), shards it with the model's own plan (``parallelize(tp_plan="auto")``, FSDP2 over dp),
materialises its shards with ``to_empty`` and reads them with ``load_hf`` (each rank reads only its slices).
The data are generated prompt-and-answer rows of uneven length: labels are the next tokens of the answer,
``-100`` on the prompt and the padding, and the trainer's ``loss_weight="labels"`` takes Hugging Face's mean
over every scored label of the global batch. A ``Checkpointer`` saves model, optimizer, engine and the
loader's cursor, so a run stopped mid-epoch resumes on any mesh with exactly the next batch. The run that
reaches ``--steps`` exports the model with ``export_hf`` into ``<run-dir>/finetuned``, a folder
``AutoModelForCausalLM.from_pretrained`` loads.

    meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 examples/hf_finetune/train.py --stop-at 3   # stopped
    meshwise run --nproc-per-node 4 --mesh tp=4 examples/hf_finetune/train.py                    # resumed
    # the same export from a shell (into another, empty folder):
    meshwise export runs/hf_finetune/checkpoints hf_out --hf --config runs/hf_finetune/pretrained

One process works too: ``python examples/hf_finetune/train.py --mesh dp=1``. Rank 0 prints one line per step,
``step <i> loss <float repr>``, and a last line ``done steps <a>-<b> loss <float repr>``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from ignite.engine import Events

import meshwise
from meshwise.checkpoint import export_hf, load_hf
from meshwise.data import ArrayDataset, mesh_dataloader

IGNORE = -100  # Hugging Face's ignored label


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default=None, help="mesh, e.g. dp=2,tp=2 (default: meshwise run --mesh)")
    p.add_argument("--run-dir", default="runs/hf_finetune", help="pretrained folder, checkpoints, export go here")
    p.add_argument("--steps", type=int, default=6, help="train to this global step (resuming if checkpointed)")
    p.add_argument("--stop-at", type=int, default=0, help="stop (and checkpoint) after this step: a simulated kill")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (rows per step)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def llama_config() -> Any:
    """A small Llama whose heads (8), key/value heads (4), MLP width and vocabulary divide by tp=1, 2 and 4."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        dtype="float64",
    )


def write_pretrained(folder: Path, seed: int) -> None:
    """The "pretrained" start: a random float64 Llama, written once by ``save_pretrained``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config()).to(torch.float64).save_pretrained(str(folder))


def make_data(samples: int, seq_len: int, vocab: int, seed: int, answer: int = 8) -> dict[str, torch.Tensor]:
    """Prompt-and-answer rows of counting sequences ``start, start + step, ...`` (mod vocab), padded to ``seq_len``.

    A row is a prompt of 1 or more tokens, then an answer of 2 to ``answer`` tokens, then padding. ``input`` is
    its tokens but the last (pad 0 after its end); ``target`` the next token where that is an answer token,
    ``-100`` on the prompt and the padding, so rows (and global batches) score different numbers of labels."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=g)
    step = torch.randint(1, 8, (samples, 1), generator=g)
    tokens = (start + step * torch.arange(seq_len + 1)) % vocab
    answers = torch.randint(2, answer + 1, (samples, 1), generator=g)
    prompt = 1 + (torch.rand(samples, 1, generator=g) * (seq_len + 1 - answers)).long()
    position = torch.arange(seq_len + 1)
    inputs = torch.where(position < prompt + answers, tokens, 0)[:, :-1]
    scored = (position >= prompt) & (position < prompt + answers)  # the answer tokens, as next tokens
    labels = torch.where(scored, tokens, IGNORE)[:, 1:]
    return {"input": inputs.contiguous(), "target": labels.contiguous()}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The micro-batch's mean over its scored labels (already shifted); the trainer weighs it by their count."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def build_model(pretrained: Path, topo: meshwise.Topology) -> torch.nn.Module:
    """The model on the meta device, sharded by its own plan, materialised shard by shard and read from the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(pretrained))
    with torch.device("meta"):  # no weights anywhere yet: only shapes
        model = AutoModelForCausalLM.from_config(config).to(torch.float64)
    model = meshwise.parallelize(model, topo, tp_plan="auto", dp="fsdp")
    model.to_empty(device=topo.device)  # each rank allocates its shards only
    load_hf(pretrained, model)  # ... and reads only their bytes; rotary buffers are recomputed
    return model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    topo = meshwise.init(args.mesh)
    run_dir = Path(args.run_dir)
    pretrained = run_dir / "pretrained"
    if topo.is_leader() and not (pretrained / "config.json").is_file():
        write_pretrained(pretrained, args.seed)
    topo.barrier()

    model = build_model(pretrained, topo)
    data = make_data(args.samples, args.seq_len, model.config.vocab_size, args.seed + 1)
    loader = mesh_dataloader(ArrayDataset(data), topo, global_batch_size=args.batch_size, mode="train", seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    trainer = meshwise.create_trainer(model, optimizer, causal_lm_loss, topo, loss_weight="labels", grad_clip=1.0)

    # ---- resume: the checkpoint reshards onto this run's mesh; the loader continues with the next batch
    checkpointer = meshwise.Checkpointer(run_dir / "checkpoints", topo)
    state = {"model": model, "optimizer": optimizer, "engine": trainer, "loader": loader}
    start = 0
    if checkpointer.latest_step() is not None:
        checkpointer.load("latest", **state)
        start = trainer.state.iteration
    stop = min(args.steps, args.stop_at) if args.stop_at else args.steps
    if topo.is_leader():
        print(f"{len(data['input'])} rows on mesh {topo.label()}; steps {start}-{stop}", flush=True)

    losses: list[float] = []

    @trainer.on(Events.ITERATION_COMPLETED)
    def _log(engine) -> None:
        losses.append(float(engine.state.output))
        if topo.is_leader():
            print(f"step {engine.state.iteration} loss {losses[-1]!r}", flush=True)

    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: loader.set_epoch(e.state.epoch))
    if stop > start:
        trainer.run(loader, max_iters=stop)
        checkpointer.save(trainer.state.iteration, **state)
    checkpointer.close()  # every rank: the checkpoint is committed and "latest" points at it

    # ---- the finished run exports a folder from_pretrained reads (one process reads the checkpoint)
    exported = None
    if trainer.state.iteration >= args.steps and stop > start:
        exported = run_dir / "finetuned"
        if topo.is_leader():
            export_hf(run_dir / "checkpoints", exported, config=pretrained)
        topo.barrier()
    with torch.no_grad():  # a probe for whoever checks the export: logits are whole on every rank
        logits = model(data["input"][:2]).logits.detach().clone()
    if topo.is_leader():
        print(f"done steps {start}-{trainer.state.iteration} loss {losses[-1] if losses else float('nan')!r}")
    meshwise.shutdown()
    return {"losses": losses, "logits": logits, "exported": None if exported is None else str(exported)}


if __name__ == "__main__":
    main()
