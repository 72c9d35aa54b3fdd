"""PhysicsNeMo interop: the DistributedManager's mesh adopted as the topology, tiles <-> ShardTensor, clear errors.

Written as a PhysicsNeMo user's script: start the manager, ``manager.initialize_mesh((-1, 2), ("data_parallel",
"model_parallel"))``, adopt it, read a 2-D field from ``.npy`` split unevenly (width 13 over 2) with a halo.
One launch of 4 gloo ranks; the oracles are PhysicsNeMo's own mesh and groups and ``full_tensor()``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("physicsnemo.domain_parallel")

import meshwise  # noqa: E402
from meshwise import physicsnemo as mwp  # noqa: E402
from meshwise.errors import DataError, TopologyError  # noqa: E402
from meshwise.testing import run_distributed  # noqa: E402

N, C, H, W = 8, 2, 5, 13  # width 13 over 2 model_parallel ranks: tiles of 7 and 6
ROLES = {"model_parallel": "split"}


def _error(call) -> str:
    try:
        call()
    except (TopologyError, DataError) as exc:
        return str(exc)
    raise AssertionError("no MeshwiseError")


def _heatnet():
    """The domain example's net (examples/domain/model.py), imported by path: its halo route, not rewritten."""
    import importlib.util
    import sys
    from pathlib import Path

    if "domain_model" not in sys.modules:
        file = Path(__file__).resolve().parents[1] / "examples" / "domain" / "model.py"
        spec = importlib.util.spec_from_file_location("domain_model", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules["domain_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["domain_model"]


def _train_gap(topo, loader, full: np.ndarray) -> tuple[float, float]:
    """Largest parameter difference after 2 SGD steps: the halo-route net on ShardTensor-routed tiles vs one
    process on the whole global batch (every rank computes the reference from the same seed)."""
    import torch.distributed as dist

    model = _heatnet()
    torch.manual_seed(0)
    cfg = model.HeatNetConfig(in_channels=C, out_channels=1, width=4, depth=2, halo=1)
    ref = model.HeatNet(cfg).double()
    net = model.HeatNet(cfg).double()
    net.load_state_dict(ref.state_dict())
    start = [p.detach().clone() for p in ref.parameters()]
    net.shard(topo, "model_parallel", axis=-1, input_halo=1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data_group = topo.group("data_parallel")
    for batch in loader:
        x = batch["field"]
        tile = mwp.from_shard_tensor(mwp.to_shard_tensor(x, loader, topo, name="field"), loader, topo, name="field")
        rows = [torch.empty_like(batch["index"]) for _ in range(topo.size("data_parallel"))]
        dist.all_gather(rows, batch["index"], group=data_group)
        xf = torch.from_numpy(full[torch.cat(rows).numpy()])
        numel = xf.shape[0] * H * W
        opt_ref.zero_grad()
        (((ref(xf) - xf[:, 1:2]) ** 2).sum() / numel).backward()
        opt_ref.step()
        opt.zero_grad()
        (((net(x) - tile[:, 1:2]) ** 2).sum() / numel).backward()
        for p in net.parameters():  # replicated params: the partial grads of every rank's cells sum
            dist.all_reduce(p.grad)
        opt.step()
    gap = max(float((a - b).abs().max()) for a, b in zip(net.parameters(), ref.parameters()))
    moved = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), start))
    return gap, moved


def _scenarios(path: str) -> dict:
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Shard as DShard

    from meshwise.data import ArrayDataset, Shard, mesh_dataloader

    out: dict = {}
    manager = mwp.initialize_manager()  # DistributedManager.initialize() raises ValueError on CPU
    assert DistributedManager.is_initialized() and manager.world_size == 4
    manager.initialize_mesh((-1, 2), ("data_parallel", "model_parallel"))
    out["no_roles"] = _error(lambda: mwp.adopt())
    out["mismatch"] = _error(lambda: mwp.adopt(roles=ROLES, mesh={"data_parallel": 4, "model_parallel": 1}))
    topo = mwp.adopt(roles=ROLES, mesh={"data_parallel": -1, "model_parallel": 2})
    pn_mesh = manager.global_mesh
    out["agree"] = (
        topo.data_rank == pn_mesh.get_local_rank("data_parallel")
        and topo.coordinate("model_parallel") == manager.global_mesh["model_parallel"].get_local_rank()
        and topo.group("model_parallel") is manager.global_mesh["model_parallel"].get_group()
        and topo.group_ranks("data_parallel")
        == dist.get_process_group_ranks(manager.global_mesh["data_parallel"].get_group())
    )

    full = np.load(path)
    loader = mesh_dataloader(
        ArrayDataset({"field": path}), topo, global_batch_size=4, mode="eval", parts={"field": Shard(2, halo=1)}
    )
    part = loader.parts["field"]
    checks, shapes = [], None
    for batch in loader:
        tile = part.strip_halo(batch["field"])
        st = mwp.to_shard_tensor(batch["field"], loader, topo, name="field")
        assert isinstance(st, ShardTensor)
        shapes = {m: [tuple(s) for s in v] for m, v in st._spec.sharding_shapes().items()}
        whole = st.full_tensor()  # test-only oracle: gathers the field
        back = mwp.from_shard_tensor(st, part, topo)
        checks.append(
            (
                torch.equal(whole, torch.from_numpy(full[batch["index"].numpy()])),
                torch.equal(back, tile),
                tuple(st.placements) == (DShard(3),),
                tuple(st.shape) == (2, C, H, W),
            )
        )
        local = tile.contiguous()
    out["checks"], out["shapes"], out["tile_width"] = checks, shapes, local.shape[-1]
    wrong = ShardTensor.from_local(
        local, manager.global_mesh["model_parallel"], [DShard(3)], sharding_shapes={0: [tuple(local.shape)] * 2}
    )  # claims even tiles: the global width would not be 13
    out["wrong_shapes"] = _error(lambda: mwp.from_shard_tensor(wrong, part, topo))
    wrong_axis = ShardTensor.from_local(
        local, manager.global_mesh["model_parallel"], [DShard(2)], sharding_shapes={0: [tuple(local.shape)] * 2}
    )
    out["wrong_axis"] = _error(lambda: mwp.from_shard_tensor(wrong_axis, part, topo))

    out["train_gap"] = _train_gap(topo, loader, full)

    # meshwise first: the manager gets the topology's mesh
    meshwise.shutdown()
    manager._global_mesh = None
    topo2 = meshwise.init(mesh="data_parallel=2,model_parallel=2", roles=ROLES)
    again = mwp.adopt()
    out["meshwise_first"] = again is topo2 and manager.global_mesh["model_parallel"].get_group() is topo2.group(
        "model_parallel"
    )
    meshwise.shutdown()
    return out


def test_adopt_and_shard_tensor_round_trip(tmp_path) -> None:
    path = str(tmp_path / "field.npy")
    np.save(path, np.random.default_rng(0).standard_normal((N, C, H, W)))
    results = run_distributed(_scenarios, 4, path, timeout=120)
    for rank, r in enumerate(results):
        assert "roles={'model_parallel': 'split'}" in r["no_roles"]
        assert "meshwise.physicsnemo.adopt" in r["no_roles"]
        assert "mesh={'data_parallel': 4, 'model_parallel': 1} was asked for" in r["mismatch"]
        assert r["agree"], rank
        assert len(r["checks"]) == N // 2 // 2 and all(all(c) for c in r["checks"]), r["checks"]
        assert r["shapes"] == {0: [(2, C, H, 7), (2, C, H, 6)]}  # uneven, declared without a gather
        assert r["tile_width"] == (7 if rank % 2 == 0 else 6)
        assert "does not match the tiles" in r["wrong_shapes"] and "redistribute" in r["wrong_shapes"]
        assert "placements" in r["wrong_axis"]
        assert r["meshwise_first"], rank
        gap, moved = r["train_gap"]
        assert gap <= 1e-12 and moved > 1e-3, r["train_gap"]  # float64: the halo route trains as one process does
    print("train gap, parameter change:", results[0]["train_gap"])


def test_bad_inputs_in_process() -> None:
    from physicsnemo.distributed import DistributedManager

    assert not DistributedManager.is_initialized()
    assert "initialize_manager()" in _error(lambda: mwp.adopt())
    assert "MeshDataLoader or a FieldPart" in _error(lambda: mwp._part_of(object(), "field"))
    assert "no meshwise topology" in _error(lambda: mwp.to_shard_tensor(torch.zeros(1, 3), object()))


def test_example_trains_the_same_on_4_processes_as_on_one(tmp_path) -> None:
    """examples/physicsnemo/train.py as `meshwise run` runs it, on forked ranks (`run_script`): 4 ranks
    (data_parallel=1 x model_parallel=4, tiles of 8, 8, 8 and 6 columns) on both routes (meshwise's halo exchange,
    PhysicsNeMo's ShardTensor convs) and one plain process; the float64 losses agree."""
    from pathlib import Path

    from meshwise.testing import run_script

    root = Path(__file__).resolve().parents[1]
    script = root / "examples" / "physicsnemo" / "train.py"
    four = ["--model-parallel", "4"]
    runs = {
        "halo": run_script(script, 4, [*four, "--out", str(tmp_path / "a")], cwd=root, timeout=240)[0],
        "shard": run_script(script, 4, [*four, "--route", "shard", "--out", str(tmp_path / "c")], cwd=root)[0],
        "one": run_script(script, 1, ["--out", str(tmp_path / "b")], cwd=root)[0],
    }

    def final(out: str) -> float:
        return float([line for line in out.splitlines() if line.startswith("final loss ")][-1].split()[-1])

    for route in ("halo", "shard"):
        out = runs[route]
        assert "data_parallel=1 x model_parallel=4 (world 4); " in out and f"route {route}" in out, out
        assert abs(final(out) - final(runs["one"])) <= 1e-12, (route, out, runs["one"])
