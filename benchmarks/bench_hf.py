"""Hugging Face models: bytes each rank reads in ``load_hf``, and the trainer's step time against a hand loop.

1. A Llama (d 256, 4 layers, vocab 2048, float32, ~14 MB) written by ``save_pretrained`` is loaded into the
   model built on the meta device, sharded (tp=4; and dp=2 x tp=2), materialised with ``to_empty``. Bytes read
   per rank are counted by wrapping DCP's ``HuggingFaceStorageReader``: every tensor slice it copies out of the
   (memory-mapped) files plus each safetensors header it parses; ``/proc/self/io`` ``rchar`` is printed beside
   it (it misses memory-mapped reads, so it is not the figure). Ratio: the largest rank's bytes / the folder's
   ``*.safetensors`` bytes.
2. At dp=2 x tp=2 (tp_plan="auto", FSDP2), ``create_trainer(loss_weight="labels")`` against a hand-written
   loop doing the same work with the same model and AdamW objects and the same batches (labels -100 on the
   padding of uneven rows): all-reduce the batch's label count over the data ranks, cross-entropy sum / that
   count (times the data size, which FSDP2 divides by), backward, step, all-reduce of the loss, ``.item()``.
   Steps alternate (ABBA), warm-up excluded; each repeat's ratio is median(trainer) / median(loop), and the
   result is the median over repeats, printed with their spread.

Run: ``.venv/bin/python benchmarks/bench_hf.py`` (``--repeats``, ``--blocks``). Final line:
``RESULT hf_load_bytes_ratio_tp4=... hf_load_bytes_ratio_2x2=... hf_step_ratio=... hf_step_ratio_min=... ...``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

LOAD = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
LOAD.update(intermediate_size=512, vocab_size=2048)
STEP = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
STEP.update(intermediate_size=256, vocab_size=256)
BATCH, T = 16, 32  # global batch rows, tokens a row


def llama_config(sizes: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**sizes, tie_word_embeddings=False, max_position_embeddings=128)


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def sharded_load(folder: str) -> dict:
    """Bytes read on this rank by load_hf at tp=4 and at dp=2 x tp=2 (its own count and the rchar delta)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import meshwise
    from meshwise.checkpoint import load_hf

    out = {}
    for mesh in ("tp=4", "dp=2,tp=2"):
        topo = meshwise.init(mesh)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        model = meshwise.parallelize(model, topo, tp_plan="auto", dp="fsdp")
        model.to_empty(device=topo.device)
        before = rchar()
        read = load_hf(folder, model)
        out[mesh] = {"read": read, "rchar": rchar() - before}
        meshwise.shutdown()
    return out


def batches(n: int, vocab: int) -> list[dict]:
    """Uneven rows: 8 to T tokens, padded; labels the next tokens, -100 where there is none."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (BATCH, T + 1), generator=g)
        inside = torch.arange(T + 1) < torch.randint(8, T + 2, (BATCH, 1), generator=g)
        out.append({"input": torch.where(inside, ids, 0)[:, :-1], "target": torch.where(inside, ids, -100)[:, 1:]})
    return out


def step_times(topo, repeats: int, blocks: int) -> list[dict]:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import meshwise

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = meshwise.parallelize(LlamaForCausalLM(llama_config(STEP)), topo, tp_plan="auto", dp="fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    trainer = meshwise.create_trainer(model, opt, loss_fn, topo, loss_weight="labels")
    rows = BATCH // topo.size(topo.batch_dims)
    mine = slice(topo.data_rank * rows, (topo.data_rank + 1) * rows)
    data = [{k: v[mine] for k, v in b.items()} for b in batches(8, STEP["vocab_size"])]
    group, data_size = topo.group(topo.metric_dims), topo.size(topo.metric_dims)

    def hand_step(batch: dict) -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        count = (batch["target"] != -100).sum().double()
        dist.all_reduce(count, group=group)  # the global number of scored labels
        logits = model(batch["input"]).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=-100, reduction="sum")
        (loss_sum * data_size / count).backward()  # FSDP2 averages over the data ranks
        opt.step()
        value = loss_sum.detach().double()
        dist.all_reduce(value, group=group)
        (value / count).item()

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for b in data[:3]:  # warm-up both
        trainer.run([b], max_epochs=1)
        hand_step(b)
    results = []
    for _ in range(repeats):
        ours, theirs = [], []
        for i in range(blocks):
            b = data[i % len(data)]
            order = [(ours, lambda b=b: trainer.run([b], max_epochs=1)), (theirs, lambda b=b: hand_step(b))]
            for sink, fn in order if i % 2 == 0 else order[::-1]:
                sink.append(timed(fn))
        results.append({"trainer_s": statistics.median(ours), "loop_s": statistics.median(theirs)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the step comparison")
    parser.add_argument("--blocks", type=int, default=30, help="steps per side in each repeat")
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    from meshwise.testing import run_distributed

    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(LOAD)).save_pretrained(tmp)
        size = sum(p.stat().st_size for p in Path(tmp).glob("*.safetensors"))
        loads = run_distributed(sharded_load, 4, tmp, timeout=600, pg_timeout=300)
    ratios = {}
    for mesh in ("tp=4", "dp=2,tp=2"):
        reads = [r[mesh]["read"] for r in loads]
        ratios[mesh] = max(reads) / size
        print(
            f"load_hf at {mesh}: folder {size} B; read per rank {reads} B (largest {ratios[mesh]:.4f} of the folder);"
            f" rchar per rank {[r[mesh]['rchar'] for r in loads]} B (memory-mapped reads are not in it)"
        )
    steps = run_distributed(step_times, 4, args.repeats, args.blocks, mesh={"dp": 2, "tp": 2}, timeout=600)[0]
    step_ratios = [r["trainer_s"] / r["loop_s"] for r in steps]
    for i, r in enumerate(steps):
        print(
            f"repeat {i}: trainer {r['trainer_s'] * 1e3:.2f} ms, hand loop {r['loop_s'] * 1e3:.2f} ms, "
            f"ratio {step_ratios[i]:.3f}"
        )
    print(
        f"RESULT hf_load_bytes_ratio_tp4={ratios['tp=4']:.4f} hf_load_bytes_ratio_2x2={ratios['dp=2,tp=2']:.4f} "
        f"hf_step_ratio={statistics.median(step_ratios):.3f} hf_step_ratio_min={min(step_ratios):.3f} "
        f"hf_step_ratio_max={max(step_ratios):.3f}"
    )


if __name__ == "__main__":
    main()
