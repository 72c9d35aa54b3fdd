"""ignite's own metrics on the mesh: each equals the same ignite metric computed in one process over the whole set."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events
from ignite.metrics import (
    Accuracy,
    Average,
    ConfusionMatrix,
    Fbeta,
    Loss,
    MeanSquaredError,
    Metric,
    Precision,
    Recall,
    RunningAverage,
    TopKCategoricalAccuracy,
    VariableAccumulation,
)
from ignite.metrics.metric import reinit__is_reduced, sync_all_reduce
from torch import nn

from meshwise.testing import CollectiveCounter, run_distributed

LENGTHS = (1, 7, 203)
FEATURES, CLASSES, T = 6, 4, 6
B_LOCAL = 4


class CorrectAndMax(Metric):
    """A user's metric, written as ignite's docs teach: states reduced by sync_all_reduce, one of them with MAX."""

    @reinit__is_reduced
    def reset(self) -> None:
        self._correct = torch.tensor(0)
        self._seen = 0
        self._top = torch.tensor(float("-inf"), dtype=torch.float64)

    @reinit__is_reduced
    def update(self, output) -> None:
        y_pred, y = output
        self._correct += (y_pred.argmax(1) == y).sum()
        self._seen += y.shape[0]
        self._top = torch.maximum(self._top, y_pred.max())

    @sync_all_reduce("_correct", "_seen", "_top:MAX")
    def compute(self) -> dict:
        return {"user_correct": int(self._correct), "user_seen": self._seen, "user_top": float(self._top)}


def _one_hot(output):
    y_pred, y = output
    return y_pred.softmax(-1), F.one_hot(y, CLASSES).to(y_pred.dtype)


def ignite_metrics() -> dict[str, Metric]:
    """Every metric family of the issue, built the way an ignite user builds them."""
    p, r = Precision(average=False), Recall(average=False)
    return {
        "acc": Accuracy(),
        "loss": Loss(F.cross_entropy),
        "cm": ConfusionMatrix(CLASSES),
        "precision": Precision(average="weighted"),  # its compute makes one more idist.all_reduce
        "recall": Recall(average="macro"),
        "fbeta": Fbeta(1.0, precision=p, recall=r),  # a MetricsLambda over two metrics
        "acc_x2": Accuracy() * 2,
        "mse": MeanSquaredError(output_transform=_one_hot),
        "top2": TopKCategoricalAccuracy(k=2),
        "avg": Average(output_transform=lambda o: o[0]),  # 2-D: one row per sample
        "sq": VariableAccumulation(lambda a, x: a + (x**2).sum(0), output_transform=lambda o: o[0]),
        "user": CorrectAndMax(),
    }


def attach_all(engine: Engine) -> dict[str, Metric]:
    metrics = ignite_metrics()
    for name, m in metrics.items():
        m.attach(engine, name)
    RunningAverage(Accuracy(), alpha=0.5).attach(engine, "running_acc")  # one value per global batch
    return metrics


def dataset(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {
        "input": torch.randn(n, FEATURES, generator=g, dtype=torch.float64),
        "target": torch.randint(0, CLASSES, (n,), generator=g),
        "seq": torch.randn(n, T, CLASSES, generator=g, dtype=torch.float64),
        "seq_target": torch.randint(0, CLASSES, (n, T), generator=g),
    }


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, CLASSES, dtype=torch.float64)


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _seq_loss(p, t):
    return F.cross_entropy(p.transpose(1, 2), t)


# --------------------------------------------------------------------------- the ranks


def _mesh_run(topo) -> dict:
    from torchmetrics import SumMetric

    import meshwise
    from meshwise.data import ArrayDataset, Shard, mesh_dataloader
    from meshwise.metrics import MeshMetric, adopt_ignite_metrics

    net = model()
    out: dict = {"evaluator": {}, "plain": {}, "steps": {}, "rows": {}}
    for n in LENGTHS:
        data = dataset(n)
        loader = mesh_dataloader(ArrayDataset(data), topo, global_batch_size=B_LOCAL * topo.data_size, mode="eval")
        # create_evaluator: an ignite metric passed in metrics= beside a torchmetrics one, the others attached
        # the ignite way to the evaluator it returns
        count = MeshMetric(SumMetric(), topo, split_inputs="whole", select=lambda o, b: (torch.ones(len(o)),))
        evaluator = meshwise.create_evaluator(net, topo, metrics={"acc_given": Accuracy(), "count": count})
        metrics = attach_all(evaluator)
        steps: list[list[int]] = []
        evaluator.add_event_handler(
            Events.ITERATION_COMPLETED,
            lambda e, steps=steps: steps.append(e.state.batch["index"][e.state.batch["valid"]].tolist()),
        )
        evaluator.run(loader)
        out["evaluator"][n] = _plain(dict(evaluator.state.metrics))
        out["steps"][n] = steps
        out["rows"][n] = sum(len(s) for s in steps)
        if n == 203:
            tops = list(metrics.values())
            tops[0].load_state_dict(tops[0].state_dict())  # the same states, but every cached result is stale
            with CollectiveCounter() as first:
                tops[0].compute()
            with CollectiveCounter() as rest:
                for m in tops[1:]:
                    m.compute()
            out["collectives"] = (first.calls, rest.calls)
        # a plain ignite Engine (as create_supervised_evaluator makes), adopted by hand
        plain = Engine(lambda e, b: (net(b["input"]), b["target"]))
        Accuracy().attach(plain, "acc")
        Loss(F.cross_entropy).attach(plain, "loss")
        adopt_ignite_metrics(plain, topo)
        plain.run(loader)
        out["plain"][n] = dict(plain.state.metrics)
    if not topo.split_dims and not topo.replica_dims:
        out["errors"] = _errors(topo, net)
    out["habits"] = _habits(topo)
    out["group_rank"] = topo.coordinate(topo.metric_dims)
    out["group_size"] = topo.size(topo.metric_dims)
    if topo.split_dims:
        # a per-token loss over sequences split in two equal chunks along cp: each split rank adds its part
        data = dataset(203)
        loader = mesh_dataloader(
            ArrayDataset(data),
            topo,
            global_batch_size=B_LOCAL * topo.data_size,
            mode="eval",
            parts={"seq": Shard(0), "seq_target": Shard(0)},
        )
        seq = meshwise.create_evaluator(
            net,
            topo,
            metrics={"seq_loss": Loss(_seq_loss)},
            forward=lambda m, b: b["seq"],
            select=lambda o, b: (o, b["seq_target"]),
            split_inputs="parts",
        )
        seq.run(loader)
        out["seq_loss"] = seq.state.metrics["seq_loss"]
    return out


class GatheringMetric(Accuracy):
    """A user's metric whose compute gathers with idist: right where a gather is, refused elsewhere."""

    def compute(self):
        import ignite.distributed as idist

        return idist.all_gather(torch.tensor([self._num_examples])).sum().item()


class CountingMetric(Metric):
    """A user's metric that counts how often its compute() runs."""

    _state_dict_all_req_keys = ("_n",)

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @reinit__is_reduced
    def reset(self) -> None:
        self._n = 0

    @reinit__is_reduced
    def update(self, output) -> None:
        self._n += output[1].shape[0]

    @sync_all_reduce("_n")
    def compute(self) -> int:
        self.calls += 1
        return self._n


class OneRankFails(Accuracy):
    """A compute() that raises on the group's rank 0 while the other ranks go on into a reduction."""

    def compute(self):
        import ignite.distributed as idist

        if idist.get_rank() == 0:
            raise ValueError("only rank 0 of the group fails")
        return float(idist.all_reduce(torch.tensor(1.0)))


def _multilabel_refused(p, t):  # what scikit-learn says to CohenKappa's multilabel input, on rank 0 only
    raise ValueError("multilabel-indicator is not supported")


def _correct(p, t):
    return int((p.argmax(1) == t).sum())


HABIT_N = 7


def _habits(topo) -> dict:
    """ignite's contracts under adoption: restore, errors, one compute per completion, gathers where right."""
    from ignite.metrics import EpochMetric

    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.errors import MetricError
    from meshwise.metrics import adopt_ignite_metrics

    net = model()
    loader = mesh_dataloader(
        ArrayDataset(dataset(HABIT_N)), topo, global_batch_size=B_LOCAL * topo.data_size, mode="eval"
    )
    out: dict = {}

    def engine_with(metrics: dict) -> Engine:
        engine = Engine(lambda e, b: (net(b["input"]), b["target"]))
        for name, m in metrics.items():
            m.attach(engine, name)
        return engine

    # one compute() per completion per metric object: attached under two names and inside a MetricsLambda
    counting, acc, prec = CountingMetric(), Accuracy(), Precision(average="weighted")
    engine = engine_with({})
    for name, m in {"count_a": counting, "count_b": counting, "count_x2": counting * 2, "acc": acc}.items():
        m.attach(engine, name)
    prec.attach(engine, "precision")
    adopt_ignite_metrics(engine, topo)
    with torch.no_grad():
        engine.run(loader, max_epochs=2)
    out["metrics"] = _plain(dict(engine.state.metrics))
    out["calls"] = counting.calls
    # ignite's load_state_dict contract: state_dict() -> reset() -> load_state_dict() computes the same
    out["restored"] = {}
    for name, m in {"acc": acc, "precision": prec, "count_a": counting}.items():
        state = m.state_dict()
        m.reset()
        m.load_state_dict(state)
        out["restored"][name] = _plain(m.compute())

    # an error in compute() reaches the user on every rank, even one raised while others are in a collective
    def outcome(metrics: dict) -> dict:
        try:
            engine = engine_with(metrics)
            adopt_ignite_metrics(engine, topo)
            with torch.no_grad():
                engine.run(loader, max_epochs=1)
            return {"value": _plain(dict(engine.state.metrics))}
        except Exception as exc:  # noqa: BLE001 - the test compares the error each rank gets
            return {"error": type(exc).__name__, "message": str(exc)}

    out["one_rank_fails"] = outcome({"fails": OneRankFails()})
    out["epoch_metric_fails"] = outcome({"kappa": EpochMetric(_multilabel_refused, check_compute_fn=False)})
    # a gathering metric: right (so allowed) with one rank in the metric group or on a mesh of batch dims only
    out["epoch_metric"] = outcome({"correct": EpochMetric(_correct, check_compute_fn=False)})
    out["gathers"] = outcome({"examples": GatheringMetric()})
    out["refusal_type"] = MetricError.__name__
    return out


def _errors(topo, net) -> dict:
    """Refusals: each rank gets the same MetricError, no hang and no gloo abort."""
    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.errors import MetricError
    from meshwise.metrics import adopt_ignite_metrics

    loader = mesh_dataloader(ArrayDataset(dataset(7)), topo, global_batch_size=3, mode="eval")
    messages = {}
    # a rank that never gets a batch: its Precision has no per-class state to reduce
    metric = Precision(average=False)
    engine = Engine(lambda e, b: (net(b["input"]), b["target"]))
    metric.attach(engine, "no_batch")
    try:
        adopt_ignite_metrics(engine, topo)
        if topo.rank == 0:
            engine.run(loader, max_epochs=1)
        else:  # ignite refuses an empty loader: this rank computes without a batch, as the others finish
            metric.compute()
    except MetricError as exc:
        messages["no_batch"] = str(exc)
    return messages


# --------------------------------------------------------------------------- one process, no mesh


def reference(n: int, steps: list[list[int]]) -> dict:
    """The same ignite metrics in one process, no meshwise, over the same global batches."""
    data, net = dataset(n), model()
    engine = Engine(lambda e, idx: (net(data["input"][idx]), data["target"][idx]))
    attach_all(engine)
    Accuracy().attach(engine, "acc_given")
    with torch.no_grad():
        engine.run([torch.tensor(s) for s in steps if s])
    return _plain(dict(engine.state.metrics))


def _global_steps(results: list[dict], n: int, topo_ranks: list[int]) -> list[list[int]]:
    per_rank = [results[r]["steps"][n] for r in topo_ranks]
    return [sorted(i for rank_steps in per_rank for i in rank_steps[s]) for s in range(len(per_rank[0]))]


def _same(got, ref, key) -> None:
    if isinstance(ref, dict):
        assert set(got) == set(ref), key
        for k in ref:
            _same(got[k], ref[k], f"{key}.{k}")
    elif isinstance(ref, list):
        assert len(got) == len(ref), key
        for i, (g, r) in enumerate(zip(got, ref)):
            _same(g, r, f"{key}[{i}]")
    elif isinstance(ref, int) and not isinstance(ref, bool):
        assert got == ref, (key, got, ref)  # counts: exactly
    else:
        assert got == pytest.approx(ref, rel=1e-6, abs=1e-12), (key, got, ref)  # float32 states (Loss): other order


def _check(results: list[dict], data_leaders: list[int]) -> None:
    for n in LENGTHS:
        steps = _global_steps(results, n, data_leaders)
        assert sorted(i for s in steps for i in s) == list(range(n))  # every sample once
        ref = reference(n, steps)
        for rank, out in enumerate(results):
            got = out["evaluator"][n]
            assert got == results[0]["evaluator"][n], rank  # every rank: the same value
            assert got["count"] == n
            for key, value in ref.items():
                _same(got[key], value, f"n={n} rank {rank} {key}")
            assert got["cm"] == ref["cm"] and sum(map(sum, got["cm"])) == n  # not multiplied by tp, no padding
            assert got["user_seen"] == n and got["acc"] == ref["acc"]
            assert out["plain"][n]["acc"] == ref["acc"]
            assert out["plain"][n]["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        fused, rest = results[0]["collectives"]
        # an agreement and one fused all-reduce of every sync_all_reduce state; Precision(average="weighted")'s
        # own idist.all_reduce in compute(): an agreement and the reduction; the last agreement
        assert fused == ["all_reduce"] * 5, fused
        assert rest == [], rest  # the other metrics of the same event: computed by that one sync


def habits_reference() -> dict:
    """The habits' metrics in one process, no meshwise, over the whole set."""
    data, net = dataset(HABIT_N), model()
    engine = Engine(lambda e, b: b)
    counting = CountingMetric()
    for name, m in {"count_a": counting, "count_b": counting, "count_x2": counting * 2, "acc": Accuracy()}.items():
        m.attach(engine, name)
    Precision(average="weighted").attach(engine, "precision")
    with torch.no_grad():
        engine.run([(net(data["input"]), data["target"])], max_epochs=2)
    return {**_plain(dict(engine.state.metrics)), "calls": counting.calls}


def _check_habits(results: list[dict], gathers_right: bool) -> None:
    ref = habits_reference()
    data = dataset(HABIT_N)
    with torch.no_grad():
        correct = _correct(model()(data["input"]), data["target"])
    for rank, r in enumerate(results):
        h = r["habits"]
        got = h["metrics"]
        # ignite runs compute() once per call: 2 names and a MetricsLambda, 2 epochs: 6 (not twice that)
        assert h["calls"] == ref["calls"] == 6, (rank, h["calls"], ref["calls"])
        assert got["count_a"] == got["count_b"] == HABIT_N and got["count_x2"] == 2 * HABIT_N
        assert got["acc"] == ref["acc"], (rank, got["acc"], ref["acc"])
        assert got["precision"] == pytest.approx(ref["precision"], rel=1e-12)
        # restored from its state_dict: what the unbroken metric computed
        assert h["restored"] == {"acc": got["acc"], "precision": got["precision"], "count_a": HABIT_N}, rank
        # the error reaches every rank: the raising rank gets its own, the others a MetricError naming it
        fails = h["one_rank_fails"]
        group_rank_0 = r["group_rank"] == 0 or r["group_size"] == 1
        if group_rank_0:
            assert fails == {"error": "ValueError", "message": "only rank 0 of the group fails"}, (rank, fails)
        else:
            assert fails["error"] == "MetricError", (rank, fails)
            assert "ValueError: only rank 0 of the group fails" in fails["message"], (rank, fails)
        if gathers_right:
            kappa = h["epoch_metric_fails"]
            assert kappa["error"] == ("ValueError" if group_rank_0 else "MetricError"), (rank, kappa)
            assert "multilabel-indicator is not supported" in kappa["message"], (rank, kappa)
            assert h["epoch_metric"] == {"value": {"correct": correct}}, (rank, h["epoch_metric"], correct)
            assert h["gathers"] == {"value": {"examples": HABIT_N}}, (rank, h["gathers"])
        else:
            for key in ("epoch_metric", "epoch_metric_fails", "gathers"):
                refused = h[key]
                assert refused["error"] == "MetricError", (rank, key, refused)
                assert (
                    "idist.all_gather" in refused["message"] and "create_evaluator(metrics=...)" in refused["message"]
                )


def _one_process(topo) -> dict:
    return {"habits": _habits(topo), "group_rank": 0, "group_size": 1}


def test_ignite_contracts_in_one_process():
    _check_habits(run_distributed(_one_process, 1, mesh={"dp": 1}, timeout=120), gathers_right=True)


@pytest.mark.slow
def test_ignite_metrics_dp3_and_padding_only_ranks():
    results = run_distributed(_mesh_run, 3, mesh={"dp": 3}, timeout=240)
    assert [r["rows"][1] for r in results] == [1, 0, 0]  # ranks 1, 2 see only padding
    _check(results, [0, 1, 2])
    _check_habits(results, gathers_right=True)
    for r in results:
        errors = r["errors"]
        assert "same number of batches" in errors["no_batch"]
        assert "rank 0: 2 reductions of 8 values, rank 1: 2 reductions of 2 values" in errors["no_batch"]


def test_ignite_metrics_dp2_tp2_not_counted_per_replica():
    results = run_distributed(_mesh_run, 4, mesh={"dp": 2, "tp": 2}, timeout=240)
    _check(results, [0, 2])
    _check_habits(results, gathers_right=False)


def test_ignite_metrics_dp2_cp2_whole_samples_and_parts():
    results = run_distributed(_mesh_run, 4, mesh={"dp": 2, "cp": 2}, timeout=240)
    _check(results, [0, 2])
    _check_habits(results, gathers_right=False)
    data = dataset(203)
    whole = _seq_loss(data["seq"], data["seq_target"]).item()
    for r in results:
        assert r["seq_loss"] == pytest.approx(whole, rel=1e-6)  # ignite sums Loss in float32
