"""Elastic runs, the quick part (the agents themselves: tests/elastic/real_agents.py, `make test-elastic`): the launch
rule for worlds a mesh cannot hold, the store an elastic run needs, the rendezvous settings, `micro_batch_size`, and
the history of worlds a checkpoint folder keeps (examples/elastic/train.py run twice in this process)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import os
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

import meshwise
from meshwise import elastic
from meshwise.errors import CheckpointError, MeshwiseError, TopologyError
from meshwise.launch import main, parse_run_args
from meshwise.report import report_text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "elastic" / "train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch):
    """meshwise run exports the mesh and torchrun's store switch into this process: undone after the test."""
    for name in ("MESHWISE_MESH", "MESHWISE_ROLES", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _elastic(*extra: str) -> list[str]:
    return ["--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-id", "job", *extra]


def test_an_elastic_range_with_a_world_the_mesh_cannot_hold_is_refused_before_any_process_starts(clean_env, capsys):
    argv = ["run", *_elastic("--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "1", "--mesh", "dp=-1,tp=2")]
    assert main([*argv, str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert "--nnodes 1:3 with --nproc-per-node 1 allows worlds the mesh dp=-1,tp=2 cannot hold" in err
    assert "1 node = 1 ranks" in err and "3 nodes = 3 ranks" in err and "2 nodes" not in err
    assert "raise MIN, or give --nproc-per-node a multiple of the fixed dims' product" in err
    # every world of 2:4 nodes x 2 processes holds tp=2: no refusal from the rule (the missing store comes next)
    args = parse_run_args([*_elastic("--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "2"), str(EXAMPLE)])
    elastic._check_worlds(args, (2, 4), "dp=-1,tp=2", None)


def test_an_elastic_run_needs_a_store_that_no_training_node_hosts(clean_env, monkeypatch):
    monkeypatch.setattr(elastic, "_STORE_CHECK_S", 0.5)
    endpoint = f"127.0.0.1:{_free_port()}"
    args = parse_run_args([*_elastic("--rdzv-endpoint", endpoint), str(EXAMPLE)])
    with pytest.raises(TopologyError, match=rf"no rendezvous store answers at {endpoint}.*start `meshwise store"):
        elastic.prepare_elastic(args, None, None)
    args = parse_run_args(["--nnodes", "1:2", str(EXAMPLE)])  # no rendezvous at all
    with pytest.raises(TopologyError, match="is an elastic run: give --rdzv-backend c10d --rdzv-endpoint"):
        elastic.prepare_elastic(args, None, None)
    args = parse_run_args(["--nnodes", "2", str(EXAMPLE)])  # a fixed node count is not elastic: left alone
    elastic.prepare_elastic(args, None, None)
    assert args.rdzv_conf == ""
    elastic.fresh_store_per_attempt(parse_run_args([str(EXAMPLE)]))  # one node: the agent's store, one count
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
    elastic.fresh_store_per_attempt(args)  # several nodes, even a fixed count: a fresh store every attempt
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_agents_join_the_store_as_clients_with_quick_failure_detection_and_the_users_settings_win(clean_env):
    from torch.distributed import TCPStore

    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(10))
    args = parse_run_args(
        [*_elastic("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "keep_alive_max_attempt=7"), str(EXAMPLE)]
    )
    elastic.prepare_elastic(args, "dp=-1", None)
    elastic.fresh_store_per_attempt(args)
    assert args.max_restarts == 3  # torchrun's 0 would end an elastic run at its first lost node
    conf = dict(item.split("=") for item in args.rdzv_conf.split(","))
    assert conf == {
        "keep_alive_max_attempt": "7",
        "is_host": "0",
        "last_call_timeout": "1",
        "keep_alive_interval": "1",
    }
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    args = parse_run_args([*_elastic("--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0"), str(EXAMPLE)])
    elastic.prepare_elastic(args, "dp=-1", None, ["--max-restarts"])
    assert args.max_restarts == 0  # the user's own, even 0 (a run that may only grow)
    del server


def test_meshwise_store_refuses_an_endpoint_without_a_port(capsys):
    assert main(["store", "localhost"]) == 2
    assert "meshwise store needs HOST:PORT, got 'localhost'" in capsys.readouterr().err


def _train(tmp_path: Path, steps: int, **options) -> list[torch.Tensor]:
    from meshwise.data import ArrayDataset, mesh_dataloader

    topo = meshwise.init({"dp": 1})
    try:
        torch.manual_seed(0)
        model = meshwise.parallelize(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double(), topo)
        x = torch.randn(64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        data = ArrayDataset({"input": x, "target": x.sum(1, keepdim=True).sin()})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo, **options)
        trainer.run(mesh_dataloader(data, topo, global_batch_size=16), max_iters=steps)
        return [p.detach().clone() for p in model.parameters()]
    finally:
        meshwise.shutdown()


def test_micro_batch_size_splits_the_local_batch_as_many_times_as_it_needs_and_trains_the_same(tmp_path):
    whole = _train(tmp_path, 6)
    for options in ({"micro_batch_size": 3}, {"micro_batch_size": 16}, {"accumulation_steps": 4}):
        got = _train(tmp_path, 6, **options)
        assert max(float((a - b).abs().max()) for a, b in zip(got, whole)) <= 1e-13, options
    from meshwise.engine.train_step import TrainStep

    topo = meshwise.init({"dp": 1})
    try:
        model = nn.Linear(2, 1)
        step = TrainStep(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss, topo, micro_batch_size=3
        )
        assert [step.parts_of(rows) for rows in (1, 3, 4, 16)] == [1, 1, 2, 6]
        for bad, match in (
            ({"micro_batch_size": 0}, "micro_batch_size must be an int >= 1 or None, got 0"),
            ({"micro_batch_size": 2, "accumulation_steps": 2}, "both set the number of micro-batches: give one"),
        ):
            with pytest.raises(MeshwiseError, match=match):
                TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss, topo, **bad)
    finally:
        meshwise.shutdown()


def _example(argv: list[str]) -> dict:
    """examples/elastic/train.py's main, run as it is (loaded under a name of its own: other tests load a `train`)."""
    spec = importlib.util.spec_from_file_location("elastic_example_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_each_start_in_a_checkpoint_folder_is_a_world_in_its_history_and_a_restart_says_what_was_lost(
    tmp_path, caplog, clean_env
):
    run = tmp_path / "run"
    whole = _example(["--run-dir", str(tmp_path / "whole"), "--steps", "10"])
    _example(["--run-dir", str(run), "--steps", "6"])
    (run / ".reached-step").write_text("8")  # as if the world had gone on to step 8 after its last save, then died
    with caplog.at_level(logging.WARNING, logger="meshwise.engine"):
        resumed = _example(["--run-dir", str(run), "--steps", "10"])
    assert resumed["weights"] == whole["weights"]
    history = [json.loads(line) for line in (run / "worlds.jsonl").read_text().splitlines()]
    assert [(w["world_size"], w["mesh"], w["resumed_from"], w["steps_lost"]) for w in history] == [
        (1, {"dp": 1}, None, None),
        (1, {"dp": 1}, 6, 2),
    ]
    assert history[0]["world"] != history[1]["world"]
    assert (
        "this run restarted on the same world, 1 ranks (dp=1, 1 node): resumed from checkpoint step 6, 2 steps lost "
        "(the last world reached step 8)" in caplog.text
    )
    text = report_text(run)
    assert "checkpoint none" not in text and text.count("world      ") == 2
    assert "1 ranks (dp=1, 1 node), resumed from step 6, 2 lost (the world before reached step 8)" in text


def test_a_second_world_writing_the_same_folder_stops_the_first_at_its_next_save(tmp_path, clean_env):
    """Two worlds training side by side (a live node counted dead, two jobs given one folder) must not interleave
    checkpoints: the one that recorded itself first stops at its next save, naming the newer one."""
    from ignite.engine import Events

    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.engine.handlers import Checkpointing

    topo = meshwise.init({"dp": 1})
    try:
        model = meshwise.parallelize(nn.Linear(4, 1).double(), topo)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = ArrayDataset({"input": torch.randn(32, 4, dtype=torch.float64), "target": torch.zeros(32, 1).double()})
        trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo)
        ckpt = meshwise.Checkpointer(tmp_path / "run", topo, verbose=False)
        Checkpointing(ckpt, every_iterations=1, model=model, optimizer=opt).attach(trainer)

        @trainer.on(Events.ITERATION_COMPLETED(once=2))
        def another_world_starts(_):
            with open(tmp_path / "run" / "worlds.jsonl", "a") as f:
                f.write(json.dumps({"time": "then", "world": "other", "world_size": 8, "run_id": "job7"}) + "\n")

        with pytest.raises(CheckpointError, match=r"another world started in .* \(8 ranks, run id job7\)"):
            trainer.run(mesh_dataloader(data, topo, global_batch_size=8), max_iters=4)
        ckpt.close()
        assert ckpt.folder.steps() == [1, 2]  # step 3 was not saved (the other world came after step 2's save)
    finally:
        meshwise.shutdown()


def test_a_dry_run_of_the_elastic_example_writes_no_history_and_no_checkpoint_folder(tmp_path, capsys, clean_env):
    """`meshwise run --dry-run` plays a rank of a planned world and writes nothing: no worlds.jsonl, no
    .reached-step, not even the checkpoint folder."""
    run = tmp_path / "run"
    argv = ["run", "--dry-run", "--world-size", "8", "--rank", "0", "--mesh", "dp=-1,tp=2", str(EXAMPLE)]
    assert main([*argv, "--run-dir", str(run), "--steps", "2"]) == 0
    assert not run.exists(), sorted(p.name for p in run.iterdir())
