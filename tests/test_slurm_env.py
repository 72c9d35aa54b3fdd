"""Several nodes without a cluster: SLURM node lists and srun's variables, where the launcher put the ranks, the
placement warnings that follow, a batch script that forgot srun (tables of cases; a real SLURM: tests/slurm/)."""

from __future__ import annotations

import re
import sys

import pytest

from meshwise import launch
from meshwise.environment import detect_environment, expand_nodelist, parse_tasks_per_node
from meshwise.errors import TopologyError
from meshwise.layout import Layout, dims_crossing_nodes, placement_warnings


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
