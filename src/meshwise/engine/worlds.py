"""A checkpoint folder's history of worlds (``worlds.jsonl``): which world trained from which step, and each restart
said in one log line (the old and the new mesh, the checkpoint step resumed from, the steps lost)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from meshwise import dryrun
from meshwise.errors import CheckpointError
from meshwise.report import WORLDS_FILE
from meshwise.topology import Topology

__all__ = ["WorldHistory"]

log = logging.getLogger("meshwise.engine")

_REACHED_FILE = ".reached-step"  # the last step the current world completed, replaced after every step


def _mesh_text(mesh: dict[str, int]) -> str:
    return " x ".join(f"{d}={s}" for d, s in mesh.items())


def _world_text(record: dict[str, Any]) -> str:
    nodes = record.get("nodes")
    where = f", {nodes} node{'s' if nodes != 1 else ''}" if nodes else ""
    return f"{record['world_size']} ranks ({_mesh_text(record['mesh'])}{where})"


class WorldHistory:
    """Rank 0 appends one line to ``root/worlds.jsonl`` at every start of a run in ``root`` and keeps the last step
    reached; the other ranks, and a dry run, write nothing. Kept by :class:`~meshwise.engine.handlers.Checkpointing`."""

    def __init__(self, root: str | os.PathLike[str], topology: Topology) -> None:
        self.root, self.topology = Path(root), topology
        self.writes = topology.rank == 0 and dryrun.active() is None  # a dry run writes nothing (docs/dryrun.md)
        self.path = self.root / WORLDS_FILE
        self.started = False
        self.world_id = uuid.uuid4().hex[:12]

    def start(self, resumed_step: int | None) -> dict[str, Any] | None:
        """Record this world (and log the restart, if one came before); rank 0's record, None elsewhere."""
        self.started = True
        if not self.writes:
            return None
        topo, env = self.topology, self.topology.environment
        before = self.records()
        reached = self._reached()
        record = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world": self.world_id,
            "world_size": topo.world_size,
            "nodes": len(set(topo.node_of_rank)) or 1,
            "mesh": topo.sizes,
            "restart": env.restart_count,
            "resumed_from": resumed_step,
            "previous_reached": reached,
            "steps_lost": None if reached is None else max(0, reached - (resumed_step or 0)),
        }
        if env.run_id:
            record["run_id"] = env.run_id
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if before:
            log.warning("%s", self.restart_text(before[-1], record))
        return record

    @staticmethod
    def restart_text(old: dict[str, Any], new: dict[str, Any]) -> str:
        """``restarted on 2 ranks (dp=1 x tp=2, 1 node), was 4 ranks (...): resumed from checkpoint step 6, 2
        steps lost (the last world reached step 8)``."""
        same = (old["world_size"], old["mesh"]) == (new["world_size"], new["mesh"])
        where = f"on the same world, {_world_text(new)}" if same else f"on {_world_text(new)}, was {_world_text(old)}"
        step = new["resumed_from"]
        resumed = "from the start (no checkpoint)" if step is None else f"from checkpoint step {step}"
        lost = new["steps_lost"]
        if lost is None:
            loss = "steps lost unknown (the last world recorded no step)"
        else:
            loss = f"{lost} step{'s' if lost != 1 else ''} lost (the last world reached step {new['previous_reached']})"
        return f"this run restarted {where}: resumed {resumed}, {loss}"

    def reached(self, step: int) -> None:
        """Remember ``step`` as completed by this world (a file replaced whole: a kill leaves the old one)."""
        if not self.writes:
            return
        tmp = self.root / f"{_REACHED_FILE}.tmp"
        tmp.write_text(str(int(step)))
        os.replace(tmp, self.root / _REACHED_FILE)

    def check_owner(self) -> None:
        """Refuse to save when another world recorded itself here after this one: two worlds training side by side
        (a node counted dead while alive, two jobs given one folder) must never interleave their checkpoints."""
        if not self.writes or not self.started:
            return
        records = self.records()
        last = records[-1] if records else {}
        if last.get("world") != self.world_id:
            raise CheckpointError(
                f"another world started in {self.root} at {last.get('time', '?')} ({last.get('world_size', '?')} "
                f"ranks, run id {last.get('run_id', '?')}) while this one trains: two worlds must not write one run. "
                "This world stops without saving; the newer one owns the folder (an elastic agent rejoins its "
                "rendezvous; otherwise give each job its own checkpoint folder)"
            )

    def records(self) -> list[dict[str, Any]]:
        """Every world recorded so far, oldest first (a line cut short by a kill is skipped)."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def _reached(self) -> int | None:
        try:
            return int((self.root / _REACHED_FILE).read_text())
        except (OSError, ValueError):
            return None
