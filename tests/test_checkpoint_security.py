"""A checkpoint is data: loading one never runs code from its files, and no name read from it leads outside.

One launch of 2 gloo ranks (dp=2, FSDP2): a checkpoint of the previous format (the committed fixture, written by
tests/ckpt_scripts/make_format1_fixture.py before checkpoints became code-free) loads through the safe path with
the values it was saved with; a checkpoint of this format is saved and loads; a user object holding arbitrary
Python objects needs trust=True. Then a payload is planted in each pickled or JSON file of both (a pickle that
would create a marker file and hand back the original object, so that a load would "work"): no marker is ever
created, and each load either refuses naming the file or succeeds without reading it. Names that lead outside
(latest, a step folder, a shard in .metadata, symlinked files) are refused, and a save writes nothing through a
planted symlink. Export, in this process, is checked the same way.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from meshwise.testing import run_distributed

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "ckpt_format1"
sys.path.insert(0, str(HERE / "ckpt_scripts"))

import make_format1_fixture as fx  # noqa: E402

STATE_OBJECTS = ("engine", "loader", "scheduler")


# --------------------------------------------------------------------------- the user's object and the payload


@dataclasses.dataclass
class Note:
    text: str
    value: Fraction


class History:
    """A user's object whose state holds Python objects of its own (no JSON, no weights-only load)."""

    def __init__(self) -> None:
        self.notes = [Note("start", Fraction(1, 3))]
        self.best = Fraction(0)

    def state_dict(self) -> dict[str, Any]:
        return {"notes": list(self.notes), "best": self.best, "kinds": {Note}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.notes, self.best = list(sd["notes"]), sd["best"]


class Payload:
    """Unpickles as: create ``marker``, then return ``original`` (the load would look as if it worked)."""

    def __init__(self, marker: Path, original: Any) -> None:
        self.marker, self.original = str(marker), original

    def __reduce__(self) -> tuple:
        code = f"(open({self.marker!r}, 'a').close(), __import__('pickle').loads({pickle.dumps(self.original)!r}))[1]"
        return (eval, (code,))


def _read_metadata_trusted(step: Path) -> Any:
    with open(step / ".metadata", "rb") as f:  # the test's own checkpoint: it knows what it wrote
        return pickle.load(f)


def _write_metadata(step: Path, md: Any) -> None:
    with open(step / ".metadata", "wb") as f:
        pickle.dump(md, f)


def plant(step: Path, target: str, marker: Path) -> None:
    """Replace ``target`` of checkpoint folder ``step`` by a payload that hands back the original content."""
    file = step / target
    if target == ".metadata":
        _write_metadata(step, Payload(marker, _read_metadata_trusted(step)))
    elif target.endswith(".distcp"):  # a byte value (an optimizer hyperparameter) in this shard file
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md = _read_metadata_trusted(step)
        index, info = next(
            (i, s)
            for i, s in md.storage_data.items()
            if s.relative_path == target and isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata)
        )
        with open(file, "rb") as f:
            f.seek(info.offset)
            original = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
        buf = io.BytesIO()
        torch.save(Payload(marker, original), buf)
        with open(file, "ab") as f:
            info.offset = f.seek(0, os.SEEK_END)
            info.length = f.write(buf.getvalue())
        _write_metadata(step, md)
    elif target.endswith(".pt"):
        torch.save(Payload(marker, torch.load(file, weights_only=False)), file)
    else:  # a JSON file (or 'latest'): the payload's pickle bytes where the text was
        file.write_bytes(pickle.dumps(Payload(marker, file.read_text())))


def byte_shards(step: Path) -> list[str]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = _read_metadata_trusted(step)
    return sorted(
        {
            s.relative_path
            for i, s in md.storage_data.items()
            if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata)
        }
    )


# --------------------------------------------------------------------------- what the ranks do


def _objects(topo: Any, history: bool = False) -> dict[str, Any]:
    from ignite.engine import Engine

    from meshwise.engine.handlers import EngineState

    model, opt, sched, loader = fx.build(topo)
    objects = {"model": model, "optimizer": opt, "engine": EngineState(Engine(lambda e, b: None))}
    objects |= {"loader": loader, "scheduler": sched}
    if history:
        objects["history"] = History()
    return objects


def _snapshot(objects: dict[str, Any]) -> list[float]:
    """This rank's shard of the parameters and the plain objects' states (local: no collective)."""
    out = [float(p.detach().to_local().sum()) for p in objects["model"].parameters()]
    return out + [hash(json.dumps(objects[n].state_dict(), default=str, sort_keys=True)) for n in STATE_OBJECTS]


def _perturb(objects: dict[str, Any]) -> None:
    with torch.no_grad():
        for p in objects["model"].parameters():
            p.add_(1.0)
    objects["loader"].set_epoch(9)


def _attempt(topo: Any, ckpt: Any, objects: dict[str, Any], marker: Path, **kw: Any) -> dict[str, Any]:
    """Load into ``objects`` (perturbed first): 'ok', or the error and whether the objects were left unchanged."""
    import torch.distributed as dist

    from meshwise.errors import CheckpointError

    _perturb(objects)
    before = _snapshot(objects)
    try:
        ckpt.load(**kw, **objects)
        result = {"outcome": "ok"}
    except CheckpointError as exc:
        result = {"outcome": "refused", "error": str(exc), "unchanged": _snapshot(objects) == before}
    result["marker"] = marker.exists()
    dist.barrier()
    return result


def _copy(src: Path, dst: Path, rank: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        shutil.copytree(src, dst, symlinks=True)
    dist.barrier()


def _previous_format(topo: Any, base: Path) -> dict[str, Any]:
    """The fixture of the previous format, loaded through the safe path (and its MeshSaver folder)."""
    from ignite.engine import Engine

    import meshwise
    from meshwise.checkpoint import MeshSaver

    _copy(FIXTURE, base / "prev", topo.rank)
    objects = _objects(topo)
    info = meshwise.Checkpointer(base / "prev" / "root", topo).load(**objects)
    out = {"rng": info.rng, "draws": fx.draws(), "state": fx.full(objects["model"], objects["optimizer"])}
    out |= {n: objects[n].state_dict() for n in ("loader", "scheduler")}
    out["engine"] = objects["engine"].engine.state_dict()
    model, *_ = fx.build(topo)
    saver = MeshSaver(base / "prev" / "ignite", topo)
    trainer = Engine(lambda e, b: None)
    mapping = saver.load(None, {"model": model, "trainer": trainer})
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["ignite_model"] = whole["weight"].flatten().tolist()
    out["ignite_trainer"] = dict(mapping["trainer"])
    return out


def _current_format(topo: Any, base: Path) -> dict[str, Any]:
    """A checkpoint of this format (with a History) saved, loaded with and without trust."""
    import meshwise
    from meshwise.errors import CheckpointError

    objects = _objects(topo, history=True)
    meshwise.Checkpointer(FIXTURE / "root", topo).load(**{n: o for n, o in objects.items() if n != "history"})
    objects["history"].notes.append(Note("resumed", Fraction(2, 7)))
    ckpt = meshwise.Checkpointer(base / "clean", topo)
    ckpt.save(2, **objects)
    ckpt.close()
    out = {"saved": fx.full(objects["model"], objects["optimizer"]), "draws": fx.draws()}
    fresh = _objects(topo, history=True)
    try:
        meshwise.Checkpointer(base / "clean", topo).load(**fresh)
        out["untrusted_history"] = "loaded"
    except CheckpointError as exc:
        out["untrusted_history"] = str(exc)
    out["history_untouched"] = [n.text for n in fresh["history"].notes] == ["start"]
    info = meshwise.Checkpointer(base / "clean", topo).load(trust=True, **fresh)
    out |= {"rng": info.rng, "loaded_draws": fx.draws(), "loaded": fx.full(fresh["model"], fresh["optimizer"])}
    out["history"] = [(n.text, str(n.value)) for n in fresh["history"].notes]
    out["trusting_checkpointer"] = (
        "history"
        in meshwise.Checkpointer(base / "clean", topo, trust=True).load(**_objects(topo, history=True)).objects
    )
    step = base / "clean" / "step-2"
    out["files"] = sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file())
    out["rng_weights_only"] = sorted(torch.load(step / "rng" / f"rank-{topo.rank:05d}.pt", weights_only=True))
    return out


def _payload_cases(topo: Any, base: Path) -> dict[str, Any]:
    """A payload in each pickled or JSON file of the current and the previous format, one copy each."""
    import meshwise

    marker = base / "MARKER"
    clean, prev = base / "clean", base / "prev" / "root"
    cases = [(clean, t) for t in [".metadata", *byte_shards(clean / "step-2"), "meshwise.json"]]
    cases += [(clean, f"rng/rank-{r:05d}.pt") for r in range(topo.world_size)]
    cases += [(clean, f"objects/{n}.json") for n in STATE_OBJECTS] + [(clean, "objects/history.pt")]
    cases += [(prev, t) for t in [".metadata", *byte_shards(prev / "step-2"), "rng/rank-00001.pt"]]
    cases += [(prev, f"objects/{n}.pt") for n in STATE_OBJECTS]
    out = {}
    for i, (root, target) in enumerate(cases):
        case = base / f"case-{i}"
        _copy(root, case, topo.rank)
        if topo.rank == 0:
            plant(case / "step-2", target, marker)
        torch.distributed.barrier()
        objects = _objects(topo, history=target == "objects/history.pt")
        label = f"{'prev' if root == prev else 'current'}:{target}"
        out[label] = _attempt(topo, meshwise.Checkpointer(case, topo), objects, marker)
    for name in ("latest", "meshwise-checkpoints.json"):  # the root's own small files
        case = base / f"case-{name}"
        _copy(clean, case, topo.rank)
        if topo.rank == 0:
            plant(case, name, marker)
        torch.distributed.barrier()
        out[f"current:{name}"] = _attempt(topo, meshwise.Checkpointer(case, topo), _objects(topo), marker)
    case = base / "case-beside"  # a payload beside the JSON file that holds the state: never read
    _copy(clean, case, topo.rank)
    if topo.rank == 0:
        torch.save(Payload(marker, {"iteration": 99}), case / "step-2" / "objects" / "engine.pt")
    torch.distributed.barrier()
    out["current:objects/engine.pt beside engine.json"] = _attempt(
        topo, meshwise.Checkpointer(case, topo), _objects(topo), marker
    )
    return out


def _outside_cases(topo: Any, base: Path) -> dict[str, Any]:
    """Names read from a checkpoint that lead outside its folder: refused, nothing read; a save writes nothing
    through a planted symlink."""
    import meshwise

    marker, clean, outside = base / "MARKER", base / "clean", base / "outside"
    _copy(clean, outside, topo.rank)  # a whole, valid checkpoint outside each root below
    setups = {
        "latest names ../": lambda c: (c / "latest").write_text("../outside/step-2\n"),
        "latest is a symlink out": lambda c: ((c / "latest").unlink(), (c / "latest").symlink_to(outside / "latest")),
        "step folder is a symlink out": lambda c: (
            shutil.rmtree(c / "step-2"),
            (c / "step-2").symlink_to(outside / "step-2"),
        ),
        "shard path in .metadata": lambda c: _shard_path(c / "step-2", "../../outside/step-2/__0_0.distcp"),
        "object file is a symlink out": lambda c: _link_out(c / "step-2" / "objects" / "loader.json", outside),
        "rng file is a symlink out": lambda c: _link_out(c / "step-2" / "rng" / "rank-00001.pt", outside),
        ".metadata is a symlink out": lambda c: _link_out(c / "step-2" / ".metadata", outside),
    }
    out = {}
    for i, (label, setup) in enumerate(setups.items()):
        case = base / f"out-{i}"
        _copy(clean, case, topo.rank)
        if topo.rank == 0:
            setup(case)
        torch.distributed.barrier()
        out[label] = _attempt(topo, meshwise.Checkpointer(case, topo), _objects(topo), marker)
    # writes: a planted latest.partial and step-N.tmp symlink lead nowhere outside
    case = base / "write"
    _copy(clean, case, topo.rank)
    victim, victim_dir = base / "victim.txt", base / "victim-dir"
    if topo.rank == 0:
        victim.write_text("keep\n")
        victim_dir.mkdir()
        (victim_dir / "keep.txt").write_text("keep\n")
        (case / "latest.partial").symlink_to(victim)
        (case / "step-4.tmp").symlink_to(victim_dir, target_is_directory=True)
    torch.distributed.barrier()
    objects = _objects(topo)
    ckpt = meshwise.Checkpointer(case, topo)
    ckpt.save(4, **objects)
    ckpt.close()
    out["write"] = {
        "victim": victim.read_text(),
        "victim_dir": sorted(p.name for p in victim_dir.iterdir()),
        "latest": (case / "latest").read_text().strip(),
        "steps": ckpt.steps(),
    }
    return out


def _shard_path(step: Path, rel: str) -> None:
    md = _read_metadata_trusted(step)
    for info in md.storage_data.values():
        if info.relative_path == "__0_0.distcp":
            info.relative_path = rel
    _write_metadata(step, md)


def _link_out(file: Path, outside: Path) -> None:
    target = outside / "step-2" / file.relative_to(file.parents[1] if file.parent.name != "step-2" else file.parent)
    file.unlink()
    file.symlink_to(target)


def _scenarios(topo: Any, base: str) -> dict[str, Any]:
    root = Path(base)
    out = {"previous": _previous_format(topo, root), "current": _current_format(topo, root)}
    out["payloads"] = _payload_cases(topo, root)
    out["outside"] = _outside_cases(topo, root)
    out["marker_at_end"] = (root / "MARKER").exists()
    return out


# --------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_scenarios, 2, str(tmp_path_factory.mktemp("security")), mesh={"dp": 2}, timeout=200)


def test_previous_format_loads_through_the_safe_path(ranks):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    for rank, r in enumerate(ranks):
        prev = r["previous"]
        assert prev["rng"] == "restored" and prev["draws"] == expected["draws"][rank]
        assert prev["state"] == expected["state"]  # parameters and Adam state bit for bit
        assert prev["loader"] == expected["loader"] and prev["scheduler"] == expected["scheduler"]
        assert prev["engine"]["iteration"] == expected["engine"]["iteration"]
        assert prev["ignite_model"] == expected["state"]["model.weight"]
        assert prev["ignite_trainer"]["iteration"] == expected["engine"]["iteration"]


def test_current_format_is_code_free_and_loads(ranks):
    for r in ranks:
        cur = r["current"]
        assert cur["loaded"] == cur["saved"] and cur["rng"] == "restored"
        assert cur["loaded_draws"] == cur["draws"]
        for name in STATE_OBJECTS:
            assert f"objects/{name}.json" in cur["files"]
        assert "objects/history.pt" in cur["files"]  # holds Python objects: a torch file, read only with trust
        assert cur["rng_weights_only"] == ["numpy", "python", "torch"]  # no numpy array: weights_only as is


def test_a_user_object_holding_python_objects_needs_trust(ranks):
    for r in ranks:
        cur = r["current"]
        error = cur["untrusted_history"]
        assert "objects/history.pt" in error and "trust=True" in error, error
        assert "fractions.Fraction" in error or "Note" in error or "set" in error, error
        assert cur["history_untouched"]
        assert cur["history"] == [("start", "1/3"), ("resumed", "2/7")]
        assert cur["trusting_checkpointer"]


def test_no_planted_payload_ever_runs(ranks):
    assert not any(r["marker_at_end"] for r in ranks)
    for r in ranks:
        for label, res in r["payloads"].items():
            assert not res["marker"], label
    cases = ranks[0]["payloads"]
    target_of = {label: label.split(":", 1)[1] for label in cases}
    for label, res in cases.items():
        target = target_of[label]
        if res["outcome"] == "refused":
            named = target.split(" ")[0]
            assert named in res["error"] or Path(named).name in res["error"], (label, res["error"])
            assert res["unchanged"], label
        else:  # loaded, without reading the planted file
            assert target in ("meshwise-checkpoints.json", "objects/engine.pt beside engine.json"), label
    refused = {label for label, res in cases.items() if res["outcome"] == "refused"}
    must = {"current:.metadata", "current:rng/rank-00001.pt", "current:objects/history.pt", "prev:.metadata"}
    must |= {"prev:objects/engine.pt", "prev:rng/rank-00001.pt", "current:latest", "current:meshwise.json"}
    must |= {label for label in cases if label.endswith(".distcp")}
    assert must <= refused, must - refused
    assert any(label.endswith(".distcp") for label in cases)  # a byte value was planted in a shard
    assert (
        "trust=True" in cases["current:.metadata"]["error"] and "builtins.eval" in cases["current:.metadata"]["error"]
    )
    assert "trust=True" in cases["prev:objects/engine.pt"]["error"]
    assert all(r["payloads"] == ranks[0]["payloads"] for r in ranks)  # every rank heard the same answer


def test_names_leading_outside_are_refused_and_nothing_is_written_through_them(ranks):
    for r in ranks:
        for label, res in r["outside"].items():
            if label == "write":
                continue
            assert res["outcome"] == "refused" and res["unchanged"], (label, res)
    out = ranks[0]["outside"]
    assert "outside" in out["latest names ../"]["error"]
    assert "symlink" in out["latest is a symlink out"]["error"]
    assert "symlink" in out["step folder is a symlink out"]["error"]
    assert "../../outside" in out["shard path in .metadata"]["error"]
    for label in ("object file is a symlink out", "rng file is a symlink out", ".metadata is a symlink out"):
        assert "leads outside" in out[label]["error"], out[label]
    w = out["write"]
    assert w["victim"] == "keep\n" and w["victim_dir"] == ["keep.txt"]
    assert w["latest"] == "step-4" and w["steps"] == [2, 4]


def test_export_reads_as_data(tmp_path):
    from meshwise.checkpoint import export
    from meshwise.errors import CheckpointError

    expected = json.loads((FIXTURE / "expected.json").read_text())
    sd = torch.load(export(FIXTURE / "root", tmp_path / "prev.pt"), weights_only=True)
    assert sd["weight"].flatten().tolist() == expected["state"]["model.weight"]
    shutil.copytree(FIXTURE / "root", tmp_path / "planted")
    marker = tmp_path / "MARKER"
    plant(tmp_path / "planted" / "step-2", ".metadata", marker)
    with pytest.raises(CheckpointError, match=r"\.metadata.*trust=True"):
        export(tmp_path / "planted", tmp_path / "out.pt")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    (tmp_path / "planted" / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="outside"):
        export(tmp_path / "planted", tmp_path / "out.pt")
    # the payload is real: plain pickle runs it and hands back DCP's metadata
    md = _read_metadata_trusted(tmp_path / "planted" / "step-2")
    assert marker.exists() and type(md).__name__ == "Metadata"
