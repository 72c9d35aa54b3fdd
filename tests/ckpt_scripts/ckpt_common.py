"""Shared pieces of the checkpoint tests: a TP+FSDP2 MLP, a cursor-based batch source, an ignite training run."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# full_state() gathers FSDP2+TP tensors: torch logs a warning about two all-gathers each time
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

N_SAMPLES = 64
GLOBAL_BATCH = 8
STEPS_PER_EPOCH = N_SAMPLES // GLOBAL_BATCH
D_IN, HIDDEN, D_OUT = 8, 16, 4


class MLP(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, hidden)
        self.fc2 = nn.Linear(hidden, D_IN)
        self.head = nn.Linear(D_IN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def build(topo: Any, hidden: int = HIDDEN, lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MLP initialised under one seed, then TP over 'tp' (colwise/rowwise) and FSDP2 over the batch dims."""
    torch.manual_seed(1234)
    model = MLP(hidden)
    if "tp" in topo.dims and topo.size("tp") > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, topo.submesh("tp"), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if topo.batch_dims and topo.size(topo.batch_dims) > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=topo.submesh(topo.batch_dims))
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as full plain tensors (a collective: call on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = torch.as_tensor(v).detach().numpy().copy()
    return out  # numpy: tensors returned through a multiprocessing queue would need the sender alive


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)).max()) for k in a)


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N_SAMPLES, D_IN, generator=g), torch.randn(N_SAMPLES, D_OUT, generator=g)


def permutation(epoch: int, seed: int = 0) -> list[int]:
    return torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()


class CursorBatches:
    """A train-mode batch source over a global cursor (samples consumed this epoch): its state reshards.

    The state is the one after the last batch handed out; an exhausted epoch moves to the next on iter().
    """

    def __init__(self, topo: Any, seed: int = 0) -> None:
        self.topo, self.seed = topo, seed
        self.x, self.y = dataset()
        self.epoch, self.cursor = 0, 0

    def __len__(self) -> int:
        return STEPS_PER_EPOCH

    def __iter__(self):
        if self.cursor >= STEPS_PER_EPOCH * GLOBAL_BATCH:
            self.epoch, self.cursor = self.epoch + 1, 0
        perm = permutation(self.epoch, self.seed)
        size, rank = self.topo.data_size, self.topo.data_rank
        local = GLOBAL_BATCH // size
        while self.cursor + GLOBAL_BATCH <= STEPS_PER_EPOCH * GLOBAL_BATCH:
            step = perm[self.cursor : self.cursor + GLOBAL_BATCH]
            self.cursor += GLOBAL_BATCH
            index = torch.tensor(step[rank * local : (rank + 1) * local])
            yield {"input": self.x[index], "target": self.y[index], "index": index}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.cursor, self.seed = int(sd["epoch"]), int(sd["cursor"]), int(sd["seed"])


def train(
    topo: Any,
    root: str | None,
    *,
    stop_at: int,
    max_epochs: int = 3,
    every: int = 5,
    async_save: bool = False,
    log: str | None = None,
    kill_while_saving: int | None = None,
) -> dict[str, Any]:
    """Train with an ignite Engine; the Checkpointing handler saves every ``every`` iterations and resumes from
    ``latest``.

    Returns what was seen per iteration (epoch, iteration, local indices) and the final full state.
    ``kill_while_saving``: SIGKILL this process while it writes its shard of the checkpoint of that iteration.
    """
    from ignite.engine import Engine, Events

    import meshwise
    from meshwise.engine.handlers import Checkpointing

    model, optimizer = build(topo)
    loader = CursorBatches(topo)
    torch.manual_seed(99)  # the same on every rank: TP ranks must draw the same input noise
    np.random.seed(5)

    def step(engine: Engine, batch: dict[str, torch.Tensor]) -> float:
        optimizer.zero_grad(set_to_none=True)
        x = batch["input"] + 0.01 * torch.randn_like(batch["input"])  # uses the RNG stream: resume must restore it
        loss = F.mse_loss(model(x), batch["target"])
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    engine = Engine(step)
    seen: list[tuple[int, int, list[int]]] = []

    @engine.on(Events.ITERATION_COMPLETED)
    def record(e: Engine) -> None:
        seen.append((e.state.epoch, e.state.iteration, e.state.batch["index"].tolist()))
        if log is not None:
            with open(Path(log) / f"rank-{topo.rank}.jsonl", "a") as f:
                attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                row = {"attempt": attempt, "epoch": e.state.epoch, "iteration": e.state.iteration, "index": seen[-1][2]}
                f.write(json.dumps(row))
                f.write("\n")

    ckpt = None
    if root is not None:
        ckpt = meshwise.Checkpointer(root, topo, async_save=async_save)
        Checkpointing(ckpt, every_iterations=every, model=model, optimizer=optimizer, loader=loader).attach(engine)

    if kill_while_saving is not None and root is not None:
        own = Path(root) / f"step-{kill_while_saving}.tmp" / f"__{topo.rank}_0.distcp"

        def watch() -> None:
            while not own.exists():
                time.sleep(0.0002)
            os.kill(os.getpid(), signal.SIGKILL)  # while this rank writes its shard of that checkpoint

        threading.Thread(target=watch, daemon=True).start()

    engine.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), lambda e: e.terminate())
    engine.run(loader, max_epochs=max_epochs)
    if ckpt is not None:
        ckpt.close()
    return {
        "seen": seen,
        "state": full_state(model, optimizer),
        "epoch": engine.state.epoch,
        "iteration": engine.state.iteration,
        "rank": topo.rank,
        "data_rank": topo.data_rank,
    }
