"""ignite's Checkpoint with MeshSaver on dp=2 x tp=2 (n_saved, score, prefix, load_objects), resumed at tp=4 and in
one process; ignite's DiskSaver/ModelCheckpoint with sharded state refused before writing; export to one plain file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshwise.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent / "ckpt_scripts"))

import ckpt_common as cc  # noqa: E402

MESH = {"dp": 2, "tp": 2}
SCORES = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.7}  # n_saved=2 keeps epochs 2 and 4; epoch 1 is removed, 3 never saved
PROBE = torch.linspace(-1, 1, 5 * cc.D_IN).reshape(5, cc.D_IN)


def _init(mesh: dict, world: int | None = None):
    import meshwise

    if world is not None:
        os.environ.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"})
    return meshwise.init(mesh, timeout=30)


def _refused(topo, folder: str, kind: str) -> str:
    """A user's plain ignite trainer with ignite's own handler on sharded state: refused at STARTED."""
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, DiskSaver, ModelCheckpoint

    from meshwise.checkpoint import check_ignite_checkpoints
    from meshwise.errors import CheckpointError

    model, opt = cc.build(topo)
    trainer = Engine(lambda e, b: None)
    trainer.add_event_handler(Events.STARTED, lambda e: check_ignite_checkpoints(e, topo))
    if kind == "disk":
        handler = Checkpoint({"model": model, "optimizer": opt}, DiskSaver(folder, require_empty=False), n_saved=2)
        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=1), handler)
    else:
        handler = ModelCheckpoint(folder, "best", n_saved=1, require_empty=False)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, handler, {"model": model})
    try:
        trainer.run([0, 1], max_epochs=1)
    except CheckpointError as exc:
        return str(exc)
    return "not refused"


def _save(topo, root: str, refused: str) -> dict:
    """dp=2 x tp=2: a user's ignite training loop with Checkpoint(to_save, MeshSaver(...)) kept best by a score."""
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, global_step_from_engine

    import meshwise
    from meshwise.checkpoint import MeshSaver, check_ignite_checkpoints

    model, opt = cc.build(topo)
    x, y = cc.dataset()

    def step(engine, batch):
        opt.zero_grad()
        loss = F.mse_loss(model(x[:8]), y[:8])
        loss.backward()
        opt.step()
        return loss.item()

    trainer = Engine(step)
    to_save = {"model": model, "optimizer": opt, "trainer": trainer}
    saver = MeshSaver(root, topo, async_save=True)  # writes in the background; n_saved's remove waits for it
    best = Checkpoint(
        to_save,
        saver,
        filename_prefix="best",
        score_function=lambda engine: SCORES[engine.state.epoch],
        score_name="acc",
        n_saved=2,
        global_step_transform=global_step_from_engine(trainer),
    )
    sync_saver = MeshSaver(root, topo)
    last = Checkpoint({"model": model}, sync_saver, filename_prefix="last", n_saved=1)  # one object: unwrapped
    trainer.add_event_handler(Events.STARTED, lambda e: check_ignite_checkpoints(e, topo))  # passes: MeshSaver
    trainer.add_event_handler(Events.EPOCH_COMPLETED, best)
    states, probes = {}, {}

    @trainer.on(Events.EPOCH_COMPLETED)
    def remember(engine):
        states[engine.state.epoch] = cc.full_state(model, opt)
        with torch.no_grad():  # an evaluation: a forward without backward before the next save
            probes[engine.state.epoch] = model(PROBE).numpy().copy()

    trainer.add_event_handler(Events.COMPLETED, last)
    trainer.run([0, 1], max_epochs=4)
    from meshwise.testing import CollectiveCounter

    classic = meshwise.Checkpointer(Path(root).parent / "classic", topo)
    names = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")
    counted = []
    for step in (7, 8):  # the export also reads the Checkpointer's own checkpoints
        with CollectiveCounter((*names, "gather_object", "scatter_object_list")) as counter:
            classic.save(step, model=model, optimizer=opt)
        counted.append(counter.calls)
        for group in opt.param_groups:
            group["lr"] = 0.003  # a scheduler's change between saves: the replayed save must write the new value
    classic.close()
    fresh_model, fresh_opt = cc.build(topo)
    reader = meshwise.Checkpointer(Path(root).parent / "classic", topo)
    reader.load(model=fresh_model, optimizer=fresh_opt)  # latest: step 8, a replayed save
    reader.close()
    reloaded = {
        "lr": [g["lr"] for g in fresh_opt.param_groups],
        "exact": cc.max_diff(cc.full_state(fresh_model, fresh_opt), cc.full_state(model, opt)),
    }
    saver.close()
    sync_saver.close()
    out = {"saved": [(p, f) for p, f in best._saved], "last": last.last_checkpoint, "collectives": counted}
    out["reloaded"] = reloaded
    out["disk"] = _refused(topo, refused + "-disk", "disk")
    out["model_checkpoint"] = _refused(topo, refused + "-mc", "mc")
    if topo.rank == 0:
        out.update(states=states, probes=probes)
    return out


def _resume(topo, root: str, names: list[str], last: str) -> dict:
    """Another mesh: a fresh model, optimizer and engine, loaded the ignite way."""
    from ignite.engine import Engine
    from ignite.handlers import Checkpoint

    from meshwise.checkpoint import MeshSaver

    model, opt = cc.build(topo)
    trainer = Engine(lambda e, b: None)
    to_load = {"model": model, "optimizer": opt, "trainer": trainer}
    saver = MeshSaver(root, topo)
    out = {}
    for name in names:
        Checkpoint.load_objects(to_load=to_load, checkpoint=saver.load(name, to_load))
        out[name] = {"state": cc.full_state(model, opt), "iteration": trainer.state.iteration}
    lone, _ = cc.build(topo)
    Checkpoint.load_objects(to_load={"model": lone}, checkpoint=saver.load(None, {"model": lone}))  # the newest
    out["last"] = {k: v for k, v in cc.full_state(lone, torch.optim.Adam(lone.parameters())).items() if "model" in k}
    saver.close()
    return out


def _phase_two(root: str, names: list[str], last: str) -> dict:
    import meshwise

    topo = _init({"dp": 1, "tp": 4})
    out = {"tp4": _resume(topo, root, names, last)}
    meshwise.shutdown()
    if int(os.environ["RANK"]) == 0:
        topo = _init({"dp": 1}, world=1)
        out["one"] = _resume(topo, root, names, last)
        meshwise.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ignite-ckpt")
    root = base / "ckpt"
    one = run_distributed(_save, 4, str(root), str(base / "refused"), mesh=MESH, timeout=150, pg_timeout=60)
    names = [f for _, f in one[0]["saved"]]
    two = run_distributed(_phase_two, 4, str(root), names, one[0]["last"], timeout=150)
    return {"one": one, "two": two, "base": base, "root": root, "names": names}


def test_checkpoint_keeps_n_saved_best_by_score_as_meshwise_folders(runs):
    one = runs["one"][0]
    assert runs["names"] == ["best_checkpoint_4_acc=0.7000.pt", "best_checkpoint_2_acc=0.9000.pt"]
    assert one["last"] == "last_model_8.pt"
    root = runs["root"]
    kept = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert kept == sorted([*runs["names"], "last_model_8.pt"])  # epoch 1 removed by n_saved, nothing half-written
    assert (root / runs["names"][0] / "objects" / "trainer.json").is_file()  # numbers and names: JSON, no pickle
    assert sorted(p.name for p in (root / runs["names"][0]).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]


def test_a_save_runs_dcps_collectives_then_replays_its_plans_with_two(runs):
    # the first save: DCP's plan gather and scatter, its gather of the write results (with meshwise's reports) and
    # its broadcast; a save of the same layout replays those plans: one gather, one broadcast of the outcome
    full = ["gather_object", "scatter_object_list", "gather_object", "broadcast_object_list"]
    assert all(runs["one"][r]["collectives"] == [full, ["gather_object", "broadcast"]] for r in range(4))


def test_a_replayed_save_writes_changed_hyperparameters_and_spreads_replicated_items(runs):
    from torch.distributed.checkpoint import FileSystemReader

    for rank in range(4):  # lr changed after save 7; save 8 replays 7's plans and kept serialised values
        assert runs["one"][rank]["reloaded"] == {"lr": [0.003], "exact": 0.0}
    # the items every rank holds (Adam's hyperparameters per parameter, its step counts) are spread over the ranks'
    # files; DCP's own deduplication gives them all to the last rank, which the others then wait for
    meta = FileSystemReader(str(runs["base"] / "classic" / "step-8")).read_metadata()
    files = sorted({info.relative_path for info in meta.storage_data.values()})
    shared = [i for i in meta.storage_data if ".param_groups." in i.fqn or i.fqn.endswith(".step")]
    per_file = [sum(meta.storage_data[i].relative_path == f for i in shared) for f in files]
    assert len(files) == 4 and len(shared) > 20 and min(per_file) > 0 and max(per_file) <= len(shared) // 2, per_file


def test_plain_values_are_cached_by_their_exact_type_and_value():
    from meshwise.checkpoint.writer import _plain_key

    keys = [_plain_key(v) for v in (1, 1.0, True, "1", (1,), [1], (0.9, 0.999), None)]
    assert None not in keys and len(set(keys)) == len(keys)  # every type and value its own text
    for value in (torch.tensor(1.0), {"a": 1}, np.float64(0.1), [np.int64(1)]):
        assert _plain_key(value) is None  # never cached: a reused bytes could come back as another type


def test_resume_at_tp4_and_in_one_process_is_exact(runs):
    states = runs["one"][0]["states"]
    assert cc.max_diff(states[2], states[4]) > 1e-3  # two different states: loading the wrong one would show
    by_name = {"best_checkpoint_2_acc=0.9000.pt": 2, "best_checkpoint_4_acc=0.7000.pt": 4}
    for where, ranks in (("tp4", range(4)), ("one", [0])):
        for rank in ranks:
            got = runs["two"][rank][where]
            for name, epoch in by_name.items():
                assert cc.max_diff(got[name]["state"], states[epoch]) == 0.0, (where, rank, name)
                assert got[name]["iteration"] == 2 * epoch  # the trainer's state came back through load_objects
            model_only = {k: v for k, v in states[4].items() if "model" in k}
            assert cc.max_diff(got["last"], model_only) == 0.0


def test_disk_saver_and_model_checkpoint_with_sharded_state_are_refused_before_writing(runs):
    for rank in range(4):
        for key in ("disk", "model_checkpoint"):
            msg = runs["one"][rank][key]
            assert "MeshSaver" in msg and "rank 0's" in msg, msg
            assert "FSDP2" in msg or "DTensor" in msg, msg
    for suffix in ("-disk", "-mc"):
        folder = runs["base"] / f"refused{suffix}"
        assert not folder.exists() or not any(folder.iterdir())  # DiskSaver made the folder; nothing in it


def test_export_gives_a_plain_state_dict_with_the_same_evaluation(runs, tmp_path):
    from meshwise.checkpoint import export
    from meshwise.errors import CheckpointError

    one = runs["one"][0]
    folder = runs["root"] / "best_checkpoint_4_acc=0.7000.pt"
    out = export(folder, tmp_path / "model.pt")
    sd = torch.load(out, weights_only=True)  # plain tensors only: no meshwise class needed to read it
    assert all(type(v) is torch.Tensor for v in sd.values())
    plain = cc.MLP()
    plain.load_state_dict(sd)  # strict: the unwrapped model's own keys
    for k, v in plain.state_dict().items():
        assert np.array_equal(v.numpy(), one["states"][4][f"model.{k}"])
    with torch.no_grad():
        assert np.allclose(plain(PROBE).numpy(), one["probes"][4], rtol=0, atol=1e-6)
    # the Checkpointer's own checkpoint (its root: latest) and the single-object one give the same file contents
    for src in (runs["base"] / "classic", runs["root"] / "last_model_8.pt"):
        again = torch.load(export(src, tmp_path / f"{src.name}.pt"), weights_only=True)
        assert sorted(again) == sorted(sd) and all(torch.equal(again[k], sd[k]) for k in sd)
    before = out.stat().st_mtime_ns
    with pytest.raises(CheckpointError, match="overwrite=True"):
        export(folder, out)
    assert out.stat().st_mtime_ns == before
    export(folder, out, overwrite=True)
    from meshwise.checkpoint.export import main

    main([str(runs["base"] / "classic"), str(tmp_path / "cli.pt"), "--key", "model"])  # python -m ... SRC OUT
    assert all(torch.equal(v, sd[k]) for k, v in torch.load(tmp_path / "cli.pt", weights_only=True).items())
    with pytest.raises(SystemExit, match="overwrite"):
        main([str(runs["base"] / "classic"), str(tmp_path / "cli.pt")])
    # the console script: meshwise export SRC OUT; a refusal is an error line and exit code 2, the file kept
    from meshwise import launch

    assert launch.main(["export", str(folder), str(tmp_path / "console.pt")]) == 0
    assert all(torch.equal(v, sd[k]) for k, v in torch.load(tmp_path / "console.pt", weights_only=True).items())
    assert launch.main(["export", str(folder), str(tmp_path / "console.pt")]) == 2
