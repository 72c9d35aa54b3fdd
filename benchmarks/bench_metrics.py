"""Collectives and time per compute() of 5 metrics: meshwise's fused sync against torchmetrics syncing each metric.

Runs 4 gloo processes (mesh dp=4). Both sides get the same updates; the collectives are counted by wrapping
``torch.distributed``'s functions (calls go through unchanged). Also an ignite collection of 5 metrics (Accuracy,
Loss, ConfusionMatrix, Precision, MeanSquaredError) attached to an ignite Engine: meshwise's adoption
(``adopt_ignite_metrics``) against ignite's own per-attribute sync (``sync_all_reduce`` over the world, here the
same group). Final line: ``RESULT collectives=… naive_collectives=… time_ratio=… sum_only_collectives=…
ignite_collectives=… ignite_naive_collectives=… ignite_time_ratio=…`` (time ratios: naive time / meshwise time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from meshwise.testing import CollectiveCounter


def _five(**kw):
    from torchmetrics import SumMetric
    from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassF1Score
    from torchmetrics.regression import MeanSquaredError

    return {
        "acc": MulticlassAccuracy(10, **kw),
        "f1": MulticlassF1Score(10, average="macro", **kw),
        "mse": MeanSquaredError(**kw),
        "count": SumMetric(**kw),
        "auroc": BinaryAUROC(**kw),
    }


def _update(metrics, batch) -> None:
    logits, labels, values, targets = batch
    metrics["acc"].update(logits, labels)
    metrics["f1"].update(logits, labels)
    metrics["mse"].update(values, targets)
    metrics["count"].update(torch.ones(len(labels)))
    metrics["auroc"].update(logits.softmax(-1)[:, 1], (labels == 1).long())


def _bench(topo, iters: int, rows: int) -> dict:
    from meshwise.metrics import MeshMetric, compute_all

    group = topo.group(topo.metric_dims)
    ours = {k: MeshMetric(m, topo, name=k) for k, m in _five().items()}
    naive = _five(process_group=group)
    g = torch.Generator().manual_seed(topo.rank)
    times: dict[str, list[float]] = {"meshwise": [], "sum_only": [], "naive": []}
    calls: dict[str, int] = {}
    for it in range(iters + 2):  # two warm-up rounds
        n = rows + topo.rank  # uneven per-rank sizes, as in exact evaluation
        batch = (
            torch.randn(n, 10, generator=g),
            torch.randint(0, 10, (n,), generator=g),
            torch.randn(n, generator=g),
            torch.randn(n, generator=g),
        )
        for m in ours.values():
            m.reset()
        for m in naive.values():
            m.reset()
        _update(ours, batch)
        _update(naive, batch)
        for side in ("meshwise", "sum_only", "naive"):
            dist.barrier(group=group)
            with CollectiveCounter() as counter:
                start = time.perf_counter()
                if side == "meshwise":
                    mine = compute_all(list(ours.values()))
                elif side == "sum_only":
                    compute_all([m for k, m in ours.items() if k != "auroc"])
                else:
                    theirs = [m.compute() for m in naive.values()]
                elapsed = time.perf_counter() - start
            if it >= 2:
                times[side].append(elapsed)
            calls[side] = len(counter.calls)
        for a, b in zip(mine, theirs):
            assert torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), rtol=1e-5, atol=1e-6)
    return {"calls": calls, "median": {k: statistics.median(v) for k, v in times.items()}}


def _ignite_five():
    import torch.nn.functional as F
    from ignite.metrics import Accuracy, ConfusionMatrix, Loss, MeanSquaredError, Precision

    return {
        "acc": Accuracy(),
        "loss": Loss(F.cross_entropy),
        "cm": ConfusionMatrix(10),
        "precision": Precision(average="macro"),
        "mse": MeanSquaredError(),
    }


def _bench_ignite(topo, iters: int, rows: int) -> dict:
    """Collectives and time of one compute of each ignite metric: adopted on one engine, and ignite's own."""
    from ignite.engine import Engine

    from meshwise.metrics import adopt_ignite_metrics

    group = topo.group(topo.metric_dims)
    g = torch.Generator().manual_seed(topo.rank)
    engine = Engine(lambda e, b: b)
    ours, naive = _ignite_five(), _ignite_five()
    for name, m in ours.items():
        m.attach(engine, name)
    adopt_ignite_metrics(engine, topo)
    times: dict[str, list[float]] = {"meshwise": [], "naive": []}
    calls: dict[str, int] = {}
    for it in range(iters + 2):
        n = rows + topo.rank
        batch = (torch.randn(n, 10, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g))
        for side in (ours, naive):
            for name, m in side.items():
                m.reset()
                m.update((batch[0][:, 0], batch[1].double()) if name == "mse" else batch)
        for name, side in (("meshwise", ours), ("naive", naive)):
            dist.barrier(group=group)
            with CollectiveCounter() as counter:
                start = time.perf_counter()
                values = [m.compute() for m in side.values()]  # what the engine's EPOCH_COMPLETED handlers do
                elapsed = time.perf_counter() - start
            if it >= 2:
                times[name].append(elapsed)
            calls[name] = len(counter.calls)
            if name == "meshwise":
                mine = values
        for a, b in zip(mine, values):
            assert torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), rtol=1e-6)
    return {"calls": calls, "median": {k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rows", type=int, default=256, help="rows per rank per update")
    parser.add_argument("--nprocs", type=int, default=4)
    args = parser.parse_args()
    from meshwise.testing import run_distributed

    results = run_distributed(
        _bench, args.nprocs, args.iters, args.rows, mesh={"dp": args.nprocs}, timeout=300, pg_timeout=60
    )
    calls = results[0]["calls"]
    # the slowest rank decides when a compute is done everywhere
    median = {k: max(r["median"][k] for r in results) for k in results[0]["median"]}
    print(
        f"mesh dp={args.nprocs}, {args.iters} computes of 5 metrics (acc, f1, mse, count, auroc), "
        f"{args.rows}+ rows per rank"
    )
    print(f"  meshwise     : {calls['meshwise']:3d} collectives, {median['meshwise'] * 1e3:8.2f} ms per compute")
    print(
        f"  meshwise sums: {calls['sum_only']:3d} collectives, {median['sum_only'] * 1e3:8.2f} ms (4 metrics, no AUROC)"
    )
    print(f"  torchmetrics : {calls['naive']:3d} collectives, {median['naive'] * 1e3:8.2f} ms per compute")
    ratio = median["naive"] / median["meshwise"]
    ig = run_distributed(
        _bench_ignite, args.nprocs, args.iters, args.rows, mesh={"dp": args.nprocs}, timeout=300, pg_timeout=60
    )
    ig_calls = ig[0]["calls"]
    ig_median = {k: max(r["median"][k] for r in ig) for k in ig[0]["median"]}
    ig_ratio = ig_median["naive"] / ig_median["meshwise"]
    print("  ignite collection (Accuracy, Loss, ConfusionMatrix, Precision, MeanSquaredError):")
    print(
        f"  meshwise     : {ig_calls['meshwise']:3d} collectives, {ig_median['meshwise'] * 1e3:8.2f} ms per compute "
        "of the 5 (adopt_ignite_metrics)"
    )
    print(f"  ignite       : {ig_calls['naive']:3d} collectives, {ig_median['naive'] * 1e3:8.2f} ms (sync_all_reduce)")
    print(
        f"RESULT collectives={calls['meshwise']} naive_collectives={calls['naive']} time_ratio={ratio:.2f} "
        f"sum_only_collectives={calls['sum_only']} ignite_collectives={ig_calls['meshwise']} "
        f"ignite_naive_collectives={ig_calls['naive']} ignite_time_ratio={ig_ratio:.2f}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
