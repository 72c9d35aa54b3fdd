"""Hang and mismatch reports: a skipped or mismatched collective names the dims, roles, step and ranks."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from meshwise.debug import guarded
from meshwise.errors import CollectiveTimeoutError
from meshwise.testing import run_distributed


def _scenarios(topo):
    out = {}
    # 1. A guarded collective that every rank makes gives the plain result.
    t = torch.tensor([float(topo.rank)])
    for step in range(20):  # past the mark-retention window, so old marks are deleted
        t = torch.tensor([float(topo.rank)])
        with guarded(topo, "dp", "all_reduce", tensor=t, step=step):
            dist.all_reduce(t, group=topo.group("dp"))
    out["sum"] = t.item()
    # 2. Debug mode: rank 3 holds another shape -> an error before the collective, no gloo abort.
    t = torch.zeros(4 if topo.rank != 3 else 5)
    try:
        with guarded(topo, "dp", "all_reduce", tensor=t, step=20, check=True):
            dist.all_reduce(t, group=topo.group("dp"))
        out["mismatch"] = None
    except CollectiveTimeoutError as exc:
        out["mismatch"] = str(exc)
    # 3. Rank 1 skips a step: its tp partner times out and is told who did not arrive.
    start = time.monotonic()
    out["skip"] = None
    if topo.rank != 1:
        t = torch.ones(2)
        try:
            with guarded(topo, "tp", "all_reduce", tensor=t, step=21):
                dist.all_reduce(t, group=topo.group("tp"))
        except CollectiveTimeoutError as exc:
            out["skip"] = str(exc)
    out["elapsed"] = time.monotonic() - start
    return out


def test_guarded_collectives_name_what_went_wrong():
    results = run_distributed(_scenarios, 4, mesh={"dp": 2, "tp": 2}, pg_timeout=3, timeout=60)
    assert [r["sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]  # dp groups [0,2] and [1,3]
    # dp group [1,3]: both ranks see the mismatch; group [0,2] agrees and runs.
    assert results[0]["mismatch"] is None and results[2]["mismatch"] is None
    for r in (1, 3):
        msg = results[r]["mismatch"]
        assert "dp (batch)" in msg and "group of ranks [1, 3]" in msg and "step 20" in msg
    assert "ranks called something else: 3: 'all_reduce float32[5] step 20'" in results[1]["mismatch"]
    msg = results[0]["skip"]
    assert msg is not None and "tp (replica)" in msg and "ranks [1] did not arrive" in msg and "step 21" in msg
    assert results[0]["elapsed"] < 15


def _trainer_with_a_rank_that_stops_early(topo):
    import meshwise
    from meshwise.data import ArrayDataset, mesh_dataloader

    torch.manual_seed(0)
    model = meshwise.parallelize(torch.nn.Linear(4, 1), topo, dp="replicate")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = meshwise.create_trainer(model, opt, torch.nn.functional.mse_loss, topo)
    data = ArrayDataset({"input": torch.randn(64, 4), "target": torch.randn(64, 1)})
    loader = mesh_dataloader(data, topo, global_batch_size=8)
    start = time.monotonic()
    try:
        trainer.run(loader, max_epochs=1, epoch_length=3 if topo.rank == 0 else 2)  # rank 1 leaves early
    except CollectiveTimeoutError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def test_trainer_names_the_rank_that_left_the_loop():
    results = run_distributed(_trainer_with_a_rank_that_stops_early, 2, mesh={"dp": 2}, pg_timeout=3, timeout=60)
    message, elapsed = results[0]
    assert message is not None, "rank 0 should have been told that rank 1 never arrived"
    assert "dp (batch)" in message and "trainer step" in message and "step 3" in message
    assert "ranks [1] did not arrive" in message
    assert results[1][0] is None and elapsed < 20
