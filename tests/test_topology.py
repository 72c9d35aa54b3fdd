"""Topology: layout arithmetic against DeviceMesh, groups on real gloo processes, bad input, launcher."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshwise
from meshwise.errors import CollectiveTimeoutError, MeshwiseError, TopologyError
from meshwise.testing import DistributedFailure, run_command, run_distributed
from meshwise.topology import Layout, detect_environment

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# (mesh, roles, world size): every role appears, and batch dims sit in several positions.
MESHES = [
    ({"dp": 1}, None, 1),
    ({"dp": 4}, None, 4),
    ({"dp": 2, "tp": 2}, None, 4),
    ({"dp": 4, "tp": 1}, None, 4),
    ({"dp": 1, "tp": 4}, None, 4),
    ({"dp": 2, "cp": 2, "tp": 2}, None, 8),
    ({"tp": 2, "dp": 2}, None, 4),  # batch dim last
    ({"pp": 2, "dp_replicate": 2, "dp_shard": 2}, None, 8),  # two batch dims after a stage dim
    ({"x": 2, "y": 2, "z": 2}, {"x": "replica", "y": "batch", "z": "split"}, 8),
]


def _oracle_coords(sizes, rank):
    """Row-major coordinates computed independently of Layout (numpy-style unravel)."""
    return list(torch.arange(int(torch.tensor(sizes).prod())).reshape(sizes).eq(rank).nonzero()[0].tolist())


@pytest.mark.parametrize("mesh,roles,world", MESHES)
def test_layout_groups_partition_the_world(mesh, roles, world):
    layout = Layout.resolve(mesh, world, roles)
    for n in range(1, len(layout.dims) + 1):
        for dims in itertools.combinations(layout.dims, n):
            groups = layout.groups(dims)
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(world)), (dims, groups)  # disjoint and covering
            assert all(len(g) == layout.size(dims) for g in groups)
            for g in groups:  # inside a group only ``dims`` vary, and the order is the flattened coordinate
                assert [layout.coordinate(r, dims) for r in g] == list(range(len(g)))
                others = [d for d in layout.dims if d not in dims]
                assert len({tuple(layout.coordinates(r)[d] for d in others) for r in g}) == 1
    batch = layout.dims_with("batch")
    for rank in range(world):
        assert list(layout.coordinates(rank).values()) == _oracle_coords(list(layout.sizes), rank)
    data_ranks = {layout.coordinate(r, batch) for r in range(world)}
    assert data_ranks == set(range(layout.size(batch)))


def test_infer_and_roles():
    layout = Layout.resolve("dp=-1,tp=2", 8)
    assert layout.sizes == (4, 2) and layout.roles == ("batch", "replica")
    layout = Layout.resolve({"fsdp": 2, "sp": -1, "pipeline": 1}, 6)
    assert layout.sizes == (2, 3, 1) and layout.roles == ("batch", "split", "stage")
    assert Layout.resolve({"space": 2}, 2, "space=split").roles == ("split",)


@pytest.mark.parametrize(
    "mesh,world,roles,fragment",
    [
        ({"dp": 3, "tp": 2}, 8, None, "holds 6 ranks but the world size is 8"),
        ({"dp": -1, "tp": -1}, 8, None, "only one size may be inferred"),
        ({"dp": 0, "tp": 2}, 8, None, "must be positive"),
        ({"dp": -2, "tp": 2}, 8, None, "must be positive"),
        ("dp=2,dp=2", 4, None, "more than once"),
        ({"dp": -1, "x": 2}, 4, {"x": "sideways"}, "role 'sideways'"),
        ({"dp": -1, "x": 2}, 4, None, "no default role"),
        ({"dp": -1, "tp": 3}, 8, None, "not divisible by the fixed sizes"),
        ("dp:2", 2, None, "name=size"),
        ({"dp": -1}, 2, {"tp": "replica"}, "not in the mesh"),
        ({"pp": 2, "pipeline": 2}, 4, None, "several 'stage' dims"),
    ],
)
def test_bad_mesh_is_a_clear_error(mesh, world, roles, fragment):
    with pytest.raises(TopologyError, match=fragment) as info:
        Layout.resolve(mesh, world, roles)
    assert isinstance(info.value, MeshwiseError)


def test_size_mismatch_message_shows_both_numbers():
    with pytest.raises(TopologyError) as info:
        Layout.resolve({"dp": 2, "tp": 2}, 8)
    assert "4 ranks" in str(info.value) and "world size is 8" in str(info.value)


def test_detect_environment_for_each_launcher():
    torchrun = detect_environment(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    )
    assert (torchrun.launcher, torchrun.rank, torchrun.world_size, torchrun.local_rank) == ("torchrun", 3, 8, 1)
    slurm = detect_environment(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[007-008]",
            "SLURM_JOB_ID": "1234",
            "SLURM_NTASKS_PER_NODE": "4(x2)",
        }
    )
    assert (slurm.launcher, slurm.rank, slurm.world_size, slurm.local_rank) == ("slurm", 5, 8, 1)
    assert slurm.master_addr == "gpu007" and slurm.local_world_size == 4 and slurm.master_port == 21234
    mpi = detect_environment(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        }
    )
    assert (mpi.launcher, mpi.rank, mpi.world_size, mpi.master_addr) == ("mpi", 2, 4, "127.0.0.1")
    with pytest.raises(TopologyError, match="MASTER_ADDR"):
        detect_environment(
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
        )
    plain = detect_environment({})
    assert (plain.launcher, plain.rank, plain.world_size) == ("none", 0, 1)


# --------------------------------------------------------------------------- real process groups


def _check_groups(topo):
    """Every query of the topology against DeviceMesh and against real all_reduce sums."""
    layout = topo.layout
    mesh = topo.mesh
    assert list(mesh.get_coordinate()) == [topo.coordinates()[d] for d in topo.dims]
    for d in topo.dims:
        assert mesh.get_local_rank(d) == topo.coordinate(d)
    for n in range(1, len(topo.dims) + 1):
        for dims in itertools.combinations(topo.dims, n):
            group = topo.group(dims)
            assert dist.get_process_group_ranks(group) == topo.group_ranks(dims) == layout.group_ranks(topo.rank, dims)
            value = torch.tensor([float(topo.rank + 1)])
            dist.all_reduce(value, group=group)
            assert value.item() == sum(r + 1 for r in topo.group_ranks(dims)), dims
            assert topo.submesh(dims).size() == topo.size(dims)
    batch = topo.batch_dims
    assert topo.data_size == layout.size(batch)
    assert topo.data_rank == layout.coordinate(topo.rank, batch)
    assert topo.is_leader() == (topo.rank == 0)
    return topo.data_rank, topo.coordinates()


@pytest.mark.parametrize("mesh,roles,world", MESHES)
def test_groups_on_gloo(mesh, roles, world):
    results = run_distributed(_check_groups, world, mesh=mesh, roles=roles)
    data_ranks = [r[0] for r in results]
    layout = Layout.resolve(mesh, world, roles)
    assert data_ranks == [layout.coordinate(r, layout.dims_with("batch")) for r in range(world)]


def _init_twice(topo):
    with pytest.raises(TopologyError, match="already called"):
        meshwise.init({"dp": -1})
    assert meshwise.current() is topo
    return True


def test_init_twice_is_an_error_and_single_process_works():
    assert run_distributed(_init_twice, 1, mesh={"dp": -1}) == [True]


def _join_missing(timeout):
    start = time.monotonic()
    try:
        meshwise.init({"dp": -1}, timeout=timeout)
    except CollectiveTimeoutError as exc:
        return time.monotonic() - start, str(exc)
    return None


def test_a_process_that_never_joins_fails_within_the_timeout():
    # Two processes are told the world holds three: the third never comes.
    results = run_distributed(_join_missing, 2, 3.0, env={"WORLD_SIZE": "3"}, timeout=60)
    for elapsed_and_message in results:
        assert elapsed_and_message is not None
        elapsed, message = elapsed_and_message
        assert elapsed < 20, elapsed
        assert "could not join" in message and "3 ranks" in message


def _raise_on_rank_one(topo):
    if topo.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier(group=topo.group("dp"))


def test_harness_names_the_failing_rank_and_coordinate():
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match=r"rank 1 \(dp=0, tp=1\) of 4 failed") as info:
        run_distributed(_raise_on_rank_one, 4, mesh={"dp": 2, "tp": 2}, pg_timeout=20)
    assert "boom on purpose" in str(info.value)
    assert time.monotonic() - start < 15  # the others were killed, not waited for


def test_same_script_runs_plain_and_under_meshwise_run():
    script = str(ROOT / "examples" / "topology_demo.py")
    plain = run_command([sys.executable, script], timeout=120)
    assert "world 1" in plain.stdout and "all_reduce over 'dp' groups: ok" in plain.stdout
    launched = run_command(
        [str(BIN / "meshwise"), "run", "--nproc-per-node", "4", "--mesh", "dp=-1,tp=2", script], timeout=180
    )
    out = launched.stdout
    assert "mesh dp=2 x tp=2 (world 4)" in out
    assert "all_reduce over 'dp' groups: ok" in out and "all_reduce over 'tp' groups: ok" in out
    assert "data rank of each global rank: [0, 0, 1, 1]" in out
    assert out.count("backend gloo") == 1  # only the leader prints the table


def test_describe_cli_and_its_errors():
    out = run_command([str(BIN / "meshwise"), "describe", "--mesh", "dp=-1,tp=2", "--world-size", "8"]).stdout
    assert "mesh dp=4 x tp=2 (world 8)" in out
    assert "   7          3            1          3   1,3,5,7       6,7" in out
    bad = run_command([str(BIN / "meshwise"), "describe", "--mesh", "dp=3,tp=2", "--world-size", "8"], check=False)
    assert bad.returncode == 2 and "holds 6 ranks but the world size is 8" in bad.stdout
    bad = run_command([str(BIN / "meshwise"), "run", "--nproc-per-node", "4", "--mesh", "dp=3", "x.py"], check=False)
    assert bad.returncode == 2 and "holds 3 ranks but the world size is 4" in bad.stdout


def test_quickstart_example_gives_the_same_numbers_on_every_mesh(tmp_path):
    """The README's quick start, run as it is: one process and dp=2 x tp=2 print the same loss and metric."""
    script = str(ROOT / "examples" / "quickstart.py")
    plain = run_command([sys.executable, script, "--checkpoints", str(tmp_path / "one")], timeout=120).stdout
    launched = run_command(
        [
            str(BIN / "meshwise"),
            "run",
            "--nproc-per-node",
            "4",
            "--mesh",
            "dp=-1,tp=2",
            script,
            "--checkpoints",
            str(tmp_path / "four"),
        ],
        timeout=180,
    ).stdout

    def numbers(out):
        line = next(x for x in out.splitlines() if "held-out mse" in x)
        return [float(w.rstrip(",")) for w in line.split() if w[0].isdigit() and "." in w]

    one, four = numbers(plain), numbers(launched)
    assert "mesh dp=2 x tp=2" in launched
    assert len(one) == 2 and all(abs(a - b) <= 1e-5 for a, b in zip(one, four)), (one, four)
    assert (tmp_path / "four" / "latest").read_text().strip() == "step-24"  # 3 epochs of 8 steps, kept


def _init_again():
    sums = []
    for mesh in ({"dp": 2, "tp": 2}, {"dp": 4}):
        topo = meshwise.init(mesh, timeout=20)
        value = torch.ones(1)
        dist.all_reduce(value, group=topo.group(topo.dims[0]))
        sums.append(value.item())
        meshwise.shutdown()
    return sums


def test_init_after_shutdown_builds_a_fresh_group():
    # The old group's gloo addresses stay in the launcher's store: a second init must not dial them.
    assert run_distributed(_init_again, 4, timeout=90) == [[2.0, 4.0]] * 4
