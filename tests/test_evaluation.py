"""create_evaluator: every metric over the mesh equals the one-process metric over the whole dataset, any length."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchmetrics import MetricCollection, SumMetric
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassF1Score
from torchmetrics.functional import mean_squared_error
from torchmetrics.functional.classification import binary_auroc, multiclass_accuracy, multiclass_f1_score
from torchmetrics.regression import MeanSquaredError

from meshwise.data import ArrayDataset, Shard, mesh_dataloader
from meshwise.engine import create_evaluator
from meshwise.metrics import MeanLoss, MeshMetric, compute_all
from meshwise.testing import CollectiveCounter, run_distributed

LENGTHS = (1, 5, 7, 101)
B_LOCAL = 4  # rows per rank and step; 12 for the long dataset, to keep its step count small
FEATURES, CELLS, CLASSES = 8, 8, 3


def dataset(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
    return {
        "input": x,
        "target": torch.randint(0, CLASSES, (n,), generator=g),
        "r": torch.randn(n, generator=g, dtype=torch.float64),
        "field": torch.randn(n, CELLS, generator=g, dtype=torch.float64),
        "field_target": torch.randn(n, CELLS, generator=g, dtype=torch.float64),
    }


def eval_loader(data: dict[str, torch.Tensor], topo, parts=None):
    """meshwise.data's exact evaluation: every sample once, zero-weight padding, the same step count everywhere."""
    b_local = B_LOCAL if len(data["input"]) < 100 else 3 * B_LOCAL
    return mesh_dataloader(
        ArrayDataset(data), topo, global_batch_size=b_local * topo.data_size, mode="eval", parts=parts
    )


def real_rows(loader) -> int:
    return sum(int(batch["valid"].sum()) for batch in loader)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16, dtype=torch.float64)
        self.fc2 = nn.Linear(16, CLASSES, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class ManualTensorParallelMLP(nn.Module):
    """The same MLP split Megatron-style by hand: fc1 by output features, fc2 by input features, one all-reduce."""

    def __init__(self, full: MLP, topo) -> None:
        super().__init__()
        dims = topo.replica_dims
        k, i = topo.size(dims), topo.coordinate(dims)
        self.w1 = nn.Parameter(full.fc1.weight.detach().chunk(k, 0)[i].clone())
        self.b1 = nn.Parameter(full.fc1.bias.detach().chunk(k)[i].clone())
        self.w2 = nn.Parameter(full.fc2.weight.detach().chunk(k, 1)[i].clone())
        self.b2 = nn.Parameter(full.fc2.bias.detach().clone())
        self.group = topo.group(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.tanh(x @ self.w1.T + self.b1) @ self.w2.T
        dist.all_reduce(partial, group=self.group)  # every TP rank must run the forward, or this hangs
        return partial + self.b2


def _reference(model: nn.Module, data: dict[str, torch.Tensor]) -> dict[str, float]:
    with torch.no_grad():
        logits = model(data["input"])
    t = data["target"]
    probs = logits.softmax(-1)
    return {
        "acc": multiclass_accuracy(logits, t, num_classes=CLASSES, average="micro").item(),
        "f1": multiclass_f1_score(logits, t, num_classes=CLASSES, average="macro").item(),
        "auroc": binary_auroc(probs[:, 1], (t == 1).long()).item() if len(t) > 1 else math.nan,
        "mse": mean_squared_error(logits[:, 0], data["r"]).item(),
        "count": float(len(t)),
        "loss": F.cross_entropy(logits, t).item(),
    }


def _metrics(topo, replica_check: bool) -> dict:
    """MeshMetrics made here, so the test keeps references to them (to count the collectives of a compute)."""

    def ones(output, batch):
        return (torch.ones(output.shape[0]),)

    return {
        "cls": MeshMetric(
            MetricCollection(
                {"acc": MulticlassAccuracy(CLASSES, average="micro"), "f1": MulticlassF1Score(CLASSES, average="macro")}
            ),
            topo,
            replica_check=replica_check,
        ),
        "mse": MeshMetric(MeanSquaredError(), topo, select=lambda o, b: (o[:, 0], b["r"])),
        "count": MeshMetric(SumMetric(), topo, select=ones),
        "loss": MeshMetric(MeanLoss(loss_fn=lambda p, t: F.cross_entropy(p, t, reduction="none")), topo),
        "auroc": MeshMetric(BinaryAUROC(), topo, select=lambda o, b: (o.softmax(-1)[:, 1], (b["target"] == 1).long())),
    }


def _evaluate_mlp(topo, replica_check: bool = False, dtensor: bool = False) -> dict:
    torch.manual_seed(0)
    reference_model = MLP()
    model = MLP()
    model.load_state_dict(reference_model.state_dict())
    if topo.size(topo.replica_dims) > 1 and not dtensor:
        model = ManualTensorParallelMLP(model, topo)
    elif topo.size(topo.replica_dims) > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        # every rank built the same full weights from one seed: no scatter from rank 0 needed
        model = parallelize_module(model, topo.submesh(topo.replica_dims), plan, src_data_rank=None)
    out = {"results": {}, "reference": {}}
    for n in LENGTHS:
        data = dataset(n)
        metrics = _metrics(topo, replica_check)
        evaluator = create_evaluator(model, topo, metrics=metrics)
        loader = eval_loader(data, topo)
        out.setdefault("rows", {})[n] = real_rows(loader)
        evaluator.run(loader)
        out["results"][n] = dict(evaluator.state.metrics)
        out["reference"][n] = _reference(reference_model, data)
        if n == 5:  # a plain torchmetrics Metric: create_evaluator wraps it, with its replica_check
            acc = {"acc": MulticlassAccuracy(CLASSES, average="micro")}
            plain = create_evaluator(model, topo, metrics=acc, replica_check=replica_check)
            plain.run(eval_loader(data, topo))
            out["plain_acc"] = plain.state.metrics["acc"]
        if n == 101:
            mesh_metrics = list(metrics.values())
            with CollectiveCounter() as all_metrics:
                again = compute_all(mesh_metrics)
            recorded = [m.last_collectives for m in mesh_metrics]
            sum_only = [m for name, m in metrics.items() if name != "auroc"]
            with CollectiveCounter() as sums:
                compute_all(sum_only)
            out["collectives"] = (all_metrics.calls, sums.calls, recorded)
            out["again_acc"] = again[0]["acc"].item()
    out["training_restored"] = model.training
    return out


def _check(results: list[dict], metric_size: int, replica_check: bool) -> None:
    for rank_out in results:
        for n in LENGTHS:
            got, ref = rank_out["results"][n], rank_out["reference"][n]
            assert set(got) == {"acc", "f1", "auroc", "mse", "count", "loss"}, got
            assert got["count"] == n  # not multiplied by the replica (TP) degree
            for key, value in ref.items():
                if key == "auroc" and n == 1:
                    continue  # one sample has one class: AUROC is undefined in one process too
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (n, key, got[key], value)
        assert all(r["results"] == results[0]["results"] for r in results)  # same on every rank
        fused, sums, recorded = rank_out["collectives"]
        if metric_size == 1:
            assert fused == [] and sums == [] and recorded == [0] * 5
        else:
            check = ["all_gather"] if replica_check else []  # the replica check of "cls": one more gather
            assert fused == ["all_reduce", "all_gather", *check], fused  # AUROC's concatenated states: a gather
            assert sums == ["all_reduce", *check], sums  # one fused collective for every sum-reducible state
            assert recorded == [2 + len(check)] * 5
        assert rank_out["again_acc"] == pytest.approx(rank_out["reference"][101]["acc"])
        assert rank_out["plain_acc"] == pytest.approx(rank_out["reference"][5]["acc"], rel=1e-6)
        assert rank_out["training_restored"]


@pytest.mark.parametrize(
    ("nprocs", "mesh", "metric_size", "replica_check"),
    [(3, {"dp": 3}, 3, False), (4, {"dp": 2, "tp": 2}, 2, True), (4, {"dp": 4}, 4, False), (4, {"tp": 4}, 1, False)],
    ids=["dp3", "dp2xtp2", "dp4", "tp4"],
)
def test_evaluator_matches_one_process(nprocs, mesh, metric_size, replica_check):
    # dp2xtp2 runs torch's tensor parallel (DTensor); tp4 a hand-made Megatron split, cheaper on 2 cores
    dtensor = mesh.get("tp") == 2
    results = run_distributed(_evaluate_mlp, nprocs, replica_check, dtensor, mesh=mesh, timeout=120)
    _check(results, metric_size, replica_check)
    if metric_size > 1:  # with one sample, some data ranks run only padded steps
        assert sorted(r["rows"][1] for r in results)[0] == 0


# --------------------------------------------------------------------------- split dims


class SplitModel(nn.Module):
    """A field model split over the cells: per-cell output, and per-sample logits summed over the split ranks."""

    def __init__(self, topo=None) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.scale = nn.Parameter(torch.randn(CELLS, dtype=torch.float64))
        self.head = nn.Parameter(torch.randn(CELLS, CLASSES, dtype=torch.float64))
        self.topo = topo

    def forward(self, field: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.topo is None:
            scale, head = self.scale, self.head
        else:
            split = self.topo.split_dims
            piece = self.topo.coordinate(split)
            scale = self.scale.chunk(self.topo.size(split))[piece]
            head = self.head.chunk(self.topo.size(split))[piece]
        cells = torch.tanh(field * scale)
        logits = cells @ head
        if self.topo is not None:
            dist.all_reduce(logits, group=self.topo.group(self.topo.split_dims))  # partial sums of the parts
        return {"cells": cells, "logits": logits}


def _evaluate_split(topo) -> dict:
    model = SplitModel(topo)
    reference_model = SplitModel()
    out = {"results": {}, "reference": {}}
    l1 = MeanLoss(loss_fn=lambda p, t: (p - t).abs())
    for n in LENGTHS:
        data = dataset(n)
        metrics = {
            # per-cell metrics: every split rank contributes its part of the field
            "mse": MeshMetric(MeanSquaredError(), topo, select=lambda o, b: (o["cells"], b["field_target"])),
            "cell_l1": MeshMetric(l1, topo, select=lambda o, b: (o["cells"], b["field_target"])),
            # per-sample metrics: each split rank holds the full logits; split coordinate 0 counts the sample
            "cls": MeshMetric(
                MetricCollection(
                    {
                        "acc": MulticlassAccuracy(CLASSES, average="micro"),
                        "f1": MulticlassF1Score(CLASSES, average="macro"),
                    }
                ),
                topo,
                split_inputs="whole",
                select=lambda o, b: (o["logits"], b["target"]),
            ),
            "auroc": MeshMetric(
                BinaryAUROC(),
                topo,
                split_inputs="whole",
                select=lambda o, b: (o["logits"].softmax(-1)[:, 1], (b["target"] == 1).long()),
            ),
            "count": MeshMetric(
                SumMetric(), topo, split_inputs="whole", select=lambda o, b: (torch.ones(len(b["index"])),)
            ),
        }
        evaluator = create_evaluator(model, topo, metrics=metrics, forward=lambda m, b: m(b["field"]))
        loader = eval_loader(data, topo, parts={"field": Shard(0), "field_target": Shard(0)})
        out.setdefault("rows", {})[n] = real_rows(loader)
        evaluator.run(loader)
        out["results"][n] = dict(evaluator.state.metrics)
        with torch.no_grad():
            ref = reference_model(data["field"])
        t = data["target"]
        out["reference"][n] = {
            "mse": mean_squared_error(ref["cells"], data["field_target"]).item(),
            "cell_l1": (ref["cells"] - data["field_target"]).abs().mean().item(),
            "acc": multiclass_accuracy(ref["logits"], t, num_classes=CLASSES, average="micro").item(),
            "f1": multiclass_f1_score(ref["logits"], t, num_classes=CLASSES, average="macro").item(),
            "auroc": binary_auroc(ref["logits"].softmax(-1)[:, 1], (t == 1).long()).item() if n > 1 else math.nan,
            "count": float(n),
        }
    return out


def test_evaluator_split_dims_sum_parts_and_count_samples_once():
    results = run_distributed(_evaluate_split, 4, mesh={"dp": 2, "cp": 2}, timeout=120)
    assert [r["rows"][1] for r in results] == [1, 1, 0, 0]  # data rank 1 (ranks 2, 3) holds no real sample
    for rank_out in results:
        assert rank_out["results"] == results[0]["results"]
        for n in LENGTHS:
            got, ref = rank_out["results"][n], rank_out["reference"][n]
            assert got["count"] == n  # the leader of each split group counts each sample once
            for key, value in ref.items():
                if key == "auroc" and n == 1:
                    continue
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (n, key, got[key], value)


def test_evaluator_refuses_a_train_loader():
    """A loader made with mode="train" would evaluate 192 of 203 samples, shuffled: refused before any step."""
    import meshwise
    from meshwise.errors import MetricError

    topo = meshwise.init({"dp": 1})  # a world of one needs no launch
    try:
        model = MLP()
        metrics = {"count": SumMetric()}
        train = mesh_dataloader(ArrayDataset(dataset(203)), topo, global_batch_size=16, mode="train")
        evaluator = create_evaluator(model, topo, metrics=metrics, select=lambda o, b: torch.ones(len(o)))
        with pytest.raises(MetricError, match=r"192 of 203 samples.*mode='eval'"):
            evaluator.run(train)
        assert evaluator.state.iteration == 0 and model.training
        evaluator = create_evaluator(model, topo, metrics=metrics, select=lambda o, b: torch.ones(len(o)))
        evaluator.run(mesh_dataloader(ArrayDataset(dataset(203)), topo, global_batch_size=16, mode="eval"))
        assert evaluator.state.metrics["count"] == 203 and model.training
    finally:
        meshwise.shutdown()
