"""Elastic runs with real torchrun agents on loopback (issue 39): `make test-elastic`, not part of `make test` (the
file's name is not test_*.py). Two `meshwise run --nnodes 1:2 --nproc-per-node 2` agents of examples/elastic/train.py
(dp=-1 x tp=2, float64) meet at a `meshwise store`; a node is lost (its agent and workers SIGKILLed) or joins
mid-epoch, or the run is stopped with SIGTERM, and the final weights equal the uninterrupted one-process run's."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agents  # noqa: E402

STEPS = 28  # 16 steps an epoch (256 samples, global batch 16): every event below lands mid-epoch
TOL = 1e-12


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> list[float]:
    return agents.reference(tmp_path_factory.mktemp("reference"), STEPS)


def test_a_lost_node_leaves_the_survivor_training_with_the_same_global_batch_and_one_process_weights(tmp_path, ref):
    """The node of global rank 0 (its workers host the world's store) is lost at step 9 of a dp=2 x tp=2 run: its
    agent and both workers SIGKILLed. The other node's agent restarts its workers at dp=1 x tp=2 (twice the
    accumulation, the same global batch of 16), they load the latest checkpoint, and the run ends with one
    process's weights. worlds.jsonl and the restart's log line say it."""
    run, out = tmp_path / "run", tmp_path / "out.json"
    with agents.store() as endpoint:
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        procs = [agents.agent(endpoint, "lost", agents.train_args(run, STEPS, 0.3, out), log) for log in logs]
        agents.wait_for_step(run, 9, procs, world=4)
        lost = [agents.group_rank(log) for log in logs].index(0)  # the node of rank 0 goes
        agents.lose_node(procs[lost])
        survivor, log = procs[1 - lost], logs[1 - lost]
        (text,) = agents.finish([survivor], [log])
    assert survivor.returncode == 0, text[-3000:]
    result = json.loads(out.read_text())
    assert (result["step"], result["world"]) == (STEPS, 2)
    diff = agents.max_diff(result["weights"], ref)
    print(f"lost node: final weights differ from one process by {diff:.3g}")
    assert diff <= TOL
    first, last = agents.worlds(run)[-2:]  # (the agents may have met only at a second round: then one world more)
    assert (first["world_size"], first["mesh"], first["nodes"]) == (4, {"dp": 2, "tp": 2}, 2)
    assert (last["world_size"], last["mesh"], last["nodes"]) == (2, {"dp": 1, "tp": 2}, 1)
    assert first["run_id"] == last["run_id"] == "lost" and first["world"] != last["world"]
    # step 9 was reached before the kill; its checkpoint may have been cut short (then step 8's is the latest)
    assert last["resumed_from"] >= 8 and last["steps_lost"] == last["previous_reached"] - last["resumed_from"]
    assert "this run restarted on 2 ranks (dp=1 x tp=2, 1 node), was 4 ranks (dp=2 x tp=2, 2 nodes)" in text
    assert f"resumed from checkpoint step {last['resumed_from']}" in text


def test_a_node_that_joins_grows_the_run_back_and_the_running_world_saves_first(tmp_path, ref):
    """Node A trains alone (dp=1 x tp=2); node B starts at step 6; A's agent stops its workers (SIGTERM: they save
    after the step they are in) and both restart at dp=2 x tp=2 from that step: nothing lost, one process's weights."""
    run = tmp_path / "run"
    with agents.store() as endpoint:
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        a = agents.agent(endpoint, "grow", agents.train_args(run, STEPS, 0.3, tmp_path / "out.json"), logs[0])
        agents.wait_for_step(run, 6, [a])
        b = agents.agent(endpoint, "grow", agents.train_args(run, STEPS, 0.3), logs[1])
        text_a, text_b = agents.finish([a, b], logs)
    assert (a.returncode, b.returncode) == (0, 0), text_a[-3000:] + text_b[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["step"], out["world"]) == (STEPS, 4)
    diff = agents.max_diff(out["weights"], ref)
    print(f"joined node: final weights differ from one process by {diff:.3g}")
    assert diff <= TOL
    history = agents.worlds(run)
    assert [w["world_size"] for w in history] == [2, 4]
    assert history[1]["resumed_from"] >= 6 and history[1]["steps_lost"] == 0


def test_sigterm_mid_epoch_saves_that_step_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path, ref):
    """SIGTERM to an elastic node's `meshwise run` (a drained node, scancel) at step 7: every rank saves after the
    step it is in and the launcher exits 143; launched again, the run resumes from that step with nothing lost."""
    run = tmp_path / "run"
    with agents.store() as endpoint:
        log = tmp_path / "a.log"
        a = agents.agent(endpoint, "term", agents.train_args(run, STEPS, 0.3), log)
        agents.wait_for_step(run, 7, [a])
        a.send_signal(signal.SIGTERM)
        (text,) = agents.finish([a], [log])
        assert a.returncode == 143, text[-3000:]
        stopped = agents.reached(run)
        assert (run / "latest").read_text().strip().endswith(f"step-{stopped}") or (run / f"step-{stopped}").is_dir()
        log2 = tmp_path / "a2.log"
        a2 = agents.agent(endpoint, "term2", agents.train_args(run, STEPS, 0.0, tmp_path / "out.json"), log2)
        (text2,) = agents.finish([a2], [log2])
    assert a2.returncode == 0, text2[-3000:]
    history = agents.worlds(run)
    assert history[-1]["resumed_from"] == stopped and history[-1]["steps_lost"] == 0
    diff = agents.max_diff(json.loads((tmp_path / "out.json").read_text())["weights"], ref)
    print(f"SIGTERM at step {stopped}: final weights differ from one process by {diff:.3g}")
    assert diff <= TOL


def test_a_hung_node_is_given_up_after_the_users_timeout_and_the_others_train_on(tmp_path, ref):
    """Node B freezes at step 8 (its agent and workers SIGSTOPped: sockets open, nothing answers). With
    `meshwise run --timeout 10`, node A's workers give up on the collective after 10 s (not gloo's 30 minutes),
    B's silent agent is counted dead by the rendezvous, and A trains on at dp=1 x tp=2 to one process's weights."""
    run = tmp_path / "run"
    with agents.store() as endpoint:
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        args = agents.train_args(run, STEPS, 0.3, tmp_path / "out.json")
        a = agents.agent(endpoint, "hung", args, logs[0], "--timeout", "10")
        b = agents.agent(endpoint, "hung", agents.train_args(run, STEPS, 0.3), logs[1], "--timeout", "10")
        agents.wait_for_step(run, 8, [a, b], world=4)
        frozen = agents.lose_node(b, signal.SIGSTOP)
        try:
            while len(agents.worlds(run)) < 2 or agents.worlds(run)[-1]["world_size"] != 2:
                assert a.poll() is None and time.monotonic() - frozen < 120, "no restart within 120 s of the freeze"
                time.sleep(0.1)
            noticed = time.monotonic() - frozen
            (text_a,) = agents.finish([a], logs[:1])
        finally:
            agents.lose_node(b)  # still stopped: gone now
    assert a.returncode == 0, text_a[-3000:]
    # the step or the save it was in timed out (the watchdog names the ranks, DCP's save says gloo's "Timed out")
    assert any(t in text_a for t in ("did not arrive", "could not", "Timed out")), text_a[-3000:]
    print(f"hung node: the others restarted {noticed:.1f} s after the freeze (--timeout 10)")
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["step"], out["world"]) == (STEPS, 2)
    diff = agents.max_diff(out["weights"], ref)
    print(f"hung node: final weights differ from one process by {diff:.3g}")
    assert diff <= TOL
    assert [w["world_size"] for w in agents.worlds(run)][-2:] == [4, 2]


def test_hung_workers_on_a_live_node_are_replaced_and_the_world_restarts_whole(tmp_path, ref):
    """Node B's workers hang at step 8 (SIGSTOPped; B's agent alive and answering, as with a stuck GPU). A's workers
    give up after `--timeout 10` and rejoin; B's agent sees them waiting, stops its hung workers (SIGKILL after
    torchrun's 30 s) and both nodes restart at dp=2 x tp=2 from the latest checkpoint. B's agent restarted for A's
    failure, so torchrun counts one restart less there: the world's store prefix must not depend on that count."""
    run = tmp_path / "run"
    with agents.store() as endpoint:
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        a = agents.agent(
            endpoint, "hw", agents.train_args(run, STEPS, 0.3, tmp_path / "out.json"), logs[0], "--timeout", "10"
        )
        b = agents.agent(endpoint, "hw", agents.train_args(run, STEPS, 0.3), logs[1], "--timeout", "10")
        agents.wait_for_step(run, 8, [a, b], world=4)
        for pid in agents.tree(b.pid)[1:]:  # the workers, not the agent
            os.kill(pid, signal.SIGSTOP)
        text_a, text_b = agents.finish([a, b], logs)
    assert (a.returncode, b.returncode) == (0, 0), text_a[-3000:] + text_b[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["step"], out["world"]) == (STEPS, 4)
    diff = agents.max_diff(out["weights"], ref)
    print(f"hung workers: final weights differ from one process by {diff:.3g}")
    assert diff <= TOL
    last = agents.worlds(run)[-1]
    assert last["world_size"] == 4 and last["resumed_from"] >= 7
