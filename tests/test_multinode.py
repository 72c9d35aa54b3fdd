"""Beyond one machine: two torchrun "nodes" (loopback, then two network namespaces) and srun's variables form one
dp=2 x tp=2 topology, train like one process and know each rank's node; meshwise run's multi-node options reach
torchrun unchanged.

Each launch runs tests/multinode_scripts/train.py, which writes one JSON report per rank (see its docstring).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from meshwise.launch import main as meshwise_main
from meshwise.launch import parse_run_args
from meshwise.testing import free_port, run_command

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "multinode_scripts" / "train.py")
MESHWISE = str(Path(sys.executable).parent / "meshwise")
LAUNCH_TIMEOUT = 240.0
# Variables of an outer launcher that would make a child read the wrong environment.
LAUNCHER_VARIABLES = [
    k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "TORCHELASTIC_", "GROUP_")) or k in ("RANK", "WORLD_SIZE")
]
LAUNCHER_VARIABLES += ["LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MESHWISE_MESH"]


def _clean(cmd: list[str]) -> list[str]:
    """``cmd`` with no launcher variables inherited from whatever runs the tests."""
    return ["env", *(f"--unset={k}" for k in sorted(set(LAUNCHER_VARIABLES))), *cmd]


def _in_parallel(commands: list[tuple[list[str], dict[str, str]]]) -> list[str]:
    """Run each command in its own process group at the same time (hard timeout each); their outputs, in order."""
    outputs: list[str | None] = [None] * len(commands)
    errors: list[BaseException] = []

    def one(i: int, cmd: list[str], env: dict[str, str]) -> None:
        try:
            outputs[i] = run_command(cmd, env=env, timeout=LAUNCH_TIMEOUT, cwd=str(ROOT)).stdout
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, c, e)) for i, (c, e) in enumerate(commands)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [o or "" for o in outputs]


def _reports(out_dir: Path) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]


def _check_training_and_nodes(reports: list[dict], outputs: list[str]) -> None:
    """What every launch must show: one world of 4 on 2 nodes, ranks node by node, one-process numbers, warnings."""
    for r, rep in enumerate(reports):
        assert rep["rank"] == r and rep["world_size"] == 4
        assert rep["coordinates"] == {"dp": r // 2, "tp": r % 2}
        assert rep["nodes"] == [0, 0, 1, 1] and rep["node"] == r // 2 and rep["num_nodes"] == 2, rep
        assert rep["local_rank"] == r % 2 and rep["local_world_size"] == 2
        assert rep["steps"] == 4
        assert rep["param_diff"] <= 1e-5 and rep["loss_diff"] <= 1e-5, rep
        assert rep["losses"] == reports[0]["losses"], "engine.state.output differs between ranks"
        # dp outermost keeps tp inside a node: no warning; tp outermost crosses nodes: rank 0 warns, naming tp
        assert rep["warned"] == [], rep["warned"]
        swapped = rep["swapped"]
        assert swapped["crossing"] == ["tp"] and swapped["tp_sum"] == swapped["tp_expected"]
        assert len(swapped["advice"]) == 1 and "mesh dim 'tp' (replica) crosses nodes" in swapped["advice"][0]
        assert "'dp=2,tp=2'" in swapped["advice"][0]
        assert swapped["warned"] == (swapped["advice"] if r == 0 else []), swapped
    # each launcher's two workers are one node (which launcher becomes node 0 is the rendezvous' choice)
    by_launcher = [sorted(map(int, re.findall(r"^rank (\d) node \d", out, re.M))) for out in outputs]
    assert sorted(by_launcher) == [[0, 1], [2, 3]], by_launcher
    table = reports[0]["describe"]
    assert "2 node(s)" in table and "dims whose groups cross nodes: ('dp',)" in table
    assert re.search(r"^\s+3\s+1\s+1\s+1\s+1\s+1,3\s+2,3$", table, re.M), table  # rank, node, dp, tp, data rank


def _launcher(port_host: str, run_id: str, out_dir: Path, *extra: str) -> list[str]:
    return [
        MESHWISE,
        "run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        port_host,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "1",
        *extra,
        "--mesh",
        "dp=2,tp=2",
        SCRIPT,
        str(out_dir),
    ]


def test_two_torchrun_nodes_on_loopback_train_like_one_process(tmp_path):
    run_id = f"loopback-{uuid.uuid4().hex[:8]}"
    cmd = _clean(_launcher(f"127.0.0.1:{free_port()}", run_id, tmp_path))
    outputs = _in_parallel([(cmd, {}), (cmd, {})])
    reports = _reports(tmp_path)
    _check_training_and_nodes(reports, outputs)
    for r, rep in enumerate(reports):
        env = rep["env"]  # what torchrun handed each worker: the options reached it
        assert env["GROUP_RANK"] == str(r // 2) and env["GROUP_WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == run_id and env["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert rep["launcher"] == "torchrun" and rep["node_names"][0] == rep["node_names"][1]  # one host, two nodes


# --------------------------------------------------------------------------- two hosts: network namespaces


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, each a host with its own 10.x address; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = f"{os.getpid() % 10000}{uuid.uuid4().hex[:3]}"
    subnet = f"10.213.{os.getpid() % 250}"
    hosts = [(f"mw{tag}a", f"mwv{tag}a", f"{subnet}.1"), (f"mw{tag}b", f"mwv{tag}b", f"{subnet}.2")]
    steps = [
        ("netns", "add", hosts[0][0]),
        ("netns", "add", hosts[1][0]),
        ("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1]),
    ]
    for ns, dev, addr in hosts:
        steps += [
            ("link", "set", dev, "netns", ns),
            ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
            ("-n", ns, "link", "set", dev, "up"),
            ("-n", ns, "link", "set", "lo", "up"),
        ]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"ip {' '.join(step)} failed here ({done.stderr.strip()}): no network namespaces")
        yield hosts
    finally:
        for ns, _, _ in hosts:
            _ip("netns", "del", ns)  # takes its end of the veth pair (and so the pair) with it
        _ip("link", "del", hosts[0][1])  # in case the pair never moved into a namespace


def test_two_hosts_in_network_namespaces_train_like_one_process(tmp_path, two_hosts):
    (ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b) = two_hosts
    endpoint = f"{addr_a}:29400"
    run_id = f"netns-{uuid.uuid4().hex[:8]}"
    # What a namespace host needs that a cluster node usually does not (its hostname resolves to 127.0.0.1):
    # is_host=1 makes host A serve the rendezvous store, --local-addr tells the others where each agent is,
    # GLOO_SOCKET_IFNAME makes gloo announce the veth address instead of the hostname's loopback one.
    host_a = ("--rdzv-conf", "is_host=1", "--local-addr", addr_a)
    node_a = _clean(["ip", "netns", "exec", ns_a, *_launcher(endpoint, run_id, tmp_path, *host_a)])
    node_b = _clean(["ip", "netns", "exec", ns_b, *_launcher(endpoint, run_id, tmp_path, "--local-addr", addr_b)])
    outputs = _in_parallel([(node_a, {"GLOO_SOCKET_IFNAME": dev_a}), (node_b, {"GLOO_SOCKET_IFNAME": dev_b})])
    reports = _reports(tmp_path)
    _check_training_and_nodes(reports, outputs)
    # c10d orders nodes by address: host A (10.x.1) is node 0, and rank 0 is the master the workers dialled
    assert sorted(map(int, re.findall(r"^rank (\d) node", outputs[0], re.M))) == [0, 1]
    assert all(rep["env"]["MASTER_ADDR"] == addr_a for rep in reports)


# --------------------------------------------------------------------------- srun without SLURM


def test_srun_variables_build_the_topology_without_torchrun(tmp_path):
    """Four plain processes with the variables srun sets for 2 nodes x 2 tasks (no SLURM installed)."""
    port = free_port()
    commands = []
    for rank in range(4):
        env = {
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0",  # a task of srun's first step (the batch script has none: refused)
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_NNODES": "2",
            "SLURM_NTASKS": "4",
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % 2),
            "SLURM_NODEID": str(rank // 2),
            "MESHWISE_MESH": "dp=2,tp=2",
            "MASTER_PORT": str(port),
        }
        assignments = [f"{k}={v}" for k, v in env.items()]
        cmd = _clean([*assignments, sys.executable, SCRIPT, str(tmp_path)])
        commands.append((cmd, {}))
    outputs = _in_parallel(commands)
    reports = _reports(tmp_path)
    _check_training_and_nodes(reports, [outputs[0] + outputs[1], outputs[2] + outputs[3]])
    for rep in reports:
        assert rep["launcher"] == "slurm" and rep["master_addr"] == "localhost", rep
        assert rep["env"]["GROUP_RANK"] is None and rep["env"]["SLURM_NODEID"] == str(rep["rank"] // 2)


# --------------------------------------------------------------------------- the command line, no processes


def _config(argv: list[str], env: dict[str, str] | None = None):
    """What torchrun itself makes of the arguments meshwise run hands it."""
    from torch.distributed import run as torchrun

    args = parse_run_args(argv, env or {})
    return args, torchrun.config_from_args(args)[0]


def test_multi_node_options_reach_torchrun_unchanged():
    args, config = _config(
        "--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job7 "
        "--max-restarts 3 --local-addr 10.0.0.5 --mesh dp=-1,tp=4 train.py --lr 0.1".split()
    )
    assert not args.standalone
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 4)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "node0:29400", "job7")
    assert config.max_restarts == 3 and config.local_addr == "10.0.0.5"
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "0.1"]
    # the static backend is where --node-rank counts: it becomes the rendezvous rank
    args, config = _config(
        "--nnodes 2 --node-rank 1 --rdzv-backend static --master-addr node0 --master-port 29500 train.py".split()
    )
    assert not args.standalone and config.rdzv_configs["rank"] == 1 and config.rdzv_endpoint == "node0:29500"
    args, config = _config("--nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint h:1 --rdzv-id e train.py".split())
    assert (config.min_nodes, config.max_nodes) == (1, 4) and not args.standalone


@pytest.mark.parametrize(
    "argv,standalone",
    [
        ("--nproc-per-node 4 train.py", True),  # one node, nothing said: a free port, never 29500
        ("--nnodes 1 --nproc-per-node 4 train.py", True),
        ("--nnodes=1:1 train.py", True),
        ("--nnodes 2 --nproc-per-node 4 train.py", False),
        ("--rdzv-id job7 --node-rank 1 train.py", False),  # only an id and a node rank: not hijacked
        ("--node_rank=1 train.py", False),
        ("--rdzv-id=job7 train.py", False),
        ("--rdzv-end node0:29400 train.py", False),  # an argparse abbreviation still counts
        ("--master-addr 127.0.0.1 train.py", False),
        ("--nproc-per-node 2 train.py --rdzv-id x --nnodes 2", True),  # the script's own arguments do not count
    ],
)
def test_standalone_only_for_one_node_without_a_rendezvous(argv, standalone):
    args = parse_run_args(argv.split(), {})
    assert args.standalone is standalone, argv


def test_slurm_allocation_fills_the_rendezvous(capsys):
    env = {
        "SLURM_JOB_ID": "777",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "4",
        "SLURM_STEP_NUM_NODES": "2",  # the step runs on 2 of the allocation's 4 nodes
        "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "gpu[007,009]",
        "SLURM_JOB_NODELIST": "gpu[001-004,007,009]",
    }
    args, config = _config(["--nproc-per-node", "8", "train.py"], env)
    assert not args.standalone and (config.min_nodes, config.max_nodes) == (2, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "gpu007:20777", "slurm-777")
    assert "SLURM job 777, node 1 of 2" in capsys.readouterr().out
    # the user's own choices win
    args, config = _config(["--rdzv-endpoint", "head:1234", "--rdzv-backend", "c10d", "train.py"], env)
    assert config.rdzv_endpoint == "head:1234"
    args, config = _config(["train.py"], {**env, "MASTER_PORT": "29999"})
    assert config.rdzv_endpoint == "gpu007:29999"
    args, _ = _config(["train.py"], {"SLURM_JOB_ID": "1", "SLURM_NNODES": "1"})
    assert args.standalone  # a one-node allocation is one node


def test_the_first_nodes_launcher_hosts_slurms_rendezvous_store_until_every_node_is_done(capsys):
    """Where meshwise chose SLURM's rendezvous, the step's first node hosts the store (torchrun's agents all join it
    as clients) and waits for every node's launcher to count out; with MASTER_ADDR exported torchrun decides."""
    from meshwise.slurm_rendezvous import HostedRendezvous

    env = {"SLURM_JOB_ID": "778", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_STEP_NODELIST": "gpu[007,009]"}
    first = parse_run_args(["train.py"], {**env, "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu007"})
    second = parse_run_args(["train.py"], {**env, "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu009"})
    assert (first.slurm_host, second.slurm_host) == (True, False)
    assert first.node_rank == 0 and second.node_rank == 0  # c10d numbers the nodes: no torchrun warning
    assert not hasattr(
        parse_run_args(["train.py"], {**env, "SLURM_NODEID": "0", "MASTER_ADDR": "10.0.0.1"}), "slurm_host"
    )
    assert not hasattr(
        parse_run_args(["--rdzv-endpoint", "h:1", "--rdzv-backend", "c10d", "train.py"], env), "slurm_host"
    )
    port = free_port()
    for args in (first, second):
        args.rdzv_endpoint = f"127.0.0.1:{port}"
    host, other = HostedRendezvous(first, first.slurm_host), HostedRendezvous(second, second.slurm_host)
    assert first.rdzv_conf == second.rdzv_conf == "is_host=0" and host.server is not None and other.server is None
    other.finish()  # the other node's launcher counts itself out; the host then leaves at once
    started = time.monotonic()
    host.finish(wait_s=30)
    assert time.monotonic() - started < 5
    capsys.readouterr()


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGUSR1", 138)])
def test_a_signal_told_twice_is_one_stop_and_the_stop_line_names_the_slurm_job(monkeypatch, name, code):
    """scancel, scontrol requeue and --signal=USR1@T signal every process of the step, and torchrun forwards its own
    copy: a second SIGTERM (SIGUSR1) within seconds is the same stop, a later one ends the process at once, with
    128 + the signal (138 for SIGUSR1: saved before the time limit, requeue me)."""
    import logging
    import signal

    from meshwise.debug import interrupt

    sig = getattr(signal, name)
    interrupt._STATE.__init__()
    interrupt.loop_started()
    try:
        interrupt._handle(sig, None)
        interrupt._handle(sig, None)  # the same stop: the loop still stops at an agreed step
        assert interrupt.received() == sig and interrupt.exit_code() == code
        interrupt._STATE.since = time.monotonic() - 60
        with pytest.raises(SystemExit) as ended:
            interrupt._handle(sig, None)
        assert ended.value.code == code
    finally:
        interrupt.loop_ended()
        interrupt._STATE.__init__()
        logging.disable(logging.NOTSET)
    if name == "SIGUSR1":
        assert interrupt.REQUEUE_CODE == 138
        return
    record = {"signal": 15, "step": 12, "epoch": 2, "epoch_length": 8}
    record["checkpoint"] = {"step": 12, "folder": "runs/x/checkpoints", "saved": True}
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert interrupt.stop_line(record, "meshwise run x.py", "meshwise run") == (
        "meshwise run: stopped by SIGTERM (SLURM job 77, requeued 1 time(s)) after step 12 (epoch 2, step 4 of 8); "
        "checkpoint saved at step 12 in runs/x/checkpoints. Resume: meshwise run x.py"
    )


def test_describe_shows_nodes_and_the_placement_warning(capsys):
    assert meshwise_main(["describe", "--mesh", "tp=2,dp=-1", "--nnodes", "2", "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 node(s): node 0: ranks 0-1; node 1: ranks 2-3; dims whose groups cross nodes: ('tp',)" in out
    assert "warning: mesh dim 'tp' (replica) crosses nodes" in out and "'dp=2,tp=2'" in out
    assert meshwise_main(["describe", "--mesh", "dp=-1,tp=2", "--world-size", "4", "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and "rank  node  dp(batch)  tp(replica)" in out
    with pytest.raises(SystemExit):
        meshwise_main(["describe", "--mesh", "dp=-1", "--world-size", "6", "--nproc-per-node", "4"])
    assert "not a whole number of nodes" in capsys.readouterr().err
