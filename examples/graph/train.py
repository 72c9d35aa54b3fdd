"""A message-passing network on an unstructured 2-D mesh, split over ranks by node sets (docs/graphs.md).

    meshwise run --nproc-per-node 4 --mesh dp=2,domain=2 examples/graph/train.py
    meshwise run --nproc-per-node 4 --mesh domain=4 examples/graph/train.py --steps 12   # resumes, 4 parts now
    python examples/graph/train.py --run-dir runs/graph-one                               # one process

The data (written on the first run into --data): a jittered grid triangulated into an unstructured mesh of
--side x --side nodes whose ids are shuffled, and a field of two features evolving by diffusion over the graph,
stored node-major (``u.npy``: [nodes, time, features]). Each rank takes the node part of its ``domain``
coordinate (a Morton-curve partition with a 1-hop halo), reads only those rows, and serves its part of each
time step through ``mesh_dataloader`` (a map-style dataset of its own rows: the global cursor, checkpoints and
resumes on any mesh come with it). The model's first layer runs on the loaded halo, the second gets its halo
through ``node_halo_exchange``; on one process the part is the whole graph, and the numbers are the same.
Checkpoints every step into --run-dir; run it again, on any mesh, and it goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

import meshwise
from meshwise.data import mesh_dataloader, node_parts, read_nodes
from meshwise.engine import Checkpointing
from meshwise.parallel import node_halo_exchange

F, H = 2, 8  # features, width


def generate(folder: Path, side: int, steps: int, seed: int = 0) -> None:
    """The mesh (edges.npy [2, E], coords.npy [N, 2]) and the field (u.npy [N, steps, F]), written once."""
    rng = np.random.default_rng(seed)
    i, j = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    grid = np.stack([i.ravel(), j.ravel()], axis=1).astype(np.float64)
    perm = rng.permutation(len(grid))  # node k sits at grid point perm[k]: ids say nothing of position
    ids = np.argsort(perm)
    g = np.arange(side * side).reshape(side, side)
    a, b, c, d = g[:-1, :-1].ravel(), g[1:, :-1].ravel(), g[:-1, 1:].ravel(), g[1:, 1:].ravel()
    pairs = np.concatenate([np.stack(p) for p in ((a, b), (b, c), (c, a), (b, d), (d, c))], axis=1)
    edges = ids[np.unique(np.concatenate([pairs, pairs[::-1]], axis=1), axis=1)]
    coords = grid[perm] + rng.uniform(-0.3, 0.3, grid.shape)
    n = len(coords)
    degree = np.bincount(edges[1], minlength=n).astype(np.float64)[:, None]
    u = np.stack([np.sin(coords[:, 0] * 0.4) * np.cos(coords[:, 1] * 0.3), np.exp(-0.02 * (coords**2).sum(1))], 1)
    frames = [u]
    for _ in range(steps - 1):  # diffusion over the graph: each node moves towards its neighbours' mean
        mean = np.zeros_like(u)
        np.add.at(mean, edges[1], u[edges[0]])
        u = u + 0.3 * (mean / degree - u)
        frames.append(u)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "edges.npy", edges)
    np.save(folder / "coords.npy", coords)
    np.save(folder / "u.npy", np.stack(frames, axis=1))


class PartSamples(torch.utils.data.Dataset):
    """This rank's part of each sample t -> t + 1: input on owned + halo nodes, target on owned nodes."""

    def __init__(self, rows: np.ndarray, owned: int) -> None:
        self.rows, self.owned = torch.from_numpy(np.ascontiguousarray(rows)), owned

    def __len__(self) -> int:
        return self.rows.shape[1] - 1

    def __getitem__(self, t: int) -> dict[str, torch.Tensor]:
        return {"input": self.rows[:, t], "target": self.rows[: self.owned, t + 1]}


class MessagePassing(nn.Module):
    """Encode, two message-passing layers (sum of messages over in-edges), decode: a MeshGraphNet in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.msg = nn.Linear(F, H), nn.Linear(H, H)
        self.upd, self.dec = nn.Linear(2 * H, H), nn.Linear(H, F)

    def place(self, part, exchange) -> None:
        self.owned, self.exchange = len(part.owned), exchange
        self.src, self.dst = torch.from_numpy(part.src), torch.from_numpy(part.dst)

    def layer(self, h: torch.Tensor) -> torch.Tensor:
        m = h.new_zeros(h.shape[0], self.owned, H).index_add(1, self.dst, self.msg(h)[:, self.src])
        return torch.tanh(self.upd(torch.cat([h[:, : self.owned], m], dim=-1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(torch.tanh(self.enc(x)))  # the loaded halo is enough for the first layer
        return x[:, : self.owned] + self.dec(self.layer(self.exchange(h)))  # the second's halo is exchanged


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/graph")
    p.add_argument("--run-dir", default="runs/graph")
    p.add_argument("--side", type=int, default=48, help="nodes per side of the mesh (side * side nodes)")
    p.add_argument("--time-steps", type=int, default=41)
    p.add_argument("--steps", type=int, default=8, help="training steps of the whole run")
    p.add_argument("--batch", type=int, default=8, help="global batch size (time steps)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default=None, help="a JSON file for the final step and weights (rank 0)")
    args = p.parse_args(argv)

    topo = meshwise.init(os.environ.get("MESHWISE_MESH") or "dp=-1,domain=2")
    data = Path(args.data)
    if topo.rank == 0 and not (data / "u.npy").exists():
        generate(data, args.side, args.time_steps)
    topo.barrier()
    edges, coords = np.load(data / "edges.npy"), np.load(data / "coords.npy")
    split = "domain" if "domain" in topo.sizes else None
    size, coordinate = (topo.size(split), topo.coordinate(split)) if split else (1, 0)
    part = node_parts(edges, len(coords), size, coords=coords)[coordinate]
    rows, nbytes = read_nodes(np.load(data / "u.npy", mmap_mode="r"), part)  # owned + halo rows only

    torch.manual_seed(0)  # the same weights on every rank
    model = MessagePassing().double()
    model.place(part, (lambda h: node_halo_exchange(h, part, topo, split, axis=1)) if split else (lambda h: h))
    model = meshwise.parallelize(model, topo, dp="replicate")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = mesh_dataloader(PartSamples(rows, len(part.owned)), topo, global_batch_size=args.batch)
    # each rank's loss weighted by its owned nodes: the mean over every node of every sample, as on one process
    trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo, loss_weight="tokens")
    ckpt = meshwise.Checkpointer(Path(args.run_dir) / "checkpoints", topo, keep_last=2, verbose=False)
    Checkpointing(ckpt, every_iterations=1, model=model, optimizer=opt, loader=loader).attach(trainer)
    trainer.run(loader, max_iters=args.steps)  # resumes from the latest checkpoint, on any mesh
    ckpt.close()
    weights = torch.cat(
        [v.full_tensor().flatten() if hasattr(v, "full_tensor") else v.flatten() for v in model.state_dict().values()]
    )
    if topo.is_leader():
        mesh = " x ".join(f"{d}={s}" for d, s in topo.sizes.items())
        print(
            f"mesh {mesh}: {len(coords)} nodes, part {coordinate} owns {len(part.owned)} (+{len(part.halo)} halo), "
            f"read {nbytes} of {np.load(data / 'u.npy', mmap_mode='r').nbytes} bytes; step {trainer.state.iteration}, "
            f"loss {trainer.state.output!r}, weights sum {float(weights.sum())!r}",
            flush=True,
        )
    out = {"step": trainer.state.iteration, "weights": weights.tolist(), "bytes": nbytes}
    if args.out and topo.is_leader():
        Path(args.out).write_text(json.dumps(out))
    meshwise.shutdown()
    return out


if __name__ == "__main__":
    main()
