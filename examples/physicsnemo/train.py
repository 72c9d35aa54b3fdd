"""Train the domain example's HeatNet from a PhysicsNeMo script: DistributedManager's mesh, meshwise's tiles.

    meshwise run --nproc-per-node 4 examples/physicsnemo/train.py                 # data_parallel=2 x model_parallel=2
    meshwise run --nproc-per-node 4 examples/physicsnemo/train.py --route shard   # PhysicsNeMo's ShardTensor convs
    python examples/physicsnemo/train.py                                          # one process, the same numbers

Written the way a PhysicsNeMo user writes a script: the manager starts, ``manager.initialize_mesh`` names
``("data_parallel", "model_parallel")``, and ``meshwise.physicsnemo.adopt`` makes that mesh the meshwise
topology (``model_parallel`` is PhysicsNeMo's domain parallel: ``"split"``). The script writes a small 2-D
heat-diffusion data set as ``.npy``; ``mesh_dataloader`` reads each rank's columns only (the input with a
1-cell halo); HeatNet (``examples/domain/model.py``) trains in float64 and the last line is the loss over every
cell of the global batch, equal across world sizes and routes. Two routes, one training loop (local sums over the
global cell count, gradients all-reduced over the world):

* ``--route halo``: meshwise's halo route, HeatNet's ``.shard()`` exchanges halos itself on plain tiles (each
  target tile still goes to a ``ShardTensor`` and back, to show the round trip);
* ``--route shard``: PhysicsNeMo's route, the unsharded HeatNet runs on ``ShardTensor`` inputs through PhysicsNeMo's
  own conv patches (``meshwise.physicsnemo.register_shard_ops()`` registers them, on CPU too), and
  ``meshwise.physicsnemo.share_gradients(net)`` turns PhysicsNeMo's gradient sums over model_parallel into this
  rank's share, so the all-reduce below counts them once.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import meshwise
from meshwise import physicsnemo as mwp
from meshwise.data import ArrayDataset, Shard, mesh_dataloader

DOMAIN = Path(__file__).resolve().parents[1] / "domain"


def _domain(name: str, file: str):
    """The domain example's module under a unique name (``model`` would clash with other examples' modules)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DOMAIN / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def write_data(out: Path, samples: int, size: int) -> dict[str, str]:
    """``input.npy [N, 2, size, size]`` (u0, kappa) and ``target.npy [N, 1, size, size]``, float64."""
    generate = _domain("domain_generate", "generate.py")
    inputs, targets = generate.generate(samples, size, steps=4, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"input": str(out / "input.npy"), "target": str(out / "target.npy")}
    np.save(paths["input"], inputs.astype(np.float64))
    np.save(paths["target"], targets.astype(np.float64))
    return paths


def _one_process_env() -> None:
    """Without a launcher, a world of one over gloo: DistributedManager.initialize() would leave the manager
    non-distributed, and its initialize_mesh refuses that."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv: list[str] | None = None) -> float:
    """Train ``--steps`` SGD steps and return the final global loss (float64)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "meshwise_physicsnemo"))
    parser.add_argument("--model-parallel", type=int, default=None, help="default: 2, or 1 on one process")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--size", type=int, default=30, help="cells a side (30 over 4 ranks: uneven tiles)")
    parser.add_argument("--batch", type=int, default=4, help="global batch size")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--route", choices=("halo", "shard"), default="halo", help="who exchanges the halos")
    args = parser.parse_args(argv)

    _one_process_env()
    manager = mwp.initialize_manager()  # DistributedManager.initialize() itself fails on CPU
    mp = args.model_parallel or min(2, manager.world_size)
    manager.initialize_mesh((-1, mp), ("data_parallel", "model_parallel"))
    topo = mwp.adopt(roles={"model_parallel": "split"})

    out = Path(args.out)
    if manager.rank == 0:  # one writer; the others wait for the files
        write_data(out, args.samples, args.size)
    dist.barrier()
    paths = {"input": str(out / "input.npy"), "target": str(out / "target.npy")}
    shard_route = args.route == "shard"
    # dim 2 of [C, H, W]: the columns; PhysicsNeMo's convs exchange their own halo, so no input halo there
    parts = {"input": Shard(2, halo=0 if shard_route else 1), "target": Shard(2)}
    loader = mesh_dataloader(ArrayDataset(paths), topo, global_batch_size=args.batch, seed=0, parts=parts)

    model = _domain("domain_model", "model.py")
    torch.manual_seed(0)  # the same initial weights on every rank
    net = model.HeatNet(model.HeatNetConfig(width=8, depth=3, halo=1)).double()
    if shard_route:
        mwp.register_shard_ops()  # PhysicsNeMo's ShardTensor ops (it registers them itself only with CUDA)
        mwp.share_gradients(net, topo)  # its sums over model_parallel -> this rank's share, as on the halo route
    else:
        net.shard(topo, "model_parallel", axis=-1, input_halo=1)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    cells = args.batch * args.size * args.size  # the loss is a mean over every cell of the global batch
    step, loss = 0, float("nan")
    while step < args.steps:
        for batch in loader:
            opt.zero_grad()
            if shard_route:  # the model takes and returns ShardTensors; the loss is on this rank's tile
                out = net(mwp.to_shard_tensor(batch["input"], loader, topo, name="input")).to_local()
                target = batch["target"]
            else:  # each target tile to a ShardTensor and back, as a PhysicsNeMo pipeline would hand it over
                target_st = mwp.to_shard_tensor(batch["target"], loader, topo, name="target")
                target = mwp.from_shard_tensor(target_st, loader, topo, name="target")
                out = net(batch["input"])
            local = ((out - target) ** 2).sum() / cells
            local.backward()
            for p in net.parameters():  # replicated weights: every rank's share adds to the gradient (both routes)
                dist.all_reduce(p.grad)
            opt.step()
            total = local.detach().clone()
            dist.all_reduce(total)
            loss, step = float(total), step + 1
            if topo.is_leader():
                print(f"step {step}: loss {loss:.6e}", flush=True)
            if step == args.steps:
                break
    if topo.is_leader():
        print(f"{topo.describe().splitlines()[1]}, route {args.route}\nrank 0 read {loader.bytes_read} bytes")
        print(f"final loss {loss:.17e}", flush=True)
    meshwise.shutdown()  # the process group is the manager's: its atexit cleanup() destroys it
    return loss


if __name__ == "__main__":
    main()
