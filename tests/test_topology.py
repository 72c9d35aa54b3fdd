"""Topology: layout arithmetic against DeviceMesh, groups on real gloo processes, bad input, launcher."""

from __future__ import annotations

import itertools
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshwise
from meshwise import launch, topology
from meshwise.environment import detect_environment
from meshwise.errors import CollectiveTimeoutError, MeshwiseError, TopologyError
from meshwise.layout import (
    AMBIGUOUS_NAMES,
    DEFAULT_ROLES,
    Layout,
    check_rank_grid,
)
from meshwise.testing import DistributedFailure, run_command, run_distributed, run_script
from meshwise.topology import group_selections

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
    layout = Layout.resolve({"fsdp": 2, "context_parallel": -1, "pipeline": 1}, 6)
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


@pytest.mark.parametrize("name", sorted(AMBIGUOUS_NAMES))
def test_an_ambiguous_dim_name_needs_a_role_and_its_error_shows_every_reading(name):
    readings = AMBIGUOUS_NAMES[name]
    assert name not in DEFAULT_ROLES and len({role for role, _, _ in readings}) == len(readings) >= 2
    with pytest.raises(TopologyError) as info:
        Layout.resolve({"dp": -1, name: 2}, 8)
    text = str(info.value)
    for role, where, holds in readings:
        assert f"{role!r} in {where} (each rank holds {holds})" in text
    fixes = " or ".join(f"roles={{{name!r}: {role!r}}}" for role, _, _ in readings)
    assert f"meshwise.init(..., {fixes})" in text
    for role, _, _ in readings:  # each reading is one line away
        assert Layout.resolve({"dp": -1, name: 2}, 8, {name: role}).roles == ("batch", role)


def test_physicsnemo_naming_without_roles_is_refused_with_both_readings(capsys):
    """PhysicsNeMo's names for a spatially parallel run: model_parallel once meant tensor parallel (replica) here."""
    with pytest.raises(TopologyError) as info:
        Layout.resolve({"data_parallel": -1, "model_parallel": 4}, 8)
    text = str(info.value)
    assert "'replica' in Megatron-LM/fairscale-style tensor parallel" in text
    assert "'split' in PhysicsNeMo spatial/domain parallel" in text and "roles={'model_parallel': 'split'}" in text
    assert launch.main(["describe", "--mesh", "data_parallel=-1,model_parallel=4", "--world-size", "8"]) == 2
    assert "'split' in PhysicsNeMo" in capsys.readouterr().err
    layout = Layout.resolve({"data_parallel": -1, "model_parallel": 4}, 8, "model_parallel=split")
    assert layout.roles == ("batch", "split") and layout.dims_with("batch", "split") == layout.dims
    # several dims without a role: one error naming them all
    with pytest.raises(TopologyError, match=re.escape("roles={'sp': ..., 'space': ...}")) as info:
        Layout.resolve({"sp": 2, "space": 2}, 4)
    assert "mesh dim 'space' has no default role" in str(info.value)
    # a missing dim is named with the dims the mesh does have, and their roles
    with pytest.raises(TopologyError, match=re.escape("its dims are dp=2 (batch), tp=2 (replica)")):
        Layout.resolve("dp=2,tp=2", 4).index("cp")


def test_a_rank_grid_must_be_row_major_and_a_transposed_one_is_named():
    layout = Layout.resolve({"dp": 2, "cp": 3, "tp": 2}, 12)
    check_rank_grid(layout, torch.arange(12).reshape(2, 3, 2).tolist())  # init_device_mesh's own: accepted
    # init_device_mesh over (cp, dp, tp), its dims read in (dp, cp, tp) order: a transposition, named
    transposed = torch.arange(12).reshape(3, 2, 2).permute(1, 0, 2).tolist()
    with pytest.raises(
        TopologyError, match=re.escape("init_device_mesh(device, (3, 2, 2), mesh_dim_names=('cp', 'dp', 'tp'))")
    ):
        check_rank_grid(layout, transposed)
    shuffled = [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [11, 10]]]  # no order of dims gives this
    with pytest.raises(TopologyError, match="not place rank r at row-major position r") as info:
        check_rank_grid(layout, shuffled)
    assert "Build it with init_device_mesh" in str(info.value)
    with pytest.raises(TopologyError, match="not a slice"):
        check_rank_grid(layout, [[0, 1]])


def test_detect_environment_for_each_launcher():
    torchrun = detect_environment(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    )
    assert (torchrun.launcher, torchrun.rank, torchrun.world_size, torchrun.local_rank) == ("torchrun", 3, 8, 1)
    slurm = detect_environment(
        {
            "SLURM_STEP_ID": "0",
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


def _expected_groups(layout):
    """The groups init makes, spelt out: each dim, then batch, metric, replica and all dims when 2+ dims."""
    batch = tuple(d for d, r in zip(layout.dims, layout.roles) if r == "batch")
    metric = tuple(d for d, r in zip(layout.dims, layout.roles) if r in ("batch", "split"))
    replica = tuple(d for d, r in zip(layout.dims, layout.roles) if r == "replica")
    several = [s for s in (batch, metric, replica, layout.dims) if len(s) >= 2]
    return [(d,) for d in layout.dims] + [s for i, s in enumerate(several) if s not in several[:i]]


def _check_groups(topo):
    """Every query of the topology against DeviceMesh and against real all_reduce sums."""
    layout = topo.layout
    mesh = topo.mesh
    assert list(mesh.get_coordinate()) == [topo.coordinates()[d] for d in topo.dims]
    for d in topo.dims:
        assert mesh.get_local_rank(d) == topo.coordinate(d)
    assert list(topo.group_dims) == _expected_groups(layout)
    assert topo.group(topo.dims) is not None  # the world: the trainer's and evaluator's guard
    for n in range(1, len(topo.dims) + 1):
        for dims in itertools.combinations(topo.dims, n):
            if dims not in topo.group_dims:  # not made at init: a named error, never a lazy collective creation
                with pytest.raises(TopologyError, match=re.escape(f"meshwise.init(..., groups=[{dims!r}])")):
                    topo.group(dims)
                continue
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


def test_init_makes_only_the_groups_the_layers_use():
    # 3 dims would make 4 flattened groups if every combination were made; here only metric and all dims.
    layout = Layout.resolve({"dp": 2, "cp": 2, "tp": 2}, 8)
    assert group_selections(layout) == [("dp",), ("cp",), ("tp",), ("dp", "cp"), ("dp", "cp", "tp")]
    hsdp = Layout.resolve({"pp": 2, "dp_replicate": 2, "dp_shard": 2}, 8)  # batch == metric: made once
    assert group_selections(hsdp) == [
        ("pp",),
        ("dp_replicate",),
        ("dp_shard",),
        *[("dp_replicate", "dp_shard")],
        hsdp.dims,
    ]
    assert group_selections(Layout.resolve({"dp": 4}, 4)) == [("dp",)]
    # groups= adds a selection (any order of names: mesh order), once
    assert group_selections(layout, [("tp", "cp"), ("cp", "tp"), "dp"])[-1] == ("cp", "tp")
    assert len(group_selections(layout, [("tp", "cp"), ("cp", "tp"), "dp"])) == 6
    for bad, fragment in [
        ([("dp", "xx")], "groups entry ('dp', 'xx') is not a selection of mesh dims"),
        ([()], "groups entry () is empty"),
        ([("dp", "dp")], "repeat a name"),
        ([7], "groups entry 7 is not a selection"),
        ("cp", "is one string: pass a list of dim selections"),
    ]:
        with pytest.raises(TopologyError, match=re.escape(fragment)):
            group_selections(layout, bad)


def _groups_and_hooks():
    calls = []
    seen = {}

    def started(topo):
        calls.append("init")
        seen["current at init"] = meshwise.current() is topo

    def stopping(topo):
        calls.append("shutdown")
        seen["group alive at shutdown"] = dist.is_initialized() and meshwise.current() is topo

    topology.on_init(started)
    topology.on_init(started)  # registered once, whatever the number of calls
    topology.on_init(lambda topo: calls.append("second"))
    topology.on_shutdown(stopping)
    topo = meshwise.init({"dp": 2, "cp": 1, "tp": 2}, timeout=20, groups=[("tp", "cp")])
    assert calls == ["init", "second"]
    made = topo.group_dims
    value = torch.ones(1)
    dist.all_reduce(value, group=topo.group(("cp", "tp")))
    with pytest.raises(TopologyError) as info:
        topo.submesh(("tp", "dp"))
    meshwise.shutdown()
    meshwise.shutdown()  # nothing left: no hook runs again
    return calls, seen, made, value.item(), str(info.value)


def test_groups_keyword_and_init_shutdown_hooks():
    for calls, seen, made, total, message in run_distributed(_groups_and_hooks, 4, timeout=90):
        assert calls == ["init", "second", "shutdown"]
        assert seen == {"current at init": True, "group alive at shutdown": True}
        assert made == (("dp",), ("cp",), ("tp",), ("dp", "cp"), ("dp", "cp", "tp"), ("cp", "tp"))
        assert total == 2.0
        assert message.startswith("no group for dims ('dp', 'tp')") and "groups=[('dp', 'tp')]" in message


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
    script = str(ROOT / "examples" / "quickstart.py")
    bad = run_command([str(BIN / "meshwise"), "run", "--nproc-per-node", "4", "--mesh", "dp=3", script], check=False)
    assert bad.returncode == 2 and "holds 3 ranks but the world size is 4" in bad.stdout
    bad = run_command([str(BIN / "meshwise"), "run", "--nproc-per-node", "4", "x.py"], check=False)
    assert bad.returncode == 2 and bad.stdout.splitlines() == [
        f"meshwise run: error: script 'x.py' not found (working directory {os.getcwd()}): check the path"
    ]


def test_quickstart_example_gives_the_same_numbers_on_every_mesh(tmp_path):
    """The README's quick start, run as it is (as `python` and `meshwise run` run it, on forked ranks; the launcher
    itself is tested above): one process and dp=2 x tp=2 print the same loss and metric."""
    script = ROOT / "examples" / "quickstart.py"
    plain = run_script(script, 1, ["--checkpoints", str(tmp_path / "one")])[0]
    launched = run_script(script, 4, ["--checkpoints", str(tmp_path / "four")], mesh="dp=-1,tp=2", timeout=180)[0]

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


def test_the_topology_imports_no_layer_above_it() -> None:
    """The dry run, the watchdog and every room sit above the topology: they join init through on_init hooks."""
    import ast

    tree = ast.parse(Path(topology.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {
        f"meshwise.{a.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "meshwise"
        for a in n.names
    }
    above = ("meshwise.dryrun", "meshwise.debug", "meshwise.data", "meshwise.parallel", "meshwise.engine")
    above += ("meshwise.metrics", "meshwise.checkpoint", "meshwise.launch", "meshwise.physicsnemo")
    assert not {m for m in imported if m.startswith(above)}, sorted(imported)
    assert {"meshwise.compat", "meshwise.environment", "meshwise.layout"} <= imported
