"""MeshMetric: fused sync over batch + split dims, masks, replica check, stages, bad input, no hang on skip."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torchmetrics import CatMetric, MaxMetric, MeanMetric, Metric, MetricCollection, MinMetric, SumMetric
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassF1Score
from torchmetrics.functional.classification import binary_auroc, multiclass_accuracy, multiclass_f1_score

from meshwise.errors import CollectiveTimeoutError, MetricError
from meshwise.metrics import MeanLoss, MeshMetric, MetricSyncTimeout, compute_all, filter_rows
from meshwise.testing import CollectiveCounter, run_distributed


class RankMean(Metric):
    """A state reduced with "mean" (the unweighted mean over ranks, as torchmetrics defines it)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("x", torch.zeros(2), dist_reduce_fx="mean")

    def update(self, value: torch.Tensor) -> None:
        self.x += value

    def compute(self) -> torch.Tensor:
        return self.x


class Spread(Metric):
    """A state with a custom reduction over the stacked per-rank values."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state(
            "x", torch.zeros(()), dist_reduce_fx=lambda stacked: stacked.max(0).values - stacked.min(0).values
        )

    def update(self, value: torch.Tensor) -> None:
        self.x += value.sum()

    def compute(self) -> torch.Tensor:
        return self.x


class ListOfSums(Metric):
    """A list state without reduction: meshwise leaves it to torchmetrics' own sync, over the right group."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("parts", [], dist_reduce_fx=None)

    def update(self, value: torch.Tensor) -> None:
        self.parts.append(value.sum().reshape(1))

    def compute(self) -> torch.Tensor:
        return torch.cat(list(self.parts)).sum()


def _data(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randint(0, 3, (n,), generator=g), torch.rand(n, generator=g)


def _plain(value):
    """Tensors as nested lists: tensors sent through the result queue would need the sending process alive."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _raises(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except MetricError as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not raise MetricError")


def _scenarios(topo) -> dict:
    out: dict = {}
    dp = topo.coordinate("dp")
    # dp rank 0 holds 6 rows (2 of them padding), dp rank 1 holds 0 real rows: states of every kind.
    n_rows = 6 if dp == 0 else 3
    x, labels, scores = _data(10 + dp, n_rows)
    valid = torch.tensor([True, True, False, True, False, True]) if dp == 0 else torch.zeros(3, dtype=torch.bool)
    metrics = {
        "sum": MeshMetric(SumMetric(), topo),
        "mean": MeshMetric(MeanMetric(), topo),
        "max": MeshMetric(MaxMetric(), topo),
        "min": MeshMetric(MinMetric(), topo),
        "cat": MeshMetric(CatMetric(), topo),
        "rank_mean": MeshMetric(RankMean(), topo),
        "spread": MeshMetric(Spread(), topo),
        "loss": MeshMetric(MeanLoss(), topo),
        "cls": MeshMetric(MetricCollection({"acc": MulticlassAccuracy(3), "f1": MulticlassF1Score(3)}), topo),
        "auroc": MeshMetric(BinaryAUROC(), topo),
    }
    for name in ("sum", "mean", "max", "min", "cat", "spread", "loss"):
        metrics[name].update(x, valid=valid)
    metrics["rank_mean"].update(torch.tensor([1.0, 2.0]) * (dp + 1))  # no mask: every rank updates
    logits = torch.stack([x, -x, x * x], dim=1)
    metrics["cls"].update(logits, labels, valid=valid)
    metrics["auroc"].update(scores, (labels == 1).long(), valid=valid)
    with CollectiveCounter() as fused:
        values = compute_all(list(metrics.values()))
    out["fused_calls"] = fused.calls
    out["values"] = dict(zip(metrics, values))
    # the one-process reference over the rows that are valid anywhere
    masks = [torch.tensor([True, True, False, True, False, True]), torch.zeros(3, dtype=torch.bool)]
    parts = [[t[m] for t in _data(10 + d, len(m))] for d, m in enumerate(masks)]
    all_x, all_labels, all_scores = (torch.cat([p[i] for p in parts]) for i in range(3))
    all_logits = torch.stack([all_x, -all_x, all_x * all_x], dim=1)
    out["reference"] = {
        "sum": all_x.sum(),
        "mean": all_x.mean(),
        "max": all_x.max(),
        "min": all_x.min(),
        "cat": all_x,
        "rank_mean": torch.tensor([1.0, 2.0]) * 1.5,
        "spread": all_x.sum().abs(),  # max - min of (rank 0 sum, rank 1: 0)
        "loss": all_x.double().mean(),
        "acc": multiclass_accuracy(all_logits, all_labels, num_classes=3),
        "f1": multiclass_f1_score(all_logits, all_labels, num_classes=3),
        "auroc": binary_auroc(all_scores, (all_labels == 1).long()),
    }
    # states are local again after compute: one more update keeps accumulating
    metrics["sum"].update(torch.ones(3))
    out["sum_after"] = metrics["sum"].compute()
    out["sum_cached"] = metrics["sum"].compute()
    # a collection whose metrics share states (one compute group) keeps accumulating after a fused compute
    more = [_data(20 + d, 4) for d in range(2)]
    x2, labels2, _ = more[dp]
    metrics["cls"].update(torch.stack([x2, -x2, x2 * x2], dim=1), labels2)
    out["cls_after"] = metrics["cls"].compute()
    out["compute_groups"] = len(metrics["cls"].metric.compute_groups)
    union_x = torch.cat([all_x, *(m[0] for m in more)])
    union_labels = torch.cat([all_labels, *(m[1] for m in more)])
    union_logits = torch.stack([union_x, -union_x, union_x * union_x], dim=1)
    out["reference"]["acc_after"] = multiclass_accuracy(union_logits, union_labels, num_classes=3)
    out["reference"]["f1_after"] = multiclass_f1_score(union_logits, union_labels, num_classes=3)

    # sum-only collection: one collective; torchmetrics syncing each metric on its own needs many
    group = topo.group(topo.metric_dims)

    def collection(**kw):
        return MetricCollection(
            {
                "acc": MulticlassAccuracy(3, **kw),
                "f1": MulticlassF1Score(3, average="macro", **kw),
                "sum": SumMetric(**kw),
            },
            compute_groups=False,
        )

    ours, naive = MeshMetric(collection(), topo), collection(process_group=group)
    ours_x, ours_y = logits, labels
    with torch.no_grad():
        ours.metric["acc"].update(ours_x, ours_y)
        ours.metric["f1"].update(ours_x, ours_y)
        ours.metric["sum"].update(x)
        naive["acc"].update(ours_x, ours_y)
        naive["f1"].update(ours_x, ours_y)
        naive["sum"].update(x)
    with CollectiveCounter() as one:
        mine = ours.compute()
    with CollectiveCounter() as many:
        theirs = naive.compute()
    out["sum_only_calls"], out["naive_calls"] = one.calls, many.calls
    out["same_as_torchmetrics"] = all(torch.allclose(mine[k], theirs[k]) for k in mine)
    out["last_collectives"] = ours.last_collectives

    # a list state torchmetrics alone can merge: synced by torchmetrics over the metric group, not the world
    fallback = MeshMetric(ListOfSums(), topo)
    fallback.update(torch.tensor([float(dp + 1)]))
    out["fallback"] = fallback.compute().item()

    # bad input
    m = MeshMetric(SumMetric(), topo)
    out["err_mask_2d"] = _raises(m.update, torch.ones(4), valid=torch.ones(4, 1, dtype=torch.bool))
    out["err_mask_len"] = _raises(m.update, torch.ones(4), valid=torch.ones(3, dtype=torch.bool))
    out["err_replica_dims"] = _raises(MeshMetric, SumMetric(), topo, dims=("dp", "tp"))
    out["err_unknown_dims"] = _raises(MeshMetric, SumMetric(), topo, dims="nope")
    out["err_foreign_group"] = _raises(MeshMetric, SumMetric(process_group=topo.group("tp")), topo)
    out["err_world_group"] = _raises(MeshMetric, SumMetric(process_group=dist.group.WORLD), topo)
    out["err_not_a_metric"] = _raises(MeshMetric, lambda x: x, topo)
    out["err_sync_on_step"] = _raises(MeshMetric, SumMetric(dist_sync_on_step=True), topo)
    out["ok_own_group"] = MeshMetric(SumMetric(process_group=group), topo).dims

    # replica check: tp rank 1 sees other outputs than tp rank 0
    tp = topo.coordinate("tp")
    checked = MeshMetric(SumMetric(), topo, replica_check=True)
    unchecked = MeshMetric(SumMetric(), topo)
    for m in (checked, unchecked):
        m.update(torch.ones(3) * (1 + tp))
    out["replica_error"] = _raises(checked.compute)
    with CollectiveCounter() as off:
        unchecked.compute()
    out["replica_off_calls"] = off.calls
    topo.debug = True  # what init(debug=True) / MESHWISE_DEBUG=1 sets: the check's default follows it
    try:
        out["replica_env_error"] = _raises(unchecked.compute)
    finally:
        topo.debug = False
    agreeing = MeshMetric(SumMetric(), topo, replica_check=True)
    agreeing.update(torch.ones(2))
    out["replica_ok"] = agreeing.compute().item()

    # rank 2 skips compute(): its dp partner (rank 0) gets an error naming the group, not a hang
    late = MeshMetric(SumMetric(), topo)
    late.update(torch.ones(1))
    start = time.monotonic()
    out["skip"] = None
    if topo.rank != 2:
        try:
            out["skip_value"] = late.compute().item()
        except MetricSyncTimeout as exc:
            out["skip"] = str(exc)
            out["skip_types"] = (isinstance(exc, MetricError), isinstance(exc, CollectiveTimeoutError))
    else:
        time.sleep(5)  # alive but absent: its partner must hit the process-group timeout (3 s), not a closed socket
    out["elapsed"] = time.monotonic() - start
    return _plain(out)


def _close(a, b) -> bool:
    return torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), rtol=1e-6, atol=1e-7)


def test_mesh_metrics_fuse_mask_check_and_fail_loudly():
    results = run_distributed(_scenarios, 4, mesh={"dp": 2, "tp": 2}, pg_timeout=3, timeout=90)
    for rank, out in enumerate(results):
        assert out["fused_calls"] == ["all_reduce", "all_gather"], out["fused_calls"]
        values, ref = out["values"], out["reference"]
        for key in ("sum", "mean", "max", "min", "cat", "rank_mean", "spread", "loss", "auroc"):
            assert _close(values[key], ref[key]), (rank, key, values[key], ref[key])
        assert _close(values["cls"]["acc"], ref["acc"]) and _close(values["cls"]["f1"], ref["f1"])
        assert _close(out["sum_after"], ref["sum"] + 6) and _close(out["sum_cached"], ref["sum"] + 6)
        assert out["compute_groups"] == 1  # accuracy and F1 share their states
        assert _close(out["cls_after"]["acc"], ref["acc_after"]) and _close(out["cls_after"]["f1"], ref["f1_after"])
        assert out["sum_only_calls"] == ["all_reduce"]  # one collective for every sum state of the collection
        assert len(out["naive_calls"]) >= 9, out["naive_calls"]  # torchmetrics: one or more per state
        assert out["same_as_torchmetrics"] and out["last_collectives"] == 1
        assert out["fallback"] == 3.0  # 1 + 2 over dp, not 6 over the world
        assert "mask must be 1-D" in out["err_mask_2d"]
        assert "3 rows but argument 0 has shape (4,)" in out["err_mask_len"]
        assert "tp (replica)" in out["err_replica_dims"] and "batch and split" in out["err_replica_dims"]
        assert "not part of the topology" in out["err_unknown_dims"]
        assert "not this topology's metric group" in out["err_foreign_group"]
        assert "not this topology's metric group" in out["err_world_group"]
        assert "torchmetrics Metric" in out["err_not_a_metric"]
        assert "dist_sync_on_step" in out["err_sync_on_step"]
        assert out["ok_own_group"] == ("dp",)
        group = "[0, 1]" if rank in (0, 1) else "[2, 3]"
        msg = out["replica_error"]
        assert "tp (replica)" in msg and f"group of ranks {group}" in msg and "SumMetric" in msg, msg
        assert out["replica_off_calls"] == ["all_reduce"]  # no check, no cost
        assert "tp (replica)" in out["replica_env_error"]
        assert out["replica_ok"] == 4.0
    # the skipped compute: rank 0 (dp group [0, 2]) fails fast and names the dim, role and missing rank
    msg = results[0]["skip"]
    assert msg is not None and "dp (batch)" in msg and "ranks [2] did not arrive" in msg, msg
    assert tuple(results[0]["skip_types"]) == (True, True)
    assert 2.5 < results[0]["elapsed"] < 20  # the topology's timeout, not a hang
    assert results[1]["skip"] is None and results[1]["skip_value"] == 2.0 and results[3]["skip_value"] == 2.0


def _stages(topo) -> dict:
    broadcast = MeshMetric(SumMetric(), topo)
    silent = MeshMetric(SumMetric(), topo, stage_result="none")
    for m in (broadcast, silent):  # only the last stage holds outputs; the update is a no-op elsewhere
        m.update(torch.ones(3) * (topo.coordinate("dp") + 1) * (1 if topo.is_last_stage else 100))
    with CollectiveCounter() as calls:
        value = broadcast.compute()
    silent_value = silent.compute()
    return {"value": value.item(), "calls": calls.calls, "silent": _plain(silent_value), "last": topo.is_last_stage}


def test_only_the_last_stage_syncs_and_the_others_receive():
    results = run_distributed(_stages, 4, mesh={"pp": 2, "dp": 2}, timeout=60)
    for out in results:
        assert out["value"] == 9.0  # (1 + 2) * 3 rows, from the last stage only
        if out["last"]:
            assert out["calls"] == ["all_reduce", "broadcast_object_list"] and out["silent"] == 9.0
        else:
            assert out["calls"] == ["broadcast_object_list"] and out["silent"] is None


def _split_inputs(topo) -> dict:
    parts = MeshMetric(SumMetric(), topo)  # default: each split rank holds its part of the samples
    whole = MeshMetric(SumMetric(), topo, split_inputs="whole")  # every split rank holds the whole samples
    for m in (parts, whole):
        m.update(torch.tensor([float(topo.rank + 1)]))
    return {
        "parts": parts.compute().item(),
        "whole": whole.compute().item(),
        "bad": _raises(MeshMetric, SumMetric(), topo, split_inputs="leader"),
        "repr": repr(whole),
    }


def test_split_inputs_parts_add_up_and_whole_counts_once():
    results = run_distributed(_split_inputs, 4, mesh={"dp": 2, "cp": 2}, timeout=60)  # cp=1: ranks 1 and 3
    for out in results:
        assert out["parts"] == 1 + 2 + 3 + 4  # every rank's part
        assert out["whole"] == 1 + 3  # split coordinate 0 only: ranks 0 and 2
        assert "split_inputs" in out["bad"] and "'parts'" in out["bad"] and "'whole'" in out["bad"], out["bad"]
        assert "'leader'" in out["bad"] and "split_inputs='whole'" in out["repr"]


def test_filter_rows_and_mean_loss_in_one_process():
    valid = torch.tensor([True, False, True])
    args, kwargs, kept = filter_rows(valid, torch.arange(3), torch.tensor(5.0), weight=torch.ones(3, 2))
    assert kept == 2 and args[0].tolist() == [0, 2] and args[1].item() == 5.0 and kwargs["weight"].shape == (2, 2)
    assert filter_rows(None, 1)[2] == -1
    with pytest.raises(MetricError, match="bool"):
        filter_rows(torch.ones(3), torch.ones(3))
    loss = MeanLoss(sync_on_compute=False)
    loss.update(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # per-token losses: each token weighs one
    loss.update(torch.tensor(10.0), weight=4)  # a scalar batch mean over 4 tokens
    assert loss.compute().item() == pytest.approx((1 + 2 + 3 + 4 + 40) / 8)
    with pytest.raises(MetricError, match="broadcast"):
        loss.update(torch.ones(3), weight=torch.ones(2))
    assert torch.isnan(MeanLoss(sync_on_compute=False).compute())


def test_a_metric_set_to_float64_keeps_float64_inside_mesh_metric():
    """torchmetrics' .to(device) resets set_dtype's choice; MeshMetric restores it, so float64 inputs stay exact."""
    from torchmetrics import MeanMetric, MetricCollection, SumMetric

    import meshwise
    from meshwise.metrics import MeshMetric

    x = torch.rand(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    topo = meshwise.init({"dp": 1})
    try:
        single = MeshMetric(SumMetric().set_dtype(torch.float64), topo)
        both = MeshMetric(MetricCollection({"a": SumMetric().set_dtype(torch.float64), "b": MeanMetric()}), topo)
        single.update(x)
        both.update(x)
        assert single.compute().item() == x.sum().item()
        result = both.compute()
        assert result["a"].item() == x.sum().item() and result["b"].dtype == torch.float32  # each keeps its own
    finally:
        meshwise.shutdown()
