"""A tiny language model trained by tests/test_engine.py (or by hand under ``meshwise run``): vocab-sharded
head with loss_parallel, a prepare hook, token weighting with ignored targets, rank-0 progress bar and logs.

By hand: meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 tests/engine_script.py RUN_DIR
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
import torch.nn.functional as F
from ignite.engine import Events
from torch import nn

import meshwise
from meshwise.engine import ProgressBar, RunLogger, setup_logging

V, D, T, GLOBAL_BATCH, STEPS, LR = 32, 16, 6, 8, 6, 0.5


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(x)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def split_tokens(batch: dict) -> dict:
    tokens = batch["tokens"]
    target = tokens[:, 1:].clone()
    target[batch["ignore"][:, 1:]] = -100  # uneven numbers of scored tokens per rank
    return {"input": tokens[:, :-1], "target": target}


def global_batches() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [
        {
            "tokens": torch.randint(0, V, (GLOBAL_BATCH, T + 1), generator=g),
            "ignore": torch.rand(GLOBAL_BATCH, T + 1, generator=g) < 0.4,
        }
        for _ in range(STEPS)
    ]


def say(line: str) -> None:
    """One write per line, so the lines of four processes sharing a pipe do not interleave."""
    sys.stdout.write(f"\n{line}\n")
    sys.stdout.flush()


def train(topo: meshwise.Topology, run_dir: str) -> dict:
    """Train on ``topo``, logging to ``run_dir``; returns the comparison with a one-process run."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

    setup_logging(topo)
    torch.manual_seed(0)
    full = TinyLM()
    reference = copy.deepcopy(full)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_losses = []
    ref_counts = []
    for b in global_batches():
        b = split_tokens(b)
        ref_counts.append(float((b["target"] != -100).sum()))
        loss = token_loss(reference(b["input"]), b["target"])
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    plan = {
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    model = meshwise.parallelize(full, topo, tp_plan=plan, dp="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = meshwise.create_trainer(
        model,
        opt,
        token_loss,
        topo,
        prepare=split_tokens,
        loss_weight=lambda b: (b["target"] != -100).sum(),
        step_context=loss_parallel,
    )
    bar = ProgressBar(topo, desc=f"train-bar-of-rank-{topo.rank}").attach(trainer)
    say(f"rank {topo.rank} bar {bar.enabled}")
    logger = RunLogger(run_dir, topo).attach(trainer)
    losses: list[float] = []
    counts: list[float] = []  # scored tokens of each global batch
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: counts.append(e.state.loss_count))
    n = GLOBAL_BATCH // topo.data_size
    lo = topo.data_rank * n
    local = [{k: v[lo : lo + n] for k, v in b.items()} for b in global_batches()]
    if topo.rank in (1, 3):
        warnings.warn(f"a warning from rank {topo.rank}", UserWarning, stacklevel=1)
    trainer.run(local, max_epochs=1)
    logger.close()
    ref = dict(reference.named_parameters())
    diff = max(
        ((p.full_tensor() if isinstance(p, DTensor) else p.detach()) - ref[name]).abs().max().item()
        for name, p in model.named_parameters()
    )
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    say(f"CHECK rank={topo.rank} param_diff={diff:.3g} loss_diff={loss_diff:.3g} losses={losses}")
    return {
        "bar": bar.enabled,
        "param_diff": diff,
        "loss_diff": loss_diff,
        "losses": losses,
        "counts": counts,
        "ref_counts": ref_counts,
    }


if __name__ == "__main__":
    train(meshwise.init(), sys.argv[1])
    meshwise.shutdown()
