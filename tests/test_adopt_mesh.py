"""Adopting the program's own DeviceMesh: dims, order and groups taken from it, checked against the process group.

Written as a PhysicsNeMo-style user would: the program initialises ``torch.distributed`` and builds its own mesh
(``("data_parallel", "model_parallel")``, model_parallel being spatial/domain parallel), then hands it to
``meshwise.init``. One launch of 4 gloo ranks runs every scenario; the oracles are the user's own mesh
(``get_local_rank``, ``get_group``), plain slicing of the full array and a one-process sum.
"""

from __future__ import annotations

import contextlib
import io
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import meshwise
from meshwise import launch
from meshwise.errors import TopologyError
from meshwise.testing import run_distributed

N, C, L = 8, 2, 9  # samples, channels, cells along the split axis (uneven over 2: 5 + 4)
ROLES = {"model_parallel": "split"}
SPEC = "data_parallel=2,model_parallel=2"


def _full() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((N, C, L))


def _groups_made() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)  # every ProcessGroup this process holds (torch's own registry)


def _refused(call, fragments: list[str]) -> str:
    try:
        call()
    except TopologyError as exc:
        text = str(exc)
        missing = [f for f in fragments if f not in text]
        assert not missing, (missing, text)
        assert meshwise.current() is None
        return text
    raise AssertionError(f"no TopologyError; expected one saying {fragments}")


class _GroupRecorder:
    """Records the process group of every batched point-to-point and gather call while active; calls go through."""

    NAMES = ("batch_isend_irecv", "all_gather", "all_to_all_single")

    def __init__(self) -> None:
        self.groups: list[object] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> _GroupRecorder:
        for name in self.NAMES:
            real = self._saved[name] = getattr(dist, name)

            def recorded(*args, _real=real, _name=name, **kwargs):
                if _name == "batch_isend_irecv":
                    self.groups += [op.group for op in args[0]]
                else:
                    self.groups.append(kwargs.get("group"))
                return _real(*args, **kwargs)

            setattr(dist, name, recorded)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)


def _refusals() -> dict:
    """Every refusal, on the user's own process group; nothing is left initialised by meshwise after each."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "model_parallel"))
    no_roles = _refused(
        lambda: meshwise.init(mesh),
        ["'model_parallel'", "'replica'", "'split'", "PhysicsNeMo", "Megatron", "roles={'model_parallel': 'split'}"],
    )
    # A rank tensor that is not row-major: meshwise would put ranks elsewhere than the mesh does.
    permuted = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("data_parallel", "model_parallel"))
    _refused(
        lambda: meshwise.init(permuted, roles=ROLES),
        ["row-major", "mesh_dim_names=('model_parallel', 'data_parallel')"],
    )
    _refused(lambda: meshwise.init(mesh["model_parallel"], roles=ROLES), ["2 of the world's 4 ranks", "root mesh"])
    _refused(lambda: meshwise.init(mesh, roles=ROLES, backend="nccl"), ["'gloo'", "drop backend="])
    os.environ["WORLD_SIZE"] = "8"  # a launcher that disagrees with the group the program made
    try:
        _refused(lambda: meshwise.init(mesh, roles=ROLES), [f"rank {rank} of 4", f"rank {rank} of 8"])
    finally:
        os.environ["WORLD_SIZE"] = "4"
    return {"no_roles": no_roles}


def _check_adopted(topo, mesh, order: tuple[str, ...]) -> dict:
    """Coordinates, groups, loader tiles, a metric and the halo exchange on an adopted mesh."""
    from torchmetrics import SumMetric

    from meshwise.data import ArrayDataset, Shard, mesh_dataloader
    from meshwise.metrics import MeshMetric
    from meshwise.parallel import halo_exchange

    assert topo.mesh is mesh and topo.dims == order and not topo.owns_group
    assert (topo.device, topo.backend) == (torch.device("cpu"), "gloo")
    assert topo.rank == dist.get_rank() and topo.world_size == dist.get_world_size()
    for d in order:
        assert topo.coordinate(d) == mesh.get_local_rank(d)
        assert topo.group(d) is mesh.get_group(d) is mesh[d].get_group()
        assert topo.group_ranks(d) == dist.get_process_group_ranks(mesh.get_group(d))
    assert topo.group(order) is dist.group.WORLD  # the metric group here is the world: no second world group
    dp, mp = mesh.get_local_rank("data_parallel"), mesh.get_local_rank("model_parallel")
    assert topo.data_rank == dp and topo.data_size == 2

    full = _full()
    loader = mesh_dataloader(
        ArrayDataset({"field": full}), topo, global_batch_size=4, mode="eval", parts={"field": Shard(1, halo=1)}
    )
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(L).chunk(2)]  # torch.chunk: 5 + 4 cells
    lo, hi = bounds[mp]
    # float64 by default: torchmetrics 1.9's Metric.to(device), which MeshMetric calls, resets set_dtype's dtype
    torch.set_default_dtype(torch.float64)
    metric = MeshMetric(SumMetric(), topo)
    tiles, halos, recorded = 0, 0, []
    for step, batch in enumerate(loader):
        index = batch["index"].tolist()
        assert index == [step * 4 + dp * 2 + j for j in range(2)], (index, dp)
        loaded = batch["field"]
        assert loaded.dtype == torch.float64, loaded.dtype
        assert torch.equal(loaded, torch.from_numpy(full[index, :, max(lo - 1, 0) : min(hi + 1, L)]))
        own = loader.parts["field"].strip_halo(loaded)
        assert torch.equal(own, torch.from_numpy(full[index, :, lo:hi]))
        tiles += 1
        metric.update(own.sum())
        with _GroupRecorder() as rec:
            padded = halo_exchange(own, topo, dim="model_parallel", axis=-1, halo=1)
        recorded += rec.groups
        expected = torch.from_numpy(np.pad(full[index], ((0, 0), (0, 0), (1, 1)))[:, :, lo : hi + 2])
        assert torch.equal(padded, expected)
        halos += 1
    assert recorded and all(g is mesh.get_group("model_parallel") for g in recorded), recorded
    total = metric.compute().item()
    assert abs(total - full.sum()) <= 1e-12 * abs(full).sum(), (total, full.sum())
    return {"tiles": tiles, "halos": halos, "table": topo.layout.table(), "describe": topo.describe()}


def _adopt_scenarios() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")  # the program's own group, as its distributed manager makes it
    out = _refusals()
    for order in [("data_parallel", "model_parallel"), ("model_parallel", "data_parallel")]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=order)
        before = _groups_made()
        topo = meshwise.init(mesh, roles=ROLES)
        made = _groups_made() - before
        out[order] = _check_adopted(topo, mesh, order)
        meshwise.shutdown()
        # The program's group and the mesh's groups outlive meshwise.
        value = torch.tensor([1.0])
        dist.all_reduce(value, group=mesh.get_group("data_parallel"))
        dist.all_reduce(value)
        assert dist.is_initialized() and value.item() == 8.0
        again = _groups_made()
        meshwise.init(mesh, roles=ROLES)  # a second adoption reuses every group, flattened ones included
        out[order]["groups_made"] = (made, _groups_made() - again)
        meshwise.shutdown()

    # No launcher variables: the process group is the only word on rank and size, and meshwise takes it.
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("model_parallel", "data_parallel"))
        topo = meshwise.init(mesh, roles=ROLES)
        out["bare"] = (topo.rank == dist.get_rank(), topo.world_size, topo.environment.launcher)
        meshwise.shutdown()
    finally:
        os.environ.update(saved)

    # Only torch.distributed was set up by the program: meshwise builds the mesh on the program's group.
    topo = meshwise.init(SPEC, roles=ROLES)
    out["spec"] = (topo.owns_group, topo.rank == dist.get_rank(), topo.coordinates())
    meshwise.shutdown()
    assert dist.is_initialized()
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_adopt_a_user_mesh_in_either_dim_order():
    results = run_distributed(_adopt_scenarios, 4, timeout=180)
    first = results[0]
    # The one-line fix is in the error, with both readings of the name.
    assert "roles={'model_parallel': 'replica'} or roles={'model_parallel': 'split'}" in first["no_roles"]
    for order in [("data_parallel", "model_parallel"), ("model_parallel", "data_parallel")]:
        for r in results:
            assert r[order]["tiles"] == r[order]["halos"] == N // 4
            assert r[order]["groups_made"] == (0, 0), r[order]["groups_made"]  # every group was the user's
        # meshwise describe plans the same table, without processes, as the adopted topology shows
        spec = ",".join(f"{d}=2" for d in order)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert (
                launch.main(["describe", "--mesh", spec, "--roles", "model_parallel=split", "--world-size", "4"]) == 0
            )
        assert printed.getvalue().strip() == first[order]["table"].strip()
        assert first[order]["describe"].startswith("backend gloo, device cpu, launcher ")
    assert [r["bare"] for r in results] == [(True, 4, "torch.distributed")] * 4
    for rank, r in enumerate(results):
        owns, agrees, coords = r["spec"]
        assert not owns and agrees and coords == {"data_parallel": rank // 2, "model_parallel": rank % 2}


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
