"""Checkpointer: same-mesh and other-mesh resume, atomicity under a killed rank, retention, async save, errors."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from meshwise.checkpoint.protocol import FORMAT_VERSION
from meshwise.testing import DistributedFailure, run_command, run_distributed

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "ckpt_scripts"
sys.path.insert(0, str(SCRIPTS))

import ckpt_common as cc  # noqa: E402

MESH = {"dp": 2, "tp": 2}


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime: proves an error left nothing changed."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _error(fn) -> str:
    from meshwise.errors import CheckpointError

    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("no CheckpointError")


# --------------------------------------------------------------------------- launch 1: reference, save, async, errors


def _async_retention(topo, root: str) -> dict:
    import meshwise

    model, opt = cc.build(topo)
    scores = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.3, 5: 0.2}
    current = {"score": 0.0}
    ck = meshwise.Checkpointer(root, topo, keep_last=2, keep_best=1, score=lambda: current["score"], async_save=True)
    x, y = cc.dataset()
    saved, blocked = {}, []
    for step in range(1, 6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[:8]), y[:8]).backward()
        opt.step()
        saved[step] = cc.full_state(model, opt)
        current["score"] = scores[step]
        if step == 3 and topo.rank == 0:
            (Path(root) / "step-99.tmp").mkdir()  # a stale folder of a crashed save
        t = time.perf_counter()
        ck.save(step, model=model, optimizer=opt)
        blocked.append(time.perf_counter() - t)
        # training goes on while the files are written: the checkpoint must hold the state at save(); an edit of
        # the parameters outside optimizer.step() waits for their staging copy first (docs/checkpoint.md)
        ck.wait_staged()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ck.wait()
    steps = ck.steps()
    latest = ck.latest_step()
    loaded = {}
    for step in (2, 5):
        m2, o2 = cc.build(topo)
        ck.load(step, model=m2, optimizer=o2)
        loaded[step] = cc.max_diff(cc.full_state(m2, o2), saved[step])
    ck.close()
    return {"steps": steps, "latest": latest, "loaded": loaded, "stale": (Path(root) / "step-99.tmp").exists()}


def _errors(topo, root: str) -> dict:
    import meshwise
    from meshwise.errors import CheckpointError

    out: dict = {}
    base = Path(root)
    good = base / "good"
    model, opt = cc.build(topo)
    loader = cc.CursorBatches(topo)
    ck = meshwise.Checkpointer(good, topo)
    ck.save(1, model=model, optimizer=opt, loader=loader)

    def copy(name: str, damage) -> meshwise.Checkpointer:
        if topo.rank == 0:
            shutil.copytree(good, base / name)
            damage(base / name / "step-1")
        topo.barrier()
        return meshwise.Checkpointer(base / name, topo)

    # a checkpoint of another model: other sizes, then other layer names
    assert ck.latest_step() == 1  # rank 0 has also finished moving 'latest'
    before = _tree(good)
    wide, wide_opt = cc.build(topo, hidden=32)
    out["shape"] = _error(lambda: ck.load(model=wide, optimizer=wide_opt))
    out["shape_opt_fresh"] = len(wide_opt.state) == 0
    other = torch.nn.Sequential(torch.nn.Linear(cc.D_IN, cc.D_OUT))
    out["keys"] = _error(lambda: ck.load(model=other))
    out["unchanged"] = _tree(good) == before

    def truncate(path: Path) -> None:
        shard = path / "__1_0.distcp"
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)

    out["truncated"] = _error(lambda: copy("trunc", truncate).load(model=model, optimizer=opt))
    out["missing_shard"] = _error(
        lambda: copy("noshard", lambda p: (p / "__2_0.distcp").unlink()).load(model=model, optimizer=opt)
    )
    out["missing_meta"] = _error(lambda: copy("nometa", lambda p: (p / "meshwise.json").unlink()).load(model=model))
    out["missing_dcp_meta"] = _error(lambda: copy("nodcp", lambda p: (p / ".metadata").unlink()).load(model=model))
    out["newer_torch"] = _error(lambda: copy("newer", _as_if_from_newer_torch).load(model=model))
    out["newer_torch_intact"] = (base / "newer" / "step-1" / ".metadata").stat().st_size > 0
    out["newer_format"] = _error(lambda: copy("newfmt", _as_if_from_newer_format).load(model=model))
    notckpt = base / "notckpt"
    if topo.rank == 0:
        notckpt.mkdir()
        (notckpt / "notes.txt").write_text("mine")
    topo.barrier()
    foreign = meshwise.Checkpointer(notckpt, topo)
    out["not_folder_load"] = _error(lambda: foreign.load(model=model))
    out["not_folder_save"] = _error(lambda: foreign.save(1, model=model))
    out["not_folder_intact"] = sorted(os.listdir(notckpt)) == ["notes.txt"]
    out["nothing"] = _error(lambda: meshwise.Checkpointer(base / "absent", topo).load(model=model))
    out["no_step"] = _error(lambda: ck.load(7, model=model))
    out["bad_object"] = _error(lambda: ck.save(2, model=model, thing=3))
    out["orphan_optimizer"] = _error(lambda: ck.save(2, optimizer=opt))
    out["absent_object"] = _error(lambda: ck.load(model=model, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2)))
    try:
        meshwise.Checkpointer(good, topo, keep_best=2)
        out["keep_best_needs_score"] = ""
    except CheckpointError as exc:
        out["keep_best_needs_score"] = str(exc)
    # the good checkpoint still loads after all that
    ck.load(model=model, optimizer=opt, loader=loader)
    out["good_steps"] = ck.steps()
    return out


def _newer_torch() -> str:
    """The next minor release after the running torch (2.15.0 under 2.14.x): newer whatever torch runs the suite."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return f"{major}.{minor + 1}.0"


def _as_if_from_newer_torch(step: Path) -> None:
    """Rewrite a checkpoint as a newer torch writes it (2.15 did so to 2.13/2.14): the record names that torch, and
    each tensor's properties in the DCP metadata carry one more field, which the running unpickler cannot take."""
    import pickle

    from torch.distributed.checkpoint.metadata import TensorProperties

    record = json.loads((step / "meshwise.json").read_text())
    (step / "meshwise.json").write_text(json.dumps({**record, "torch": _newer_torch()}))
    with open(step / ".metadata", "rb") as f:
        md = pickle.load(f)
    own = TensorProperties.__getstate__
    TensorProperties.__getstate__ = lambda self: (*own(self), None)  # the extra field
    try:
        with open(step / ".metadata", "wb") as f:
            pickle.dump(md, f)
    finally:
        TensorProperties.__getstate__ = own


def _as_if_from_newer_format(step: Path) -> None:
    record = json.loads((step / "meshwise.json").read_text())
    (step / "meshwise.json").write_text(json.dumps({**record, "version": record["version"] + 1, "meshwise": "9.0"}))


def _phase_one(topo, root: str, async_root: str, err_root: str) -> dict:
    ref = cc.train(topo, None, stop_at=10)
    part = cc.train(topo, root, stop_at=5, every=5)
    with open(Path(root) / "step-5" / "meshwise.json") as f:
        meta = json.load(f)
    return {
        "ref": ref,
        "part": part,
        "meta": meta,
        "async": _async_retention(topo, async_root),
        "errors": _errors(topo, err_root),
    }


# --------------------------------------------------------------------------- launch 2: new processes, several meshes


def _init(mesh: dict, world: int | None = None):
    import meshwise

    # Every init meets on the launcher's store (run_distributed hosts it, as torchrun's agent does) under its
    # own prefix, so a new mesh in the same processes needs no new port.
    if world is not None:
        os.environ.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"})
    return meshwise.init(mesh, timeout=30)


def _other_mesh(topo, root: str, saved: dict) -> dict:
    from ignite.engine import Engine, Events

    import meshwise

    model, opt = cc.build(topo)
    loader = cc.CursorBatches(topo)
    seen = []

    def step(e, batch):
        seen.append((e.state.epoch, e.state.iteration, batch["index"].tolist()))

    engine = Engine(step)
    ck = meshwise.Checkpointer(root, topo)
    info = ck.load(5, model=model, optimizer=opt, loader=loader, engine=engine)
    counters = (engine.state.epoch, engine.state.iteration)
    rng = torch.rand(1).item()
    diff = cc.max_diff(cc.full_state(model, opt), saved)
    epochs = []
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: epochs.append((e.state.epoch, e.state.iteration)))
    engine.run(loader, max_epochs=1)  # the rest of the first epoch
    return {
        "diff": diff,
        "seen": seen,
        "counters": counters,
        "epochs": epochs,
        "rng": rng,
        "info": (info.resharded, info.rng, info.message, info.saved_mesh, info.mesh),
        "data_rank": topo.data_rank,
        "data_size": topo.data_size,
    }


def _phase_two(root: str, saved: dict) -> dict:
    import meshwise

    out: dict = {}
    topo = _init(MESH)
    out["resume"] = cc.train(topo, root, stop_at=10, every=5)
    meshwise.shutdown()

    for name, mesh in (("dp4", {"dp": 4}), ("tp4", {"dp": 1, "tp": 4})):
        topo = _init(mesh)
        out[name] = _other_mesh(topo, root, saved)
        meshwise.shutdown()
    if int(os.environ["RANK"]) == 0:
        topo = _init({"dp": 1}, world=1)
        out["one"] = _other_mesh(topo, root, saved)
        meshwise.shutdown()
    return out


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    root = base / "run"
    one = run_distributed(
        _phase_one, 4, str(root), str(base / "async"), str(base / "errors"), mesh=MESH, timeout=150, pg_timeout=60
    )
    saved = one[0]["part"]["state"]
    two = run_distributed(_phase_two, 4, str(root), saved, timeout=150)
    return {"one": one, "two": two, "base": base}


@pytest.fixture(scope="module")
def fault(runs):
    """meshwise run --max-restarts 1; in the first attempt rank 1 is SIGKILLed while writing the checkpoint of
    iteration 8 (the one of iteration 4 is complete); the second attempt resumes and trains to iteration 10."""
    base = runs["base"]
    root, logs, out = base / "fault", base / "fault-logs", base / "fault-out"
    logs.mkdir()
    out.mkdir()
    cmd = [sys.executable, "-m", "meshwise.launch", "run", "--nproc-per-node", "4", "--max-restarts", "1"]
    cmd += ["--monitor-interval", "0.2", "--mesh", "dp=2,tp=2", str(SCRIPTS / "fault_train.py")]
    cmd += [str(root), str(logs), str(out)]
    try:
        result = run_command(cmd, timeout=240)
    except DistributedFailure as first:
        # Known open bug, seen once in ~15 runs: a rank of the *resumed* attempt aborts ("terminate called
        # without an active exception") while saving step 8. One clean rerun is allowed so CI is not hostage
        # to it; the first failure is printed so it stays visible.
        print(f"fault run failed once, rerunning from scratch:\n{str(first)[-4000:]}", file=sys.stderr)
        for path in (root, logs, out):
            shutil.rmtree(path, ignore_errors=True)
        logs.mkdir()
        out.mkdir()
        result = run_command(cmd, timeout=240)
    return {"stdout": result.stdout, "out": out, "logs": logs}


def test_same_mesh_resume_continues_exactly(runs):
    for rank in range(4):
        ref, part, res = runs["one"][rank]["ref"], runs["one"][rank]["part"], runs["two"][rank]["resume"]
        assert cc.max_diff(ref["state"], res["state"]) <= 1e-6
        assert part["seen"] + res["seen"] == ref["seen"]  # same batches, same epoch/iteration counters
        assert [s[1] for s in res["seen"]] == [6, 7, 8, 9, 10]
        assert (res["epoch"], res["iteration"]) == (ref["epoch"], ref["iteration"]) == (2, 10)


def test_metadata_record(runs):
    meta = runs["one"][0]["meta"]
    assert meta["step"] == 5 and meta["world_size"] == 4
    assert meta["mesh"] == {"dims": ["dp", "tp"], "sizes": [2, 2], "roles": {"dp": "batch", "tp": "replica"}}
    assert meta["torch"] == torch.__version__ and meta["meshwise"]
    assert {n: o["kind"] for n, o in meta["objects"].items()} == {
        "model": "module",
        "optimizer": "optimizer",
        "loader": "state",
        "engine": "state",
    }


@pytest.mark.parametrize("name", ["dp4", "tp4", "one"])
def test_other_mesh_resume_reshards_and_continues_the_epoch(runs, name):
    ranks = [r[name] for r in runs["two"] if name in r]
    saved_indices = [i for r in runs["one"] for s in r["part"]["seen"] for i in s[2]]
    perm = cc.permutation(0)
    consumed = perm[: 5 * cc.GLOBAL_BATCH]
    assert set(saved_indices) == set(consumed)
    for r in ranks:
        assert r["diff"] == 0.0  # model and Adam state equal the saved full state
        resharded, rng, message, saved_mesh, mesh = r["info"]
        assert resharded and rng == "re-derived" and saved_mesh == MESH
        assert "dp=2 x tp=2" in message and "resharded" in message
        assert r["counters"] == (0, 5)
        assert [s[:2] for s in r["seen"]] == [(1, 6), (1, 7), (1, 8)] and r["epochs"] == [(1, 8)]
    # the rest of the epoch: exactly the samples not yet consumed, in the same global order
    for k in range(3):
        by_data_rank = {r["data_rank"]: r["seen"][k][2] for r in ranks}
        for r in ranks:
            assert r["seen"][k][2] == by_data_rank[r["data_rank"]]  # replica ranks agree
        step = [i for d in range(ranks[0]["data_size"]) for i in by_data_rank[d]]
        assert step == perm[(5 + k) * cc.GLOBAL_BATCH : (6 + k) * cc.GLOBAL_BATCH]
    # RNG re-derived per data rank: ranks holding the same samples share a stream
    streams = {}
    for r in ranks:
        streams.setdefault(r["data_rank"], set()).add(r["rng"])
    assert all(len(v) == 1 for v in streams.values()) and len({min(v) for v in streams.values()}) == len(streams)


def test_crash_during_save_leaves_latest_loadable(fault):
    record = json.loads((fault["out"] / "attempts.json").read_text())
    # what the restarted attempt found: the whole checkpoint of 4, 'latest' on it, the stale folder of 8
    assert record["restart_count"] == 1 and record["resumed_from"] == 4
    assert "step-4" in record["found"] and "step-8.tmp" in record["found"] and "step-8" not in record["found"]
    # after it saved 8 itself: the stale folder is gone
    assert [n for n in record["after"] if n.startswith("step-")] == ["step-4", "step-8"]
    assert not any(n.endswith(".tmp") for n in record["after"])


def test_async_save_and_retention(runs):
    for r in runs["one"]:
        a = r["async"]
        assert a["steps"] == [2, 4, 5]  # keep_last=2 (4, 5) and the best score (step 2)
        assert a["latest"] == 5 and not a["stale"]
        assert a["loaded"] == {2: 0.0, 5: 0.0}  # the state at save(), not the one modified after it


def test_errors_name_the_file_and_change_nothing(runs):
    errs = [r["errors"] for r in runs["one"]]
    assert all(e == errs[0] for e in errs)  # every rank raised, with the same message
    e = errs[0]
    assert "another model" in e["shape"] and "shape mismatches" in e["shape"] and "fc1.weight" in e["shape"]
    assert ".metadata" in e["shape"] and e["shape_opt_fresh"]
    assert "missing keys" in e["keys"] and "model.0.weight" in e["keys"]
    assert "unexpected keys" in e["keys"] and "model.fc1.weight" in e["keys"]
    assert e["unchanged"]
    assert "__1_0.distcp" in e["truncated"] and "truncated" in e["truncated"]
    assert "__2_0.distcp" in e["missing_shard"] and "missing" in e["missing_shard"]
    assert "meshwise.json" in e["missing_meta"] and "missing" in e["missing_meta"]
    assert ".metadata" in e["missing_dcp_meta"]
    assert f"torch {_newer_torch()}" in e["newer_torch"] and f"this torch {torch.__version__}" in e["newer_torch"]
    assert "damaged" not in e["newer_torch"] and e["newer_torch_intact"]
    newer = f"format {FORMAT_VERSION + 1}"
    assert "meshwise 9.0" in e["newer_format"] and newer in e["newer_format"], e["newer_format"]
    assert "not a checkpoint folder" in e["not_folder_load"] and "notes.txt" in e["not_folder_load"]
    assert "not a checkpoint folder" in e["not_folder_save"] and e["not_folder_intact"]
    assert "no checkpoint folder" in e["nothing"]
    assert "step-7" in e["no_step"] and "[1]" in e["no_step"]
    assert "thing=int" in e["bad_object"]
    assert "pass its model too" in e["orphan_optimizer"]
    assert "scheduler" in e["absent_object"] and "engine" not in e["absent_object"]
    assert "keep_best needs score" in e["keep_best_needs_score"]
    assert e["good_steps"] == [1]


def test_fault_restart_resumes_from_latest(runs, fault):
    out, logs = fault["out"], fault["logs"]
    ref = runs["one"][0]["ref"]
    final = dict(np.load(out / "final.npz"))
    assert cc.max_diff(final, ref["state"]) <= 1e-6, fault["stdout"][-3000:]
    # each sample once per epoch across the restart: attempt 0 up to the checkpoint, then attempt 1
    for rank in range(4):
        rows = [json.loads(line) for line in (logs / f"rank-{rank}.jsonl").read_text().splitlines()]
        first = [r for r in rows if r["attempt"] == 0]
        second = [r for r in rows if r["attempt"] == 1]
        assert [r["iteration"] for r in second] == [5, 6, 7, 8, 9, 10]
        assert [r["iteration"] for r in first] == list(range(1, 9))  # killed while saving iteration 8
        timeline = [r for r in first if r["iteration"] <= 4] + second
        ref_rank = runs["one"][rank]["ref"]["seen"]
        assert [[r["epoch"], r["iteration"], r["index"]] for r in timeline] == [list(s) for s in ref_rank]
    per_epoch: dict[int, list[int]] = {}
    for rank in (0, 2):  # the tp=0 rank of each data rank
        for line in (logs / f"rank-{rank}.jsonl").read_text().splitlines():
            r = json.loads(line)
            if (r["attempt"] == 0 and r["iteration"] <= 4) or r["attempt"] == 1:
                per_epoch.setdefault(r["epoch"], []).extend(r["index"])
    assert sorted(per_epoch[1]) == list(range(cc.N_SAMPLES))  # epoch 1: every sample exactly once
    assert len(per_epoch[2]) == len(set(per_epoch[2])) == 2 * cc.GLOBAL_BATCH


def _per_rank_roots(topo, base):
    import meshwise
    from meshwise.errors import CheckpointError

    try:
        meshwise.Checkpointer(f"{base}/rank-{topo.rank}", topo)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_a_root_that_differs_between_ranks_is_refused(tmp_path):
    messages = run_distributed(_per_rank_roots, 2, str(tmp_path), mesh={"dp": 2})
    for message in messages:
        assert message is not None and "differs between ranks" in message and "rank-1" in message
    assert not any(tmp_path.iterdir())  # nothing was written


def _evaluate_then_save(topo, root: str) -> dict:
    from ignite.engine import Engine

    import meshwise

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = meshwise.parallelize(cc.MLP(), topo)  # FSDP2 over dp
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def evaluate(model: torch.nn.Module) -> None:
        def step(engine, batch):
            with torch.no_grad():  # forward only: FSDP2 leaves the root unsharded
                return model(batch)

        Engine(step).run([x[:8], x[8:16]], max_epochs=1)

    x, y = cc.dataset()
    model, opt = build(1234)
    torch.nn.functional.mse_loss(model(x[:8]), y[:8]).backward()
    opt.step()
    evaluate(model)
    ck = meshwise.Checkpointer(root, topo)
    ck.save(1, model=model, optimizer=opt)
    fresh, fresh_opt = build(99)
    evaluate(fresh)
    info = ck.load(1, model=fresh, optimizer=fresh_opt)
    ck.close()
    diff = cc.max_diff(cc.full_state(fresh, fresh_opt), cc.full_state(model, opt))
    return {"diff": diff, "step": info.step, "async": _async_save_equals_sync_save(topo, root + "-async", ASYNC_HIDDEN)}


def test_save_and_load_after_an_evaluation_without_backward(tmp_path):
    # the launch also checks 2-rank async saves against sync ones (test_an_async_save_equals_a_sync_save_...)
    for r in run_distributed(_evaluate_then_save, 2, str(tmp_path / "ckpt"), mesh={"dp": 2}):
        _check_async_equals_sync(r.pop("async"))
        assert r == {"diff": 0.0, "step": 1}


def _load_latest_right_after_a_save(topo, root: str) -> dict:
    import meshwise
    from meshwise.checkpoint import protocol

    slow_fsync = protocol.fsync_tree

    def fsync_tree(path):  # a slow disk: 'latest' moves only after this returns
        time.sleep(1.0)
        slow_fsync(path)

    protocol.fsync_tree = fsync_tree
    model, opt = cc.build(topo)
    for step in (3, 4):  # two saves of different weights, each by a Checkpointer not closed, as scripts often do
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        meshwise.Checkpointer(root, topo).save(step, model=model, optimizer=opt)
    fresh, fresh_opt = cc.build(topo)  # the weights before both saves
    info = meshwise.Checkpointer(root, topo).load("latest", model=fresh, optimizer=fresh_opt)
    return {"step": info.step, "diff": cc.max_diff(cc.full_state(fresh, fresh_opt), cc.full_state(model, opt))}


def test_a_new_checkpointer_sees_the_latest_save_of_another(tmp_path):
    # A sync save returns before its 'latest' is durable (rank 0 fsyncs in a thread); a second Checkpointer on the
    # same root in this process waits for that thread, so it neither misses nor reorders the pointer.
    for r in run_distributed(_load_latest_right_after_a_save, 2, str(tmp_path / "ckpt"), mesh={"dp": 2}):
        assert r == {"step": 4, "diff": 0.0}


def _async_save_equals_sync_save(topo, root: str, hidden: int) -> dict:
    """Sync and async saves of the same state, the optimizer stepping (or an edit) right after each async save()
    returns; then each async checkpoint against the sync one of its step: the loaded state and the shard bytes."""
    import meshwise

    x, y = cc.dataset()
    model, opt = cc.build(topo, hidden=hidden)

    def backward(i: int) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[i : i + 8]), y[i : i + 8]).backward()

    base = Path(root)
    sync = meshwise.Checkpointer(base / "sync", topo, verbose=False)
    background = meshwise.Checkpointer(base / "async", topo, async_save=True, verbose=False)
    first = meshwise.Checkpointer(base / "stage-first", topo, async_save="stage-first", verbose=False)
    for k in (1, 2):  # the second save replays the first one's plans
        backward(k)
        opt.step()
        backward(k + 8)  # the next step's gradients, ready before the save
        sync.save(k, model=model, optimizer=opt)
        if k == 1:  # its step-4 save replays this one's plans, as the others' do (a full save lays shards out anew)
            first.save(k, model=model, optimizer=opt)
            first.wait()  # two checkpointers' writes at once could leave the zip CRCs in (the files load the same)
        background.save(k, model=model, optimizer=opt)
        opt.step()  # at once: it waits for the staging copy of the parameters and Adam's state
    # edits outside optimizer.step(): after wait_staged(), or right after a stage-first save
    sync.save(3, model=model, optimizer=opt)
    background.save(3, model=model, optimizer=opt)
    background.wait_staged()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    sync.save(4, model=model, optimizer=opt)
    background.wait()
    first.save(4, model=model, optimizer=opt)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    first.wait()
    diffs, same_files = {}, {}
    for name, ck, steps in (("async", background, (1, 2, 3)), ("stage-first", first, (1, 4))):
        for k in steps:  # every step's loaded state (the shard bytes are reported: concurrent writes can differ there)
            shards = sorted(p.name for p in sync.step_path(k).glob("*.distcp"))
            same_files[f"{name}-{k}"] = bool(shards) and all(
                (sync.step_path(k) / s).read_bytes() == (ck.step_path(k) / s).read_bytes() for s in shards
            )
            want, want_opt = cc.build(topo, hidden=hidden)
            got, got_opt = cc.build(topo, hidden=hidden)
            sync.load(k, model=want, optimizer=want_opt, restore_rng=False)
            ck.load(k, model=got, optimizer=got_opt, restore_rng=False)
            a, b = cc.full_state(want, want_opt), cc.full_state(got, got_opt)
            diffs[f"{name}-{k}"] = (sorted(a) == sorted(b), cc.max_diff(a, b))
    for ck in (sync, background, first):
        ck.close()
    return {"diffs": diffs, "same_files": same_files}


ASYNC_HIDDEN = 2**16  # ~12 MiB of model + Adam state: a copy long enough for the next optimizer step to run into it


def _check_async_equals_sync(out: dict) -> None:
    # Every checkpoint loads the state of the sync save of its step, bit for bit, although the optimizer stepped right
    # after each async save() returned. The shard files are byte-equal on a quiet machine, but on a loaded one the
    # writes of two checkpointers at once can lay the zip records out otherwise (the same values): not asserted.
    steps = ("async-1", "async-2", "async-3", "stage-first-1", "stage-first-4")
    assert out["diffs"] == {k: (True, 0.0) for k in steps}, (out["diffs"], out["same_files"])


@pytest.mark.timeout(120)
def test_an_async_save_equals_a_sync_save_while_training_goes_on(tmp_path):
    # Only the parameters and optimizer state are staged after save() returns; optimizer.step() waits for them.
    # The 2-rank check runs in the launch of test_save_and_load_after_an_evaluation_without_backward.
    out = run_distributed(_async_save_equals_sync_save, 1, str(tmp_path), ASYNC_HIDDEN, mesh={"dp": 1}, timeout=100)
    _check_async_equals_sync(out[0])
