"""PhysicsNeMo's two routes (its ShardTensor ops, meshwise's halo exchange) train like one process, and what is refused.

Written as a PhysicsNeMo user writes a script: the ``DistributedManager`` starts, ``manager.initialize_mesh((2, 2),
("data_parallel", "model_parallel"))`` is adopted, tiles become ``ShardTensor``s with uneven sharding shapes
(width 13 over 2 ranks: 7 and 6), plain float64 conv weights. One launch of 4 gloo ranks; the oracle is the same
net in one process on the whole global batch (every rank computes it from the same seed).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("physicsnemo.domain_parallel")

from meshwise.testing import run_distributed  # noqa: E402

B, C, H, W = 4, 2, 5, 13  # global batch 4 over data_parallel=2; width 13 over model_parallel=2: tiles of 7 and 6
STEPS, LR = 2, 0.5


class Net(torch.nn.Module):
    """conv -> tanh -> conv (3x3, zero padding 1). ``route``: "one" (one process, whole fields), "shard"
    (PhysicsNeMo's ShardTensor convs: ShardTensor in, ShardTensor out), "halo" (meshwise's halo_exchange on
    plain tiles) or "mix" (the first conv on ShardTensors, the second by halo, and the second conv's weights used
    once more on ShardTensors: one parameter on both routes)."""

    def __init__(self, route: str = "one", topo=None, shard=None) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank and in the reference
        self.conv1 = torch.nn.Conv2d(C, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 1, 3, padding=1)
        self.double()
        self.route, self.topo, self.shard = route, topo, shard

    def _halo(self, conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from meshwise.parallel import halo_exchange

        x = halo_exchange(x, self.topo, "model_parallel", axis=-1, halo=1)
        return F.conv2d(x, conv.weight, conv.bias, padding=(1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.route == "one":
            h = torch.tanh(self.conv1(x))
            return self.conv2(h) + (0.5 * self.conv2(h) if self.topo == "mix" else 0)
        if self.route == "shard":  # x is a ShardTensor; so is the result
            return self.conv2(torch.tanh(self.conv1(x)))
        if self.route == "halo":
            return self._halo(self.conv2, torch.tanh(self._halo(self.conv1, x)))
        h = torch.tanh(self.conv1(self.shard(x))).to_local()  # "mix": plain tile in, plain tile out
        return self._halo(self.conv2, h) + 0.5 * self.conv2(self.shard(h)).to_local()


def _gap(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _reference(data: list, mix: bool) -> list[torch.Tensor]:
    """One process: SGD on the mean over every cell of each whole global batch."""
    import torch.nn.functional as F

    net = Net("one", "mix" if mix else None)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for x, t in data:
        opt.zero_grad()
        F.mse_loss(net(x), t).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _scenarios() -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Shard as DShard

    import meshwise
    from meshwise import physicsnemo as mwp
    from meshwise.data.parts import chunk_bounds
    from meshwise.errors import MeshwiseError, ParallelError

    manager = mwp.initialize_manager()
    manager.initialize_mesh((2, 2), ("data_parallel", "model_parallel"))
    d, m = (manager.global_mesh[dim].get_local_rank() for dim in ("data_parallel", "model_parallel"))
    lo, hi = chunk_bounds(W, 2, m)
    rows = slice(2 * d, 2 * d + 2)
    mp_mesh = manager.global_mesh["model_parallel"]

    def shard(local: torch.Tensor):
        shapes = {0: [(*local.shape[:-1], b - a) for a, b in (chunk_bounds(W, 2, c) for c in range(2))]}
        return ShardTensor.from_local(local, mp_mesh, [DShard(3)], sharding_shapes=shapes)

    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS):
        x = torch.randn(B, C, H, W, generator=gen, dtype=torch.float64)
        data.append((x, torch.sin(3 * x[:, :1]) + 0.1 * x[:, 1:]))
    index = torch.arange(B)[rows]  # the samples' ids: split ranks hold parts of the same samples
    tiles = [
        {"input": x[rows, ..., lo:hi].clone(), "target": t[rows, ..., lo:hi].clone(), "index": index + k * B}
        for k, (x, t) in enumerate(data)
    ]
    start = [p.detach().clone() for p in Net().parameters()]
    ref, ref_mix = _reference(data, False), _reference(data, True)
    out: dict = {"moved": _gap(ref, start)}

    # PhysicsNeMo's F.mse_loss on uneven ShardTensors, as it dispatches before meshwise (adopt) registers its losses
    y_st, t_st = shard(tiles[0]["target"] * 2), shard(tiles[0]["target"])
    whole = F.mse_loss(data[0][1][rows] * 2, data[0][1][rows])
    out["mse_physicsnemo"] = abs(float(F.mse_loss(y_st, t_st).full_tensor()) - float(whole))
    topo = mwp.adopt(roles={"model_parallel": "split"})
    out["skipped"] = mwp.register_shard_ops()  # PhysicsNeMo's own ops (on CPU without its kNN patch) + exact losses
    mwp.require_shard_ops()

    # the routes through parallelize and create_trainer: F.mse_loss on this rank's tile, weighted by its cells
    for route in ("shard", "halo", "mix"):
        model = meshwise.parallelize(Net(route, topo, shard), topo, dp="replicate")
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def forward(net, batch, route=route):
            if route == "shard":  # PhysicsNeMo's habit: the model takes and returns ShardTensors
                return net(shard(batch["input"])).to_local()
            return net(batch["input"])

        trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo, loss_weight="tokens", forward=forward)
        trainer.run(tiles, max_epochs=1)
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        out[route] = _gap(params, ref_mix if route == "mix" else ref)

    # the example's habit: a plain loop, the loss over the global count, gradients all-reduced over the world
    for shared in (True, False):
        net = Net("shard", topo)
        if shared:
            mwp.share_gradients(net, topo)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for batch in tiles:
            opt.zero_grad()
            y = net(shard(batch["input"])).to_local()
            (((y - batch["target"]) ** 2).sum() / (B * H * W)).backward()
            for p in net.parameters():
                dist.all_reduce(p.grad)
            opt.step()
        out["habit_shared" if shared else "habit_unshared"] = _gap(net.parameters(), ref)

    out.update(_losses(shard, tiles, data, rows, lo, hi))
    out.update(_refusals(topo, shard, tiles, manager, MeshwiseError, ParallelError))
    meshwise.shutdown()
    return out


def _losses(shard, tiles, data, rows, lo, hi) -> dict:
    """F.mse_loss and F.l1_loss on uneven ShardTensors (meshwise's handlers): value and weight gradients in
    PhysicsNeMo's own convention (no share_gradients: its sums) against one process on this data rank's rows."""
    import torch.nn.functional as F

    from meshwise.errors import ParallelError

    out: dict = {}
    x_full, t_full = data[0][0][rows], data[0][1][rows]
    for loss in (F.mse_loss, F.l1_loss):
        ref, net = Net(), Net("shard")
        expected = loss(ref(x_full), t_full)
        expected.backward()
        got = loss(net(shard(tiles[0]["input"])), shard(tiles[0]["target"]))
        value = abs(float(got.full_tensor()) - float(expected))
        got.full_tensor().backward()
        out[loss.__name__] = max(value, _gap([p.grad for p in net.parameters()], [p.grad for p in ref.parameters()]))
    for name, call in {
        "cross_entropy": lambda: F.cross_entropy(shard(tiles[0]["input"]), shard(tiles[0]["input"].softmax(1))),
        "mixed": lambda: F.mse_loss(shard(tiles[0]["target"]), tiles[0]["target"]),
    }.items():
        try:
            call()
            out[f"refused_{name}"] = "not refused"
        except ParallelError as exc:
            out[f"refused_{name}"] = str(exc)
    return out


def _refusals(topo, shard, tiles, manager, MeshwiseError, ParallelError) -> dict:
    import torch.nn.functional as F
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Replicate, Shard

    import meshwise
    from meshwise import physicsnemo as mwp

    out: dict = {}
    # a ShardTensor loss reaching the trainer: the split ranks would weigh one shared value by their own counts
    model = meshwise.parallelize(Net("shard", topo), topo, dp="replicate")
    trainer = meshwise.create_trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        lambda o, t: ((o - shard(t)) ** 2).mean(),
        topo,
        loss_weight="tokens",
        forward=lambda net, batch: net(shard(batch["input"])),
    )
    try:
        trainer.run(tiles[:1], max_epochs=1)
        out["loss_refused"] = "not refused"
    except MeshwiseError as exc:
        out["loss_refused"] = str(exc)
    # ShardTensor parameters (replicated over model_parallel): not plain, refused before any placement
    net = Net("shard", topo)
    mesh = manager.global_mesh["model_parallel"]
    weight = ShardTensor.from_local(net.conv1.weight.detach(), mesh, [Replicate()], sharding_shapes="infer")
    net.conv1.weight = torch.nn.Parameter(weight)
    try:
        meshwise.parallelize(net, topo, dp="replicate")
        out["param_refused"] = "not refused"
    except ParallelError as exc:
        out["param_refused"] = str(exc)
    # a ShardTensor split over data_parallel (a batch dim): PhysicsNeMo would sum gradients over it
    net = mwp.share_gradients(Net("shard", topo), topo)
    dp_mesh = manager.global_mesh["data_parallel"]
    x = tiles[0]["input"]
    x_dp = ShardTensor.from_local(x, dp_mesh, [Shard(0)], sharding_shapes={0: [tuple(x.shape)] * 2})
    try:
        F.conv2d(x_dp, net.conv1.weight, net.conv1.bias, padding=1)
        net(x_dp)
        out["dim_refused"] = "not refused"
    except ParallelError as exc:
        out["dim_refused"] = str(exc)
    return out


def test_both_routes_train_like_one_process() -> None:
    results = run_distributed(_scenarios, 4, timeout=240)
    print({k: v for k, v in results[0].items() if not isinstance(v, str)})
    for rank, r in enumerate(results):
        assert r["moved"] > 1e-2, r
        # PhysicsNeMo's dispatch of F.mse_loss averages the tiles' means: the bug meshwise's handler replaces
        assert r["mse_physicsnemo"] > 1e-6, r
        assert all(s.startswith("knn ") for s in r["skipped"]), r["skipped"]  # only the kNN patch needs timm
        for route in ("shard", "halo", "mix"):  # float64: one process's parameters after 2 SGD steps
            assert r[route] <= 1e-12, (rank, route, r[route])
        assert r["habit_shared"] <= 1e-12, r["habit_shared"]
        assert r["habit_unshared"] > 1e-3, r["habit_unshared"]  # PhysicsNeMo's sums, all-reduced again
        assert r["mse_loss"] <= 1e-12 and r["l1_loss"] <= 1e-12, r
        assert "MeshMetric" in r["refused_cross_entropy"] and "((o - t) ** 2).mean()" in r["refused_cross_entropy"]
        assert "to_local()" in r["refused_mixed"], r["refused_mixed"]
        assert "loss_fn returned a ShardTensor" in r["loss_refused"] and ".to_local()" in r["loss_refused"], r
        assert "parameter 'conv1.weight' is a ShardTensor" in r["param_refused"], r["param_refused"]
        assert "'data_parallel'" in r["dim_refused"] and "not a split dim" in r["dim_refused"], r["dim_refused"]
