"""Writes tests/fixtures/ckpt_format1/: checkpoints of meshwise's first on-disk format, as its save wrote them.

Kept to show how the committed fixture was made (by the code before checkpoints became code-free, where every
small state was a full pickle): running it again with today's code writes today's format, not that one. Two gloo
ranks on dp=2: an FSDP2 Linear in float64 (no bias: a smaller fixture), Adam after two steps, an ignite Engine
(``EngineState``), the loader's cursor, an LR scheduler, each rank's RNG streams (``root/step-2``), and a
``MeshSaver`` folder of ignite's ``Checkpoint`` of the model and the engine (``ignite/``). ``expected.json`` holds
the values a load must give back. Written 2026-12-05 with torch 2.13.0, numpy 2.4, meshwise at commit 9f528ed.

    flock /tmp/mw-launch.lock nice .venv/bin/python tests/ckpt_scripts/make_format1_fixture.py
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_format1"


def build(topo: Any) -> tuple[Any, Any, Any, Any]:
    """The fixture's objects before training: model, optimizer, scheduler and loader (also what a load fills)."""
    from torch.distributed.fsdp import fully_shard

    from meshwise.data import mesh_dataloader

    torch.manual_seed(7)
    model = torch.nn.Linear(4, 3, bias=False).double()
    fully_shard(model, mesh=topo.submesh(topo.batch_dims))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = {"x": torch.arange(32, dtype=torch.float64).reshape(8, 4) / 10, "y": torch.arange(8) % 3}
    loader = mesh_dataloader(data, topo, global_batch_size=4, seed=3)
    return model, opt, sched, loader


def full(model: Any, opt: Any) -> dict[str, list]:
    """Parameters and Adam state as whole float lists (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().flatten().tolist() for k, v in msd.items()}
    for fqn, st in sorted(osd["state"].items()):
        for k, v in st.items():
            out[f"opt.{fqn}.{k}"] = torch.as_tensor(v).flatten().tolist()
    return out


def draws() -> list[float]:
    """One draw of each RNG stream: equal after a restore at the same mesh."""
    return [torch.rand(()).item(), float(np.random.rand()), random.random()]


def write(topo: Any, out: str) -> dict[str, Any]:
    from ignite.engine import Engine
    from ignite.handlers import Checkpoint

    import meshwise
    from meshwise.checkpoint import MeshSaver
    from meshwise.engine.handlers import EngineState

    model, opt, sched, loader = build(topo)

    def step(engine: Any, batch: Any) -> float:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        return loss.item()

    trainer = Engine(step)
    trainer.run(loader, max_epochs=1, epoch_length=2)
    sched.step()
    torch.manual_seed(100 + topo.rank)
    np.random.seed(200 + topo.rank)
    random.seed(300 + topo.rank)
    ckpt = meshwise.Checkpointer(Path(out) / "root", topo)
    ckpt.save(2, model=model, optimizer=opt, engine=EngineState(trainer), loader=loader, scheduler=sched)
    ckpt.close()
    after = draws()
    saver = MeshSaver(Path(out) / "ignite", topo)
    to_save = {"model": model, "trainer": trainer}
    Checkpoint(to_save, saver, n_saved=1)(trainer)
    saver.close()
    return {
        "state": full(model, opt),
        "engine": trainer.state_dict(),
        "loader": loader.state_dict(),
        "scheduler": sched.state_dict(),
        "draws": after,
        "ignite_file": sorted(p.name for p in (Path(out) / "ignite").iterdir() if p.is_dir())[0],
    }


def main() -> None:
    from meshwise.testing import run_distributed

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    ranks = run_distributed(write, 2, str(OUT), mesh={"dp": 2}, timeout=120)
    expected = {k: ranks[0][k] for k in ("state", "engine", "loader", "scheduler", "ignite_file")}
    expected["draws"] = [r["draws"] for r in ranks]
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, default=float) + "\n")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT}: {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
