"""STAND-IN for meshwise layers that had not landed yet: the smallest honest version of their contracts.

train.py imports the real layer (meshwise.data, meshwise.parallelize, meshwise.create_trainer, ...) when it
exists and falls back to the names here otherwise, saying so on rank 0. Delete a piece once its layer lands.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


# --------------------------------------------------------------------------- data (issue 3)
class ArrayDataset:
    """Named arrays sharing axis 0 (the sample axis); reading a sample counts its bytes."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = {
            k: np.load(v, mmap_mode="r") if isinstance(v, (str, os.PathLike)) else v for k, v in fields.items()
        }
        lengths = {len(v) for v in self.fields.values()}
        if len(lengths) != 1:
            raise ValueError(f"fields have different lengths {lengths}")
        self.length = lengths.pop()

    def __len__(self) -> int:
        return self.length


class _Loader:
    """Global-cursor loader: each step takes the next ``global_batch_size`` sample ids; a data rank its slice."""

    def __init__(self, ds: ArrayDataset, topo: Any, global_batch_size: int, mode: str, seed: int, drop_last: bool):
        if global_batch_size % topo.data_size:
            raise ValueError(f"global batch {global_batch_size} not divisible by data size {topo.data_size}")
        self.ds, self.topo, self.gbs, self.mode, self.seed = ds, topo, global_batch_size, mode, seed
        self.drop_last = drop_last and mode == "train"
        self.local = global_batch_size // topo.data_size
        self.epoch, self.cursor, self.bytes_read = 0, 0, 0

    def __len__(self) -> int:
        n = len(self.ds)
        return n // self.gbs if self.drop_last else math.ceil(n / self.gbs)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.cursor = sd["epoch"], sd["cursor"]

    def _order(self) -> np.ndarray:
        if self.mode == "eval":
            return np.arange(len(self.ds))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.ds))

    def __iter__(self):
        order = self._order()
        if self.mode == "eval":
            self.cursor = 0
        while self.cursor < len(self) * self.gbs:
            ids = order[self.cursor : self.cursor + self.gbs]
            mine = ids[self.topo.data_rank * self.local : (self.topo.data_rank + 1) * self.local]
            valid = np.ones(self.local, dtype=bool)
            valid[len(mine) :] = False
            index = np.full(self.local, -1, dtype=np.int64)
            index[: len(mine)] = mine
            batch: dict[str, torch.Tensor] = {}
            for name, arr in self.ds.fields.items():
                rows = np.zeros((self.local, *arr.shape[1:]), dtype=arr.dtype)
                for j, i in enumerate(sorted(mine)):
                    rows[j] = arr[i]
                self.bytes_read += len(mine) * int(np.prod(arr.shape[1:])) * arr.dtype.itemsize
                batch[name] = torch.from_numpy(rows.astype(np.int64) if rows.dtype.kind == "u" else rows)
            batch["valid"], batch["index"] = torch.from_numpy(valid), torch.from_numpy(np.sort(index))
            self.cursor += self.gbs
            yield batch
        if self.mode == "train":
            self.epoch, self.cursor = self.epoch + 1, 0


def mesh_dataloader(ds, topo, global_batch_size, mode="train", seed=0, drop_last=True, **_: Any) -> _Loader:
    return _Loader(ds, topo, global_batch_size, mode, seed, drop_last)


# --------------------------------------------------------------------------- parallel (issue 4)
def parallelize(model: torch.nn.Module, topo: Any, tp_plan: dict | None = None, dp: str = "fsdp", **_: Any):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_plan and topo.replica_dims and topo.size(topo.replica_dims) > 1:
        model = parallelize_module(model, topo.submesh(topo.replica_dims), tp_plan)
    if dp == "fsdp" and topo.metric_dims and topo.size(topo.metric_dims) > 1:
        mesh = topo.submesh(topo.metric_dims)
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _global_mean(value: torch.Tensor, weight: float, topo: Any) -> float:
    t = torch.tensor([float(value) * weight, weight], dtype=torch.float64)
    if topo.metric_dims and topo.size(topo.metric_dims) > 1:
        dist.all_reduce(t, group=topo.group(topo.metric_dims))
    return (t[0] / t[1]).item()


def create_trainer(model, optimizer, loss_fn, topo, grad_clip=None, step_context=None, **_: Any):
    import contextlib

    from ignite.engine import Engine
    from torch.distributed.tensor import DTensor

    def step(engine, batch):
        model.train()
        optimizer.zero_grad()
        with (step_context or contextlib.nullcontext)():
            loss = loss_fn(model(batch["input"]), batch["target"])
            loss.backward()
        optimizer.step()
        local = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        return _global_mean(local, float(batch["valid"].sum()), topo)

    return Engine(step)


def create_evaluator(model, topo, metrics: dict, forward=None, select=None, **_: Any):
    from ignite.engine import Engine, Events

    def step(engine, batch):
        model.eval()
        with torch.no_grad():
            out = forward(model, batch) if forward else model(batch["input"])
        for m in metrics.values():
            args = select(out, batch) if select else (out, batch["target"])
            m.update(*(a[batch["valid"]] for a in args))

    ev = Engine(step)

    @ev.on(Events.STARTED)
    def _reset(engine):
        for m in metrics.values():
            m.reset()

    @ev.on(Events.COMPLETED)
    def _compute(engine):
        engine.state.metrics = {k: float(m.compute()) for k, m in metrics.items()}

    return ev


class MeanLoss:
    """Mean of every loss element given to ``update``, summed over the metric group (topology from init)."""

    def __init__(self) -> None:
        import meshwise

        self.topo = meshwise.current()
        self.reset()

    def reset(self) -> None:
        self.total = torch.zeros(2, dtype=torch.float64)

    def update(self, values: torch.Tensor) -> None:
        self.total += torch.tensor([float(values.double().sum()), values.numel()], dtype=torch.float64)

    def compute(self) -> torch.Tensor:
        t = self.total.clone()
        if self.topo.metric_dims and self.topo.size(self.topo.metric_dims) > 1:
            dist.all_reduce(t, group=self.topo.group(self.topo.metric_dims))
        return t[0] / t[1]


# --------------------------------------------------------------------------- checkpoint (issue 6)
class Checkpointer:
    """DCP for model + optimizer (reshards on load), JSON for everything else, a ``latest`` pointer."""

    def __init__(self, root: str | os.PathLike, topo: Any) -> None:
        self.root, self.topo = Path(root), topo

    def save(self, step: int, model, optimizer, **others: Any) -> Path:  # engine, loader, ...: JSON state
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = self.root / f"step_{step:08d}"
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        if self.topo.rank == 0:
            extra = {k: v.state_dict() for k, v in others.items()}
            (path / "extra.json").write_text(json.dumps({"step": step, **extra}))
            (self.root / "latest").write_text(path.name)
        dist.barrier()
        return path

    def load(self, which: str, model, optimizer, **others: Any) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = self.root / ((self.root / "latest").read_text().strip() if which == "latest" else which)
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = json.loads((path / "extra.json").read_text())
        for k, v in others.items():
            v.load_state_dict(extra[k])
        return int(extra["step"])


# --------------------------------------------------------------------------- handlers (issue 4)
class RunLogger:
    """Rank 0 appends ``{"tag", "step", ...}`` lines to RUN_DIR/metrics.jsonl and TensorBoard scalars."""

    def __init__(self, run_dir, topology, **_: Any) -> None:
        self.on = topology.rank == 0
        self.writer = self.file = None
        if self.on:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(run_dir) / "metrics.jsonl", "a")  # noqa: SIM115
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, tag: str, values: dict, step: int) -> None:
        if self.on:
            self.file.write(json.dumps({"tag": tag, "step": step, **{k: float(v) for k, v in values.items()}}) + "\n")
            self.file.flush()
            for k, v in values.items():
                self.writer.add_scalar(f"{tag}/{k}", float(v), step)

    def attach(self, trainer, evaluators=None):
        from ignite.engine import Events

        trainer.add_event_handler(
            Events.ITERATION_COMPLETED, lambda e: self.log("train", {"loss": e.state.output}, e.state.iteration)
        )
        for tag, ev in (evaluators or {}).items():
            ev.add_event_handler(
                Events.COMPLETED, lambda e, tag=tag: self.log(tag, e.state.metrics, trainer.state.iteration)
            )
        return self

    def close(self) -> None:
        if self.on:
            self.file.close()
            self.writer.close()


def plot_run(run_dir, out=None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    fig, ax = plt.subplots(figsize=(6, 4))
    for tag in sorted({r["tag"] for r in records}):
        pts = [(r["step"], r["loss"]) for r in records if r["tag"] == tag and "loss" in r]
        ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=tag)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    target = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return str(target)
