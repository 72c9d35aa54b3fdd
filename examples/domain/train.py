"""Train HeatNet on the heat-diffusion data set, the field sharded over the split dims and the samples over ``dp``.

    python examples/domain/generate.py --out data/heat
    meshwise run --nproc-per-node 4 --mesh dp=-1,domain=2 examples/domain/train.py --data data/heat
    python examples/domain/generate.py --out data/heat3d --spatial 3 --size 32          # 3-D volumes
    meshwise run --nproc-per-node 4 --mesh dp=-1,x=2,y=2 --roles x=split,y=split examples/domain/train.py \
        --data data/heat3d                                                               # a 2 x 2 grid of tiles

The split dims shard the last spatial axes (one dim: the width; x, y: height and width). The model states its
parts (``HeatNet.input_parts``) and the loader takes them from it (``parts=model``): each rank reads only its
tile (plus the halo the first conv needs) from Zarr; every conv exchanges halo cells with the neighbouring tiles,
corners included; loss and metrics are means over every cell of the global batch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from ignite.engine import Events

import meshwise
from meshwise.data import ArrayDataset, mesh_dataloader
from meshwise.metrics import MeanLoss, MeshMetric

HERE = Path(__file__).resolve().parent


def _example(name: str, file: str):
    """This folder's module under a unique name (``model`` would clash with other examples' modules)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


domain_model = _example("domain_model", "model.py")


def open_dataset(data: str | Path, split: str = "train") -> ArrayDataset:
    """The Zarr arrays written by generate.py (``input [N, 2, H, W]``, ``target [N, 1, H, W]``), opened lazily."""
    import zarr

    root = zarr.open_group(str(Path(data) / f"heat_{split}.zarr"), mode="r")
    return ArrayDataset({"input": root["input"], "target": root["target"]})


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the cells of this rank's tile (the trainer weights it by the cell count)."""
    return torch.nn.functional.mse_loss(output, target)


def build(
    topo,
    dataset: ArrayDataset,
    *,
    global_batch_size: int = 8,
    halo: int = 1,
    width: int = 16,
    depth: int = 4,
    lr: float = 1e-3,
    seed: int = 0,
    dim: str | tuple[str, ...] | None = None,
    load_halo: bool = True,
):
    """Model (sharded, data parallel over dp + split dims), optimizer, train loader, trainer and evaluator on ``topo``.

    ``dim`` (default: every split dim of ``topo``) shards the last spatial axes, one each. The loader takes its
    parts from the model: the input with ``halo`` loaded cells at interior edges (so the first conv needs no
    exchange), the target without.
    """
    dims = tuple(topo.split_dims) if dim is None else ((dim,) if isinstance(dim, str) else tuple(dim))
    spatial = len(dataset.sample_shape("input")) - 1
    torch.manual_seed(seed)  # the same initial weights on every rank
    config = domain_model.HeatNetConfig(width=width, depth=depth, halo=halo, spatial=spatial)
    model = domain_model.HeatNet(config)
    model.shard(topo, dims, axis=tuple(range(-len(dims), 0)), input_halo=halo if load_halo else 0)
    model = meshwise.parallelize(model, topo, dp="replicate")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loader = mesh_dataloader(dataset, topo, global_batch_size=global_batch_size, seed=seed, parts=model)
    # loss_weight="tokens": each rank's mean is weighted by its cells, so the global loss is the mean over all
    # cells of all samples, whatever the tile sizes; gradients are summed over domain and averaged over dp.
    trainer = meshwise.create_trainer(model, optimizer, mse, topo, loss_weight="tokens")
    input_part = loader.parts["input"]

    def persistence(output, batch):  # the baseline "nothing changes": u0 on the owned cells against the target
        return ((input_part.strip_halo(batch["input"])[:, :1] - batch["target"]) ** 2,)

    evaluator = meshwise.create_evaluator(
        model,
        topo,
        metrics={
            "mse": MeanLoss(loss_fn=lambda out, t: (out - t) ** 2),
            "mse_persistence": MeshMetric(MeanLoss(), topo, select=persistence),
        },
    )
    return model, optimizer, loader, trainer, evaluator


def main(argv: list[str] | None = None, topology=None) -> dict:
    """Train, evaluate on the held-out set and return ``{"steps", "loss", "mse", "mse_persistence", "bytes_read"}``.

    ``topology``: an existing one (tests); by default ``meshwise.init`` here and ``shutdown`` at the end.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/heat", help="folder written by generate.py")
    parser.add_argument("--mesh", default=None, help="e.g. dp=-1,domain=2 (default: MESHWISE_MESH or that)")
    parser.add_argument("--roles", default=None, help="e.g. x=split,y=split (default: MESHWISE_ROLES)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8, help="global batch size (samples)")
    parser.add_argument("--halo", type=int, default=1, help="halo cells; the kernel is 2*halo+1")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    topo = topology or meshwise.init(args.mesh or os.environ.get("MESHWISE_MESH") or "dp=-1,domain=2", roles=args.roles)
    train_set, eval_set = open_dataset(args.data, "train"), open_dataset(args.data, "test")
    model, _, loader, trainer, evaluator = build(topo, train_set, global_batch_size=args.batch, halo=args.halo)
    eval_loader = mesh_dataloader(eval_set, topo, global_batch_size=args.batch, mode="eval", parts=model)
    start = time.perf_counter()

    @trainer.on(Events.ITERATION_COMPLETED(every=10))
    def _log(engine) -> None:
        if topo.is_leader():
            print(f"step {engine.state.iteration}: loss {engine.state.output:.3e}", flush=True)

    trainer.run(loader, max_epochs=args.epochs)
    evaluator.run(eval_loader)
    if topo.is_leader():
        mb = loader.bytes_read / 2**20
        print(
            f"{topo.describe().splitlines()[1]}\ntrained {trainer.state.iteration} steps in "
            f"{time.perf_counter() - start:.1f}s; held-out MSE per cell {evaluator.state.metrics['mse']:.3e} "
            f"(predicting no change: {evaluator.state.metrics['mse_persistence']:.3e}); rank 0 read {mb:.1f} MiB"
        )
    summary = {
        "steps": trainer.state.iteration,
        "loss": trainer.state.output,
        "mse": evaluator.state.metrics["mse"],
        "mse_persistence": evaluator.state.metrics["mse_persistence"],
        "bytes_read": loader.bytes_read,
    }
    if topology is None:
        meshwise.shutdown()
    return summary


if __name__ == "__main__":
    main()
