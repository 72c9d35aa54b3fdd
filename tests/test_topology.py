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
from meshwise.environment import detect_environment, expand_nodelist, parse_tasks_per_node
from meshwise.errors import CollectiveTimeoutError, MeshwiseError, TopologyError
from meshwise.layout import (
    AMBIGUOUS_NAMES,
    DEFAULT_ROLES,
    Layout,
    check_rank_grid,
    dims_crossing_nodes,
    placement_warnings,
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


# --------------------------------------------------------------------------- several nodes: SLURM and placement


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("gpu[003-010,012],cpu1", [f"gpu{i:03d}" for i in range(3, 11)] + ["gpu012", "cpu1"]),
        ("node-[1-2]", ["node-1", "node-2"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: the width of the start, 1
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding kept past the width change
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("localhost", ["localhost"]),
        ("host.example.org,10.0.0.1", ["host.example.org", "10.0.0.1"]),
        (" x[1] ", ["x1"]),
    ],
)
def test_slurm_node_lists_expand_like_scontrol(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist,reason",
    [
        ("gpu[003-", "'[' without ']'"),
        ("gpu]1", "']' without '['"),
        ("a[1[2]]", "nested '['"),
        ("a,,b", "an empty host between commas"),
        ("a,", "an empty host between commas"),
        ("a[1-x]", "is not N or N-M"),
        ("a[]", "is not N or N-M"),
        ("a[3-1]", "runs backwards"),
        ("a b", "characters outside"),
        ("a[1-9999999]", "more than"),
        ("   ", "it is empty"),
    ],
)
def test_a_malformed_node_list_names_the_variable_the_value_and_the_fix(nodelist, reason):
    with pytest.raises(TopologyError) as info:
        expand_nodelist(nodelist, "SLURM_STEP_NODELIST")
    message = str(info.value)
    assert message.startswith(f"SLURM_STEP_NODELIST={nodelist!r} is not a SLURM node list"), message
    assert reason in message and "MASTER_ADDR" in message


def test_slurm_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    assert parse_tasks_per_node("1,2(x2)") == [1, 2, 2]
    for bad in ("", "2(3)", "x", "0", "2(x0)", "2(x3),"):
        with pytest.raises(TopologyError, match="SLURM_TASKS_PER_NODE=.* is not a SLURM task count"):
            parse_tasks_per_node(bad)


SRUN = {  # what srun sets for task 5 of 7 on nodes gpu[003-004],cpu1 (3 + 3 + 1 tasks), job 1234
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NODELIST": "gpu[001-004],cpu1",
    "SLURM_STEP_NODELIST": "gpu[003-004],cpu1",
    "SLURM_TASKS_PER_NODE": "3(x2),1",
}


def test_detect_environment_under_srun():
    env = detect_environment(SRUN)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.node_rank) == ("slurm", 5, 7, 2, 1)
    assert env.local_world_size == 3 and env.master_addr == "gpu003" and env.master_port == 21234
    last = detect_environment({**SRUN, "SLURM_PROCID": "6", "SLURM_NODEID": "2", "SLURM_LOCALID": "0"})
    assert last.local_world_size == 1 and last.node_rank == 2  # the short last node of '3(x2),1'
    # the job's list when the step's is missing; an exported address wins and the list is not needed
    assert detect_environment({**SRUN, "SLURM_STEP_NODELIST": ""}).master_addr == "gpu001"
    chosen = detect_environment({**SRUN, "SLURM_JOB_NODELIST": "gpu[", "SLURM_STEP_NODELIST": "", "MASTER_ADDR": "h"})
    assert chosen.master_addr == "h"
    assert detect_environment({**SRUN, "MASTER_PORT": "4000"}).master_port == 4000
    with pytest.raises(TopologyError, match=r"SLURM_STEP_NODELIST='gpu\[003-004,cpu1' is not a SLURM node list"):
        detect_environment({**SRUN, "SLURM_STEP_NODELIST": "gpu[003-004,cpu1"})
    with pytest.raises(TopologyError, match="SLURM_TASKS_PER_NODE='3x2' is not a SLURM task count"):
        detect_environment({**SRUN, "SLURM_TASKS_PER_NODE": "3x2"})
    with pytest.raises(TopologyError, match="SLURM_PROCID=9 is outside SLURM_NTASKS=7"):
        detect_environment({**SRUN, "SLURM_PROCID": "9"})
    with pytest.raises(TopologyError, match="SLURM_NODEID='one' is not an integer"):
        detect_environment({**SRUN, "SLURM_NODEID": "one"})
    no_list = {k: v for k, v in SRUN.items() if "NODELIST" not in k}
    with pytest.raises(TopologyError, match="SLURM gave no node list"):
        detect_environment(no_list)
    # torchrun inside an allocation (srun meshwise run ...): torchrun's variables win, GROUP_RANK is the node
    nested = detect_environment({**SRUN, "RANK": "3", "WORLD_SIZE": "8", "GROUP_RANK": "1", "LOCAL_RANK": "1"})
    assert (nested.launcher, nested.rank, nested.node_rank) == ("torchrun", 3, 1)
    assert detect_environment({"RANK": "0", "WORLD_SIZE": "2"}).node_rank is None  # no node index: hostnames


@pytest.mark.parametrize(
    "mesh,nodes,warned",
    [
        ({"tp": 2, "dp": 2}, [0, 0, 1, 1], ["tp"]),  # tp outermost: its pairs (0,2), (1,3) cross nodes
        ({"dp": 2, "tp": 2}, [0, 0, 1, 1], []),
        ({"tp": 2, "dp": 2}, [0, 0, 0, 0], []),  # one node: nothing crosses
        ({"tp": 4}, [0, 0, 1, 1], []),  # no batch dim to move across nodes instead
        ({"tp": 4, "dp": 2}, [0, 0, 1, 1, 2, 2, 3, 3], []),  # tp 4 > 2 per node: crosses in any order
        ({"cp": 2, "tp": 2, "dp": 2}, [0] * 4 + [1] * 4, ["cp"]),  # cp crosses; tp is inner either way
        ({"cp": 2, "tp": 2, "dp": 2}, [0, 0, 1, 1, 2, 2, 3, 3], ["tp"]),  # cp crosses in any order: not named
        ({"pp": 2, "dp": 2, "tp": 2}, [0] * 4 + [1] * 4, []),  # pp crossing keeps dp and tp inside: wanted
        ({"pp": 2, "dp": 4, "tp": 2}, [r // 4 for r in range(16)], ["pp"]),  # dp crosses anyway: pp needlessly
        ({"pp": 2, "dp": 4}, [r // 2 for r in range(8)], ["pp"]),
        ({"pp": 2, "dp": 2}, [0, 1, 2, 3], []),  # one rank a node: pp crosses in any order
        ({"dp": 2, "pp": 2, "tp": 2}, [0] * 4 + [1] * 4, []),  # batch dims first already
        ({"x": 2, "dp": 2}, [0, 0, 1, 1], ["x"]),  # by role, not by name (x is split below)
    ],
)
def test_placement_warning_names_the_chatty_dim_that_crosses_nodes(mesh, nodes, warned):
    layout = Layout.resolve(mesh, len(nodes), {"x": "split"} if "x" in mesh else None)
    messages = placement_warnings(layout, nodes)
    named = [re.match(r"mesh dim '(\w+)' \((replica|split|stage)\) crosses nodes", m).group(1) for m in messages]
    assert named == warned, messages
    roles = {"x": "split"} if "x" in mesh else None
    batch = layout.dims_with("batch")
    order = [*batch, *(d for d in layout.dims if d not in batch)]
    suggested = ",".join(f"{d}={mesh[d]}" for d in order)
    for m in messages:
        assert f"Declare the batch dims first, mesh '{suggested}'" in m, m
    for d in warned:  # the advice holds: in the suggested order that dim stays inside nodes
        better = Layout.resolve(suggested, len(nodes), roles)
        assert d in dims_crossing_nodes(layout, nodes) and d not in dims_crossing_nodes(better, nodes)


@pytest.mark.parametrize(
    "mesh,nodes,option",
    [
        ("dp=2,tp=2", [0, 1, 0, 1], "srun -m block"),  # srun -m cyclic, 2 + 2: each tp pair on both nodes
        ("dp=2,tp=2", [0, 0, 0, 1], "srun --ntasks-per-node=2"),  # srun -N 2 -n 4 (block, 3 + 1): [2,3] crosses
        ("dp=2,tp=2", [0, 1, 0, 0], "srun --ntasks-per-node=2 -m block"),  # srun -N 2 -n 4 -m cyclic (3 + 1)
        ("dp=2,cp=2", [0, 1, 0, 1], "srun -m block"),  # a split dim too
        ("tp=2,dp=2", [0, 0, 0, 1], "srun --ntasks-per-node=2 and declare the batch dims first, mesh 'dp=2,tp=2'"),
        ("dp=2,tp=2", [0, 0, 1, 1], None),  # node by node, 2 + 2: nothing to say
        ("tp=2,dp=2", [0, 1, 0, 1], None),  # cyclic keeps tp=2,dp=2's pairs (0,2), (1,3) inside the nodes
        ("dp=2,tp=2", [0, 1, 2, 3], None),  # one rank a node: tp crosses in any placement
        ("dp=2,tp=4", [0, 1] * 4, "srun -m block"),  # 4 ranks a node, cyclic
    ],
)
def test_placement_warning_reads_where_the_launcher_put_the_ranks(mesh, nodes, option):
    """Placement from reality (issue 43): nodes as srun placed them, not as they would be numbered node by node."""
    messages = [m for m in placement_warnings(Layout.resolve(mesh, len(nodes)), nodes) if "launcher placed" in m]
    if option is None:
        assert messages == [], messages
        return
    assert len(messages) == 1, messages
    assert f"start the job with {option} (ranks numbered node by node" in messages[0], messages[0]
    dim = "cp" if "cp" in mesh else "tp"
    assert messages[0].startswith(f"mesh dim '{dim}' (") and "crosses nodes because of where" in messages[0]


BATCH = {  # what a batch script of `sbatch -N 2 -n 4` sees (SLURM 22.05): rank 0 of 4, but no step
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}


def test_a_batch_script_without_srun_is_refused_with_the_srun_line(monkeypatch):
    """The slip of issue 43: `python train.py` in a batch script took itself for rank 0 of 4 and waited 600 s."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--epochs", "2"])
    with pytest.raises(TopologyError) as info:
        detect_environment(BATCH)
    message = str(info.value)
    assert "allocation of 4 tasks" in message and "srun did not start it (no SLURM_STEP_ID" in message, message
    assert "`srun -N 2 -n 4 python train.py --epochs 2`" in message, message
    assert "`srun -N 2 --ntasks-per-node=1 meshwise run --nproc-per-node 2 train.py ...`" in message, message
    for step in ("batch", "extern", "interactive", "4294967294"):  # steps srun did not start
        with pytest.raises(TopologyError, match="srun did not start it"):
            detect_environment({**BATCH, "SLURM_STEP_ID": step})
    # srun's own tasks, one task, salloc's shell (no SLURM_PROCID), mpirun inside the allocation: as before
    assert detect_environment({**BATCH, "SLURM_STEP_ID": "0"}).launcher == "slurm"
    assert detect_environment({**BATCH, "SLURM_STEPID": "3"}).world_size == 4
    one = detect_environment({**BATCH, "SLURM_NTASKS": "1", "SLURM_NNODES": "1"})
    assert (one.launcher, one.world_size) == ("none", 1)
    assert detect_environment({k: v for k, v in BATCH.items() if k != "SLURM_PROCID"}).launcher == "none"
    mpi = {**BATCH, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert (detect_environment(mpi).launcher, detect_environment(mpi).rank) == ("mpi", 1)
    torchrun = detect_environment({**BATCH, "RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})
    assert torchrun.launcher == "torchrun"  # meshwise run's workers in a one-node batch script


def test_meshwise_run_in_a_multi_node_batch_script_is_refused_with_the_srun_line(capsys):
    argv = ["--nproc-per-node", "2", "--mesh", "dp=2,tp=2", "train.py", "--epochs", "2"]
    with pytest.raises(TopologyError) as info:
        launch.parse_run_args(argv, BATCH)
    message = str(info.value)
    assert "SLURM job 77 has 2 nodes but this meshwise run was not started by srun" in message, message
    assert "`srun -N 2 --ntasks-per-node=1 meshwise run --nproc-per-node 2 --mesh dp=2,tp=2 train.py --epochs 2`" in (
        message
    ), message
    assert "node 0 of 2" not in capsys.readouterr().out  # refused before the rendezvous line
    step = launch.parse_run_args(argv, {**BATCH, "SLURM_STEP_ID": "0"})  # under srun: one launcher per node
    assert (step.nnodes, step.rdzv_endpoint) == ("2", "n1:20077")
    one_node = {**BATCH, "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1"}
    assert launch.parse_run_args(argv, one_node).standalone  # one node: the batch script is the whole job


def test_describe_shows_each_ranks_stage_and_warns_of_a_needless_stage_crossing(capsys):
    from meshwise import launch

    argv = ["describe", "--mesh", "pp=2,dp=2,tp=2", "--nproc-per-node", "4", "--nnodes", "2"]
    assert launch.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("stage dims ('pp',) (2 pipeline stages)"), lines[0]
    head = lines[2].split()
    assert head[:5] == ["rank", "node", "pp(stage)", "dp(batch)", "tp(replica)"], head
    stage = {int(r.split()[0]): int(r.split()[2]) for r in lines[4:12]}
    assert stage == {r: r // 4 for r in range(8)}, stage  # the first 4 ranks (node 0) run stage 0
    assert not [x for x in lines if x.startswith("warning")], lines  # pp crossing keeps dp and tp inside nodes
    assert launch.main(["describe", "--mesh", "pp=2,dp=4", "--nproc-per-node", "2", "--nnodes", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("warning: mesh dim 'pp' (stage) crosses nodes") and "'dp=4,pp=2'" in lines[-1]


def test_placement_inputs_are_checked_and_the_table_shows_nodes():
    layout = Layout.resolve({"tp": 2, "dp": 2}, 4)
    with pytest.raises(TopologyError, match="3 node indices given for a mesh of 4 ranks"):
        placement_warnings(layout, [0, 0, 1])
    table = layout.table([0, 0, 1, 1], ["hostA", "hostB"])
    lines = table.splitlines()
    assert lines[0].startswith("mesh tp=2 x dp=2 (world 4)")  # the summary stays the first line
    assert lines[1] == (
        "2 node(s): node 0 (hostA): ranks 0-1; node 1 (hostB): ranks 2-3; dims whose groups cross nodes: ('tp',)"
    )
    assert lines[2].split() == ["rank", "node", "tp(replica)", "dp(batch)", "data_rank", "tp", "group", "dp", "group"]
    assert lines[-1].startswith("warning: mesh dim 'tp' (replica) crosses nodes")
    assert "node" not in layout.table().splitlines()[1]  # without nodes the table is as before


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
