"""Domain parallelism: halo_exchange and the sharded HeatNet equal one process on the full field (forward, backward,
training), the data-set generator, and clear errors on bad input."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshwise.errors import MeshwiseError
from meshwise.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "domain"


def _load(name: str, file: str):
    """Import an example module under a unique name (the GPT example also has a ``model`` module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


domain_model = _load("domain_model", "model.py")
generate = _load("domain_generate", "generate.py")


def _train():
    """The training script (imports ignite and torchmetrics: only the launch that trains pays for them)."""
    return _load("domain_train", "train.py")


TOL = 1e-5


def _bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(start + size, n)


def _oracle(model, x: torch.Tensor) -> torch.Tensor:
    """The same net as plain one-process convolutions with padding=halo, zeros padding."""
    u0, h = x[:, :1], model.config.halo
    for i, conv in enumerate(model.convs):
        x = F.conv2d(x, conv.weight, conv.bias, padding=h)
        if i < len(model.convs) - 1:
            x = F.gelu(x)
    return u0 + x


def _max(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def _check_equivalence(topo, halos, width) -> dict:
    """Forward, input and parameter grads of the sharded net vs one process, per halo; halo_exchange alone."""
    import torch.distributed as dist

    from meshwise.parallel import halo_exchange

    k, i = topo.size("domain"), topo.coordinate("domain")
    lo, hi = _bounds(width, k, i)
    out = {}
    for h in halos:
        torch.manual_seed(100 + h)
        cfg = domain_model.HeatNetConfig(in_channels=2, out_channels=1, width=6, depth=3, halo=h)
        full_net = domain_model.HeatNet(cfg)
        x = torch.randn(2, 2, width, width, dtype=torch.float64)
        g = torch.randn(2, 1, width, width, dtype=torch.float64)
        full_net.double()
        # one-process reference (and the plain-conv oracle), computed on every rank from the same seed
        xf = x.clone().requires_grad_()
        yf = full_net(xf)
        assert _max(yf, _oracle(full_net, x)) < 1e-12
        (yf * g).sum().backward()
        ref_params = [p.grad.clone() for p in full_net.parameters()]
        full_net.zero_grad()

        for axis, input_halo in ((-1, 0), (-1, h), (-2, 0)):  # width with/without the loaded halo; height
            net = domain_model.HeatNet(cfg).double()
            net.load_state_dict(full_net.state_dict())
            net.shard(topo, "domain", axis=axis, input_halo=input_halo)
            rlo, rhi = (max(0, lo - h), min(width, hi + h)) if input_halo else (lo, hi)
            xt = x.narrow(axis, rlo, rhi - rlo).clone().requires_grad_()
            yt = net(xt)
            (yt * g.narrow(axis, lo, hi - lo)).sum().backward()
            grads = torch.cat([p.grad.flatten() for p in net.parameters()])
            dist.all_reduce(grads, group=topo.group("domain"))  # replicated params: partial grads sum over domain
            ref = torch.cat([p.flatten() for p in ref_params])
            # summed over domain, the input grads (owned cells and loaded halo cells) equal the full field's
            full_xg = torch.zeros_like(x)
            full_xg.narrow(axis, rlo, rhi - rlo).copy_(xt.grad)
            dist.all_reduce(full_xg, group=topo.group("domain"))
            out[(h, axis, input_halo)] = {
                "forward": _max(yt, yf.detach().narrow(axis, lo, hi - lo)),
                "input_grad": _max(full_xg, xf.grad),
                "owned_input_grad": _max(xt.grad.narrow(axis, lo - rlo, hi - lo), xf.grad.narrow(axis, lo, hi - lo))
                if not input_halo
                else 0.0,
                "param_grad": _max(grads, ref),
            }

        # halo_exchange alone against slicing the zero-padded full field, forward and gradient, along height
        field = torch.randn(3, width + 1, 5, dtype=torch.float64)
        n = field.shape[1]
        a, b = _bounds(n, k, i)
        tile = field[:, a:b].clone().requires_grad_()
        got = halo_exchange(tile, topo, "domain", axis=1, halo=h)
        padded = F.pad(field, [0, 0, h, h])
        want = padded[:, a : b + 2 * h]
        weights = [
            torch.randn(3, _bounds(n, k, r)[1] - _bounds(n, k, r)[0] + 2 * h, 5, dtype=torch.float64) for r in range(k)
        ]
        (got * weights[i]).sum().backward()
        fieldg = field.clone().requires_grad_()
        pad_g = F.pad(fieldg, [0, 0, h, h])
        total = sum((pad_g[:, _bounds(n, k, r)[0] : _bounds(n, k, r)[1] + 2 * h] * weights[r]).sum() for r in range(k))
        total.backward()
        out[("exchange", h)] = {"forward": _max(got.detach(), want), "grad": _max(tile.grad, fieldg.grad[:, a:b])}
    return out


def _check_errors(topo) -> list[str]:
    """Bad input: a dim that is not split, an unknown dim, a halo bigger than a tile (raised on every rank)."""
    from meshwise.parallel import halo_exchange

    messages = []
    x = torch.zeros(2, 3, 8)
    for kwargs in ({"dim": "dp"}, {"dim": "nope"}, {"halo": -1}, {"axis": 5}):
        try:
            halo_exchange(x, topo, **{"dim": "domain", **kwargs})
        except MeshwiseError as exc:
            messages.append(str(exc))
    # uneven tiles: 13 cells over 4 ranks -> 4, 4, 4, 1; a halo of 2 is too big for the last tile
    k, i = topo.size("domain"), topo.coordinate("domain")
    a, b = _bounds(13 if k == 4 else 3, k, i)
    try:
        halo_exchange(torch.zeros(2, b - a), topo, "domain", axis=-1, halo=2)
    except MeshwiseError as exc:
        messages.append(str(exc))
    return messages


def _domain4(topo) -> dict:
    return {"eq": _check_equivalence(topo, (1, 2), width=15), "errors": _check_errors(topo)}


def _assert_equivalence(results: list[dict]) -> None:
    for res in results:
        for key, errs in res["eq"].items():
            for what, err in errs.items():
                assert err <= TOL, (key, what, err)


def _assert_errors(results: list[dict]) -> None:
    for res in results:
        msgs = res["errors"]
        assert len(msgs) == 5, msgs
        assert "role 'batch', not 'split'" in msgs[0]
        assert "no dim 'nope'" in msgs[1]
        assert "halo must be an int >= 0" in msgs[2]
        assert "out of range" in msgs[3]
        assert "larger than a tile" in msgs[4] and "smaller halo" in msgs[4]


def test_sharded_net_equals_one_process_domain4():
    results = run_distributed(_domain4, 4, mesh={"dp": 1, "domain": 4}, timeout=120)
    _assert_equivalence(results)
    _assert_errors(results)


STEPS, GLOBAL_BATCH, SAMPLES, SIZE = 5, 4, 20, 16
CFG = dict(width=6, depth=3, halo=1, lr=1e-2)


def _train_rank(topo, data: str) -> dict:
    """dp=2 x domain=2: 5 training steps through mesh_dataloader tiles, parallelize and create_trainer; eval."""
    from ignite.engine import Events
    from torch.distributed.tensor import DTensor

    from meshwise.data import Shard, mesh_dataloader

    train = _train()
    ds = train.open_dataset(data, "train")
    model, _, loader, trainer, evaluator = train.build(topo, ds, global_batch_size=GLOBAL_BATCH, **CFG)
    losses, shapes = [], []

    @trainer.on(Events.ITERATION_COMPLETED)
    def _record(engine):
        losses.append(engine.state.output)

    @trainer.on(Events.ITERATION_STARTED)
    def _shape(engine):
        shapes.append((tuple(engine.state.batch["input"].shape), tuple(engine.state.batch["target"].shape)))

    trainer.run(loader, max_epochs=1)
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()  # no tensors through the queue
        for n, p in model.named_parameters()
    }
    eval_loader = mesh_dataloader(
        ds, topo, global_batch_size=6, mode="eval", parts={"input": Shard(2, halo=1), "target": Shard(2)}
    )
    evaluator.run(eval_loader)
    # the script's own path (train + held-out evaluation) on the same topology
    summary = train.main(["--data", data, "--epochs", "1", "--batch", "4", "--lr", "1e-2"], topology=topo)
    return {
        "summary": summary,
        "losses": losses,
        "params": params,
        "shapes": shapes,
        "bytes": loader.bytes_read,
        "mse": evaluator.state.metrics["mse"],
        "eq": _check_equivalence(topo, (1, 2), width=15),
        "errors": _check_errors(topo),
    }


def _reference(data: str, samples: int = SAMPLES, batch: int = GLOBAL_BATCH, spatial: int = 2) -> dict:
    """One process on the full fields, the same global batches (the sampler's order does not depend on dp)."""
    from meshwise.data import MeshSampler

    ds = _train().open_dataset(data, "train")
    x_all = torch.from_numpy(ds.sources["input"].array[...])
    y_all = torch.from_numpy(ds.sources["target"].array[...])
    torch.manual_seed(0)
    config = domain_model.HeatNetConfig(width=CFG["width"], depth=CFG["depth"], halo=CFG["halo"], spatial=spatial)
    net = domain_model.HeatNet(config)
    opt = torch.optim.Adam(net.parameters(), lr=CFG["lr"])
    losses = []
    for idx in MeshSampler(samples, batch, data_rank=0, data_size=1, seed=0):
        idx = torch.as_tensor(np.asarray(idx))
        loss = F.mse_loss(net(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        mse = float(((net(x_all) - y_all) ** 2).double().mean())
    return {"losses": losses, "params": dict(net.named_parameters()), "mse": mse}


def test_domain_training_dp2_domain2_equals_one_process(tmp_path):
    inputs, targets = generate.generate(SAMPLES, SIZE, steps=3, seed=7)
    # the diffusion operator conserves heat only up to the zero border: a weak oracle that the solver diffuses
    assert np.all(targets.sum(axis=(1, 2, 3)) <= inputs[:, 0].sum(axis=(1, 2)) + 1e-3)
    assert np.abs(targets[:, 0] - inputs[:, 0]).max() > 1e-3
    generate.write(tmp_path, "train", inputs, targets, chunk_width=2, meta={"size": SIZE})
    generate.write(tmp_path, "test", inputs[:6], targets[:6], chunk_width=2, meta={"size": SIZE})
    assert np.array_equal(np.load(tmp_path / "train_input.npy"), inputs)

    results = run_distributed(_train_rank, 4, str(tmp_path), mesh={"dp": 2, "domain": 2}, timeout=150)
    ref = _reference(str(tmp_path))
    _assert_equivalence(results)
    _assert_errors(results)
    full = inputs[0].nbytes + targets[0].nbytes
    x0, y0 = torch.from_numpy(inputs[:6, :1]), torch.from_numpy(targets[:6])
    persistence = float(((x0 - y0).double() ** 2).mean())
    for r, res in enumerate(results):
        summary = res["summary"]
        assert summary["steps"] == STEPS and np.isfinite(summary["loss"]) and np.isfinite(summary["mse"])
        assert abs(summary["mse_persistence"] - persistence) <= 1e-6 * persistence, (summary, persistence)
        assert summary["mse"] == results[0]["summary"]["mse"]
        assert len(res["losses"]) == STEPS == len(ref["losses"])
        assert np.allclose(res["losses"], ref["losses"], rtol=1e-5, atol=1e-7), (res["losses"], ref["losses"])
        for name, p in ref["params"].items():
            assert float(np.abs(res["params"][name] - p.detach().numpy()).max()) <= TOL, (r, name)
        assert abs(res["mse"] - ref["mse"]) <= 1e-6 * max(1.0, ref["mse"])
        # each rank holds 2 samples of its 8 columns (+1 loaded halo column of the input)
        assert res["shapes"][0] == ((2, 2, SIZE, 9), (2, 1, SIZE, 8))
        # bytes: chunks of 2 columns; the input tile with its halo touches 10 of 16 columns, the target 8
        expected = STEPS * 2 * (inputs[0].nbytes * 10 // 16 + targets[0].nbytes * 8 // 16)
        assert res["bytes"] == expected, (res["bytes"], expected, full)


# ---------------------------------------------------------------- grids of tiles: several split dims at once


def _grid_conv(topo, dims: tuple[str, ...], halos=(1, 2)) -> dict:
    """Two conv3d layers on a [2, 2, 5, 7, 6] volume sharded over ``dims`` (the last spatial axes), exchanging halos
    over all of them in one call, against one process's conv3d(padding=halo): forward, input and weight grads."""
    import torch.distributed as dist

    from meshwise.data import chunk_bounds
    from meshwise.parallel import halo_exchange

    shape = (2, 2, 5, 7, 6)
    axes = tuple(range(-len(dims), 0))
    tile = [slice(None)] * 5
    for d, a in zip(dims, axes):
        tile[a] = slice(*chunk_bounds(shape[a], topo.size(d), topo.coordinate(d)))
    tile = tuple(tile)
    out = {}
    for h in halos:
        g = torch.Generator().manual_seed(10 + h)
        k = 2 * h + 1
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        w1 = torch.randn(3, 2, k, k, k, dtype=torch.float64, generator=g)
        w2 = torch.randn(1, 3, k, k, k, dtype=torch.float64, generator=g)
        gout = torch.randn(2, 1, *shape[2:], dtype=torch.float64, generator=g)
        ref = [t.clone().requires_grad_() for t in (x, w1, w2)]
        yf = F.conv3d(F.gelu(F.conv3d(ref[0], ref[1], padding=h)), ref[2], padding=h)
        (yf * gout).sum().backward()

        def layer(t, w, h=h):
            t = F.pad(t, [0 if -1 - i in axes else h for i in range(3) for _ in (0, 1)])  # unsharded axes: zeros
            return F.conv3d(halo_exchange(t, topo, dims, axes, h), w)

        mine = [x[tile].clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()]
        yt = layer(F.gelu(layer(mine[0], mine[1])), mine[2])
        (yt * gout[tile]).sum().backward()
        wgrad = torch.cat([mine[1].grad.flatten(), mine[2].grad.flatten()])
        dist.all_reduce(wgrad, group=topo.group(topo.metric_dims))  # partial weight grads sum over the tiles
        out[h] = {
            "forward": _max(yt, yf.detach()[tile]),
            "input_grad": _max(mine[0].grad, ref[0].grad[tile]),
            "weight_grad": _max(wgrad, torch.cat([ref[1].grad.flatten(), ref[2].grad.flatten()])),
            "tile": tuple(mine[0].shape),
        }
    return out


def _largest_halo(topo) -> dict:
    """9 cells over y=2 (tiles 5, 4): halo 4 equals the padded field's slice, halo 5 is refused on every rank, as
    the loader's Shard(axis, halo) allows (tests/test_data_edges.py)."""
    from meshwise.data import chunk_bounds
    from meshwise.errors import ParallelError
    from meshwise.parallel import halo_exchange

    field = torch.arange(2 * 9, dtype=torch.float64).reshape(2, 9)
    lo, hi = chunk_bounds(9, 2, topo.coordinate("y"))
    got = halo_exchange(field[:, lo:hi].clone(), topo, "y", axis=-1, halo=4)
    try:
        halo_exchange(field[:, lo:hi].clone(), topo, "y", axis=-1, halo=5)
        refused = ""
    except ParallelError as exc:
        refused = str(exc)
    return {"ok": _max(got, F.pad(field, [4, 4])[:, lo : hi + 8]), "refused": refused}


def _placements(topo) -> dict:
    """Parts from DTensor placements equal distribute_tensor(...).to_local() on an uneven split (5 x 7 over 2 x 2)."""
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    from meshwise.data import mesh_dataloader

    full = torch.randn(4, 2, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    placements = [DShard(0), DShard(2), DShard(3)]  # dp=1 x x=2 x y=2: the batch over dp, the field over x, y

    class Net(torch.nn.Module):
        input_parts = {"input": (topo.mesh, placements)}

    ld = mesh_dataloader({"input": full}, topo, global_batch_size=4, mode="eval", parts=Net())
    (batch,) = list(ld)
    want = distribute_tensor(full, topo.mesh, placements).to_local()
    return {"equal": torch.equal(batch["input"], want), "shape": tuple(want.shape)}


GRID_SAMPLES, GRID_SIZE, GRID_BATCH = 8, 8, 4


def _grid_rank(topo, data: str) -> dict:
    """dp=1 x x=2 x y=2: the 3-D example trains through tiles the loader takes from the model; grid halo checks."""
    from ignite.engine import Events
    from torch.distributed.tensor import DTensor

    from meshwise.data import Shard, mesh_dataloader

    checks = {
        "grid": _grid_conv(topo, ("x", "y")),
        "largest_halo": _largest_halo(topo),
        "placements": _placements(topo),
    }
    train = _train()
    ds = train.open_dataset(data, "train")
    model, _, loader, trainer, _ = train.build(topo, ds, global_batch_size=GRID_BATCH, **CFG)
    written = {
        "input": [Shard(-2, halo=1, dim="x"), Shard(-1, halo=1, dim="y")],
        "target": [Shard(-2, dim="x"), Shard(-1, dim="y")],
    }
    same_parts = loader.parts == mesh_dataloader(ds, topo, global_batch_size=GRID_BATCH, parts=written).parts
    losses, shapes = [], []
    trainer.on(Events.ITERATION_COMPLETED)(lambda e: losses.append(e.state.output))
    trainer.on(Events.ITERATION_STARTED)(lambda e: shapes.append(tuple(e.state.batch["input"].shape)))
    trainer.run(loader, max_epochs=1)
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
        for n, p in model.named_parameters()
    }
    summary = train.main(["--data", data, "--epochs", "1", "--batch", str(GRID_BATCH), "--lr", "1e-2"], topology=topo)
    return {
        "same_parts": same_parts,
        "losses": losses,
        "shapes": shapes,
        "params": params,
        "bytes": loader.bytes_read,
        "summary": summary,
        **checks,
    }


@pytest.mark.slow
def test_grid_2x2_3d_example_parts_from_model_and_placements(tmp_path):
    inputs, targets = generate.generate(GRID_SAMPLES, GRID_SIZE, steps=2, seed=5, spatial=3)
    assert np.abs(targets[:, 0] - inputs[:, 0]).max() > 1e-3
    generate.write(tmp_path, "train", inputs, targets, chunk_width=2, meta={})
    generate.write(tmp_path, "test", inputs[:4], targets[:4], chunk_width=2, meta={})
    mesh, roles = {"dp": -1, "x": 2, "y": 2}, {"x": "split", "y": "split"}
    results = run_distributed(_grid_rank, 4, str(tmp_path), mesh=mesh, roles=roles, timeout=200)
    ref = _reference(str(tmp_path), GRID_SAMPLES, GRID_BATCH, spatial=3)
    for r, res in enumerate(results):
        assert res["same_parts"], "the loader's parts come from the model"
        assert res["shapes"][0] == (GRID_BATCH, 2, GRID_SIZE, 5, 5), res["shapes"]  # 4 x 4 tile + 1 halo cell inside
        assert np.allclose(res["losses"], ref["losses"], rtol=1e-5, atol=1e-7), (res["losses"], ref["losses"])
        for name, p in ref["params"].items():
            assert float(np.abs(res["params"][name] - p.detach().numpy()).max()) <= TOL, (r, name)
        assert np.isfinite(res["summary"]["mse"]) and res["summary"]["mse"] == results[0]["summary"]["mse"]
        # chunks of 2 x 2 cells on (H, W): the input tile with its halo (5 x 5) touches 6 x 6 of 8 x 8, the target 4 x 4
        steps = GRID_SAMPLES // GRID_BATCH
        expected = steps * GRID_BATCH * (inputs[0].nbytes * 36 // 64 + targets[0].nbytes * 16 // 64)
        assert res["bytes"] == expected, (res["bytes"], expected)
        for h, errs in res["grid"].items():
            assert max(errs["forward"], errs["input_grad"], errs["weight_grad"]) <= 1e-12, (r, h, errs)
        assert res["largest_halo"]["ok"] == 0.0
        assert "halo 5 is larger than a tile" in res["largest_halo"]["refused"], res["largest_halo"]
        assert res["placements"]["equal"], res["placements"]
    assert {res["placements"]["shape"] for res in results} == {(4, 2, 3, 4), (4, 2, 3, 3), (4, 2, 2, 4), (4, 2, 2, 3)}


def _grid8(topo) -> dict:
    return _grid_conv(topo, ("x", "y", "z"))


def test_halo_exchange_2x2x2_grid_matches_one_process():
    roles = {"x": "split", "y": "split", "z": "split"}
    results = run_distributed(_grid8, 8, mesh={"x": 2, "y": 2, "z": 2}, roles=roles, timeout=200)
    tiles = set()
    for r, res in enumerate(results):
        for h, errs in res.items():
            assert max(errs["forward"], errs["input_grad"], errs["weight_grad"]) <= 1e-12, (r, h, errs)
        tiles.add(res[1]["tile"])
    assert tiles == {(2, 2, a, b, c) for a in (3, 2) for b in (4, 3) for c in (3,)}  # 5 x 7 x 6 over 2 x 2 x 2
