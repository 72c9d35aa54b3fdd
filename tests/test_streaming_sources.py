"""Streaming sources on the mesh: a torch IterableDataset and a datasets.IterableDataset; one launch, two meshes.

In-process checks run on a one-rank topology (or a dp=2 ``Topology`` built from a ``Layout`` where no collective
is reached): batches, resume, errors, the trainer resuming mid-way through a stream's first pass, pad_collate
against a plain loop. The launch runs dp=2 x tp=2 (disjoint coverage, tp peers, an exact resume with and without
DataLoader workers, eval padding, the errors), then dp=2 x cp=2: the GPT example's model trained from a
``datasets`` stream cut along the token axis, stopped, checkpointed and resumed, against one process's float64
training on the same samples, and a held-out stream evaluated with every sample and label counted once.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import torchmetrics

from meshwise.data import MeshStreamLoader, Shard, mesh_dataloader, pad_collate
from meshwise.environment import Environment
from meshwise.errors import DataError
from meshwise.layout import Layout
from meshwise.testing import run_distributed
from meshwise.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

import model as gpt  # noqa: E402

LENGTHS = (5, 3, 6, 4)  # samples per shard file: uneven shares per data rank
TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
CP_TRAIN, CP_EVAL = (7, 4, 6, 3), (5, 2, 4, 1)  # documents per shard file; dp rank r reads files r and r + 2
CP_BATCH, CP_EPOCHS, CP_STOP, LR = 4, 2, 2, 1e-2  # 3 steps an epoch (the short share: 7 documents, 2 a step)


def layout_topology(mesh: dict, rank: int) -> Topology:
    """A real Topology for ``rank`` of ``mesh`` with no process group (enough where no collective is reached)."""
    world = int(np.prod(list(mesh.values())))
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    return Topology(Layout.resolve(mesh, world, None), env, torch.device("cpu"), "gloo", datetime.timedelta(30), None)


def _tokens(i: int) -> list[int]:
    return [100 * i + j for j in range(1 + (i * 7) % 5)]


class Counting(torch.utils.data.IterableDataset):
    """Samples 0..n-1 in order (module level: the launched ranks import it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"input_ids": _tokens(i), "id": i}


def write_shards(folder: Path, lengths=LENGTHS) -> list[str]:
    files, at = [], 0
    for k, n in enumerate(lengths):
        f = folder / f"shard{k}.jsonl"
        f.write_text("".join(json.dumps({"input_ids": _tokens(i), "id": i}) + "\n" for i in range(at, at + n)))
        files.append(str(f))
        at += n
    return files


def hf_stream(files: list[str]) -> datasets.IterableDataset:
    return datasets.load_dataset("json", data_files=files, streaming=True, split="train")


def ids(batches) -> list[list[int]]:
    return [[int(i) if v else -1 for i, v in zip(b["id"], b["valid"])] for b in batches]


# ---- in process (data size 1)
@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_stream_one_rank_batches_and_resume(tmp_path, kind):
    topo = layout_topology({"dp": 1}, 0)
    make = (lambda: Counting(18)) if kind == "torch" else (lambda: hf_stream(write_shards(tmp_path)))
    ld = mesh_dataloader(make(), topo, global_batch_size=4)
    assert isinstance(ld, MeshStreamLoader)
    full = list(ld)
    assert ids(full) == [list(range(4 * s, 4 * s + 4)) for s in range(4)]  # 18 samples: the partial 5th dropped
    for b in full:
        valid = b["valid"]
        assert b["input_ids"].dtype == torch.int64 and b["attention_mask"].shape == b["input_ids"].shape
        assert bool(valid.all())
    assert ids(list(ld)) == ids(full)  # a second pass reads the stream again from its start

    ld = mesh_dataloader(make(), topo, global_batch_size=4)
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    resumed = mesh_dataloader(make(), topo, global_batch_size=4)
    resumed.load_state_dict(state)
    assert ids(list(resumed)) == ids(full)[2:]

    ev = list(mesh_dataloader(make(), topo, global_batch_size=4, mode="eval"))
    last = ev[-1]
    assert ids(ev)[-1] == [16, 17, -1, -1] and last["index"].tolist() == [16, 17, -1, -1]
    assert torch.all(last["input_ids"][2:] == 0)


def test_stream_errors(tmp_path):
    one = layout_topology({"dp": 1}, 0)
    with pytest.raises(DataError, match="num_workers must be an int"):
        mesh_dataloader(Counting(4), one, global_batch_size=2, num_workers=-1)
    with pytest.raises(DataError, match="read='each'"):
        mesh_dataloader(Counting(4), one, global_batch_size=2, read="broadcast")
    with pytest.raises(DataError, match="mode='eval'"):
        mesh_dataloader(Counting(4), one, global_batch_size=2, drop_last=False)
    files = write_shards(tmp_path)
    # three shard files for two data ranks: each rank would read the whole stream, so ask for more files
    with pytest.raises(DataError, match="multiple of 2 shard files"):
        mesh_dataloader(hf_stream(files[:3]), layout_topology({"dp": 2}, 0), global_batch_size=2)
    ld = mesh_dataloader(Counting(8), one, global_batch_size=2)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    hf_one = mesh_dataloader(hf_stream(files), one, global_batch_size=2)
    next(iter(hf_one))  # a datasets stream's position is per shard file of a rank: not at another data size
    with pytest.raises(DataError, match="data size 1, this mesh has data size 2.*whole shard files"):
        mesh_dataloader(hf_stream(files), layout_topology({"dp": 2}, 0), global_batch_size=2).load_state_dict(
            hf_one.state_dict()
        )
    with pytest.raises(DataError, match="seed="):
        mesh_dataloader(Counting(8), one, global_batch_size=2, seed=3).load_state_dict(state)
    short = mesh_dataloader(Counting(1), one, global_batch_size=2)
    short.load_state_dict(state)
    with pytest.raises(DataError, match="past the end"):
        list(short)
    short = mesh_dataloader(Counting(1), one, global_batch_size=2, num_workers=2)  # raised in a worker, re-raised here
    short.load_state_dict(state)
    with pytest.raises(DataError, match="past the end"):
        list(short)
    with pytest.raises(DataError, match="not a streaming"):
        ld.load_state_dict({"epoch": 0})


class Features(torch.utils.data.IterableDataset):
    """``n`` float64 regression samples, the same on every pass."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            x = torch.randn(3, generator=g, dtype=torch.float64)
            yield {"input": x, "target": x.sum(0, keepdim=True) * 0.5}


def _regression(topo, state=None, stop=None):
    """A user's script: create_trainer on a stream, trainer.run(loader, max_epochs=3); ``stop``: a kill."""
    from ignite.engine import Events

    import meshwise

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = meshwise.create_trainer(model, opt, torch.nn.functional.mse_loss, topo)
    loader = mesh_dataloader(Features(14), topo, global_batch_size=4)  # 3 steps a pass, the length unknown
    if state is not None:  # what a Checkpointer's load does with each object
        for obj, key in ((model, "model"), (opt, "opt"), (trainer, "engine"), (loader, "loader")):
            obj.load_state_dict(state[key])
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append((e.state.epoch, e.state.output)))
    if stop:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop), lambda e: e.terminate())
    trainer.run(loader, max_epochs=3)
    saved = {"model": model, "opt": opt, "engine": trainer, "loader": loader}
    return seen, {k: v.state_dict() for k, v in saved.items()}


def test_trainer_resumes_a_stream_mid_first_pass():
    topo = layout_topology({"dp": 1}, 0)
    unbroken, end = _regression(topo)
    first, state = _regression(topo, stop=2)
    assert state["engine"]["epoch_length"] is None and state["engine"]["iteration"] == 2  # ignite's unknown length
    resumed, end2 = _regression(topo, state=state)
    assert len(unbroken) == 9 and first + resumed == unbroken  # epochs and losses as unbroken, bit for bit
    assert all(torch.equal(end["model"][k], end2["model"][k]) for k in end["model"])


def test_pad_collate_matches_a_plain_loop():
    """The per-field path (token lists joined in one go) against padding each sample by hand."""
    rng = np.random.default_rng(0)
    for lengths in ((0, 3, 1), (4, 4), (5, 0, 2, 7)):
        rows = [{"input_ids": rng.integers(0, 1000, n).tolist(), "labels": list(range(n))} for n in lengths]
        for pad_to in (None, 8):
            got = pad_collate(rows, pad_to=pad_to)
            width = pad_to or max(lengths)
            ids_ = torch.zeros(len(rows), width, dtype=torch.int64)
            labels = torch.full((len(rows), width), -100, dtype=torch.int64)
            mask = torch.zeros(len(rows), width, dtype=torch.int64)
            for i, r in enumerate(rows):
                for j, (t, lab) in enumerate(zip(r["input_ids"], r["labels"])):
                    ids_[i, j], labels[i, j], mask[i, j] = t, lab, 1
            assert got["input_ids"].dtype == torch.int64  # also when the first sample is empty
            assert torch.equal(got["input_ids"], ids_) and torch.equal(got["labels"], labels)
            assert torch.equal(got["attention_mask"], mask)
    mixed = pad_collate([{"x": [1, 2.5]}, {"x": [3]}])  # floats: the per-sample path, dtype of the first sample
    assert mixed["x"].dtype == torch.get_default_dtype() and mixed["x"].tolist() == [[1.0, 2.5], [3.0, 0.0]]


# ---- one launch: dp=2 x tp=2, then dp=2 x cp=2
BALANCED = Shard(0, balanced=True)


def write_docs(folder: Path, name: str, lengths, seed: int) -> list[str]:
    """Documents of 3..17 tokens as shifted ``input_ids``/``labels``, ``lengths[k]`` of them in shard file k."""
    rng = np.random.default_rng(seed)
    files, at = [], 0
    for k, n in enumerate(lengths):
        lines = []
        for i in range(at, at + n):
            doc = rng.integers(0, TINY["vocab_size"], int(rng.integers(3, 18))).tolist()
            lines.append(json.dumps({"input_ids": doc[:-1], "labels": doc[1:], "id": i}) + "\n")
        f = folder / f"{name}{k}.jsonl"
        f.write_text("".join(lines))
        files.append(str(f))
        at += n
    return files


def _unbroken_and_resumed(make, topo, workers: int) -> dict:
    """An unbroken pass whose state is also taken after its first batch, and a fresh loader resumed from that."""
    ld = mesh_dataloader(make(), topo, global_batch_size=6, num_workers=workers)
    train, state = [], None
    for batch in ld:
        train += ids([batch])
        if state is None:
            state = json.loads(json.dumps(ld.state_dict()))  # a collective, at the same step on every rank
    again = mesh_dataloader(make(), topo, global_batch_size=6, num_workers=workers)
    again.load_state_dict(state)
    return {"train": train, "resumed": ids(again), "state": state}


def _stream_run(topo, files):
    out = {"data_rank": topo.data_rank}
    for name, make in (("torch", lambda: Counting(17)), ("hf", lambda: hf_stream(files))):
        for workers in (0, 2):
            res = _unbroken_and_resumed(make, topo, workers)
            if not workers:
                res["eval"] = ids(mesh_dataloader(make(), topo, global_batch_size=6, mode="eval"))
            if name == "torch" and workers:  # a torch stream's position is one count: any worker count resumes it
                plain = mesh_dataloader(make(), topo, global_batch_size=6)
                plain.load_state_dict(res["state"])
                res["resumed_w0"] = ids(plain)
            out[name + ("_w" if workers else "")] = res
    try:  # another file list of the same shard count
        mesh_dataloader(hf_stream(files[:2]), topo, global_batch_size=6).load_state_dict(out["hf"]["state"])
        out["other_files"] = "no error"
    except DataError as exc:
        out["other_files"] = str(exc)
    out["world_split"] = _world_split_habit(topo, files)
    return out


def _world_split_habit(topo, files) -> str:
    """A user's habit: datasets' split_dataset_by_node over the world, a plain DataLoader, meshwise's trainer."""
    import torch.distributed as dist
    from datasets.distributed import split_dataset_by_node

    import meshwise

    ds = split_dataset_by_node(hf_stream(files), rank=dist.get_rank(), world_size=dist.get_world_size())
    loader = torch.utils.data.DataLoader(ds.select_columns(["id"]).with_format("torch"), batch_size=2)
    model = meshwise.parallelize(torch.nn.Linear(1, 1).double(), topo)
    trainer = meshwise.create_trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda out, batch: out.mean(),
        topo,
        forward=lambda m, b: m(b["id"].double()[:, None]),
        target_key=None,
    )
    try:
        trainer.run(loader, max_epochs=1, epoch_length=1)
    except DataError as exc:
        return str(exc)
    return "no error"


def _cp_model():
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(**TINY)).double()


def _per_token(m, batch):
    logits = m(batch["input_ids"], positions=batch["positions"])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view(
        batch["labels"].shape
    )


def _cp_train(topo, root: str, files: list[str], stop: int | None = None) -> dict:
    """Train CP_EPOCHS passes over the stream with ``trainer.run(loader, max_epochs=...)``; ``stop``: killed after
    that step and checkpointed; else resumed from the checkpoint when there is one."""
    from ignite.engine import Events

    import meshwise
    from meshwise.parallel.context import context_parallel

    model = meshwise.parallelize(context_parallel(_cp_model(), topo), topo, fsdp_units=gpt.Block)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    trainer = meshwise.create_trainer(
        model,
        opt,
        gpt.token_loss,
        topo,
        loss_weight="labels",  # the mean over the global batch's labels; padding is -100
        input_key="input_ids",
        target_key="labels",
        forward=lambda m, b: m(b["input_ids"], positions=b["positions"]),
    )
    parts = {"input_ids": BALANCED, "labels": BALANCED}
    loader = mesh_dataloader(hf_stream(files), topo, global_batch_size=CP_BATCH, parts=parts)
    checkpointer = meshwise.Checkpointer(root, topo)
    objects = {"model": model, "optimizer": opt, "engine": trainer, "loader": loader}
    if stop is None and checkpointer.latest_step() is not None:
        checkpointer.load("latest", **objects)
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    if stop:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop), lambda e: e.terminate())
    trainer.run(loader, max_epochs=CP_EPOCHS)
    if stop:
        checkpointer.save(trainer.state.iteration, **objects)
    checkpointer.close()
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}
    return {"losses": losses, "params": full, "model": model, "state": (trainer.state.epoch, trainer.state.iteration)}


class Total(torchmetrics.Metric):
    """A float64 sum (torchmetrics' SumMetric, even with set_dtype(torch.float64), came out float32-rounded here)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.total += values.double().sum()

    def compute(self) -> torch.Tensor:
        return self.total


def _cp_eval(topo, model, files: list[str]) -> dict:
    """The held-out stream through create_evaluator: summed token losses and label count, the ids seen."""
    from ignite.engine import Events

    import meshwise
    from meshwise.metrics import MeshMetric

    labels = MeshMetric(Total(), topo, select=lambda out, b: ((b["labels"] != -100).double(),))
    metrics = {"loss_sum": Total(), "labels": labels}
    evaluator = meshwise.create_evaluator(model, topo, metrics=metrics, forward=_per_token, select=lambda o, b: (o,))
    seen = []
    evaluator.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.batch["id"][e.state.batch["valid"]].tolist())
    )
    loader = mesh_dataloader(
        hf_stream(files),
        topo,
        global_batch_size=CP_BATCH,
        mode="eval",
        parts={"input_ids": BALANCED, "labels": BALANCED},
    )
    metrics = evaluator.run(loader).metrics
    return {"loss_sum": float(metrics["loss_sum"]), "labels": float(metrics["labels"]), "ids": seen}


def _phases(files, root, train_files, eval_files):
    import meshwise

    topo = meshwise.init({"dp": 2, "tp": 2}, timeout=30)
    out = {"tp": _stream_run(topo, files)}
    meshwise.shutdown()
    topo = meshwise.init({"dp": 2, "cp": 2}, timeout=30)
    first = _cp_train(topo, root, train_files, stop=CP_STOP)
    resumed = _cp_train(topo, root, train_files)
    out["cp"] = {
        "data_rank": topo.data_rank,
        "losses": first["losses"] + resumed["losses"],
        "params": resumed["params"],
        "state": resumed["state"],
        "eval": _cp_eval(topo, resumed["model"], eval_files),
    }
    meshwise.shutdown()
    return out


def _share(files: list[str], rank: int) -> list[dict]:
    """Data rank ``rank``'s documents, read from its files (split_dataset_by_node gives rank r files r, r + 2)."""
    return [json.loads(line) for f in files[rank::2] for line in Path(f).read_text().splitlines()]


def _rows(docs: list[dict], key: str, fill: int) -> torch.Tensor:
    width = max(len(d[key]) for d in docs)
    return torch.tensor([d[key] + [fill] * (width - len(d[key])) for d in docs])


def _cp_reference(train_files: list[str], eval_files: list[str]) -> dict:
    """One process, float64: each step's global batch is both data ranks' next documents, padded by hand."""
    import torch.nn.functional as F

    shares = [_share(train_files, r) for r in (0, 1)]
    b = CP_BATCH // 2
    model = _cp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for _ in range(CP_EPOCHS):  # a stream is read again from its start each pass
        for s in range(min(len(x) for x in shares) // b):
            docs = shares[0][s * b : (s + 1) * b] + shares[1][s * b : (s + 1) * b]
            loss = F.cross_entropy(
                model(_rows(docs, "input_ids", 0)).flatten(0, 1), _rows(docs, "labels", -100).flatten()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    docs = _share(eval_files, 0) + _share(eval_files, 1)
    with torch.no_grad():
        per_token = F.cross_entropy(
            model(_rows(docs, "input_ids", 0)).flatten(0, 1), _rows(docs, "labels", -100).flatten(), reduction="none"
        )
    return {
        "losses": losses,
        "params": {n: p.detach() for n, p in model.named_parameters()},
        "loss_sum": per_token.sum().item(),
        "labels": sum(len(d["labels"]) for d in docs),
        "ids": sorted(d["id"] for d in docs),
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    files = write_shards(root)
    train_files, eval_files = write_docs(root, "train", CP_TRAIN, 1), write_docs(root, "eval", CP_EVAL, 2)
    res = run_distributed(_phases, 4, files, str(root / "ckpt"), train_files, eval_files, timeout=300)
    return files, res, _cp_reference(train_files, eval_files)


def test_stream_distributed(launched):
    files, res, _ = launched
    by_dr = {}
    for r in (x["tp"] for x in res):
        by_dr.setdefault(r["data_rank"], []).append(r)
    assert sorted(by_dr) == [0, 1]
    names = ("torch", "hf", "torch_w", "hf_w")
    for a, b in by_dr.values():  # tp peers see the same batches
        for name in names:
            assert a[name]["train"] == b[name]["train"] and a[name].get("eval") == b[name].get("eval")
    r0, r1 = by_dr[0][0], by_dr[1][0]
    for name, total in (("torch", 17), ("hf", sum(LENGTHS))):
        flat = [[i for batch in r[name]["eval"] for i in batch if i >= 0] for r in (r0, r1)]
        assert sorted(flat[0] + flat[1]) == list(range(total))  # eval: every sample once
        assert not set(flat[0]) & set(flat[1])
        assert len(r0[name]["eval"]) == len(r1[name]["eval"])  # the shorter share padded, nobody hung
    for name in names:
        for r in (r0, r1):
            assert len(r[name]["train"]) == 2  # both ranks stop when the shorter share runs out
            assert r[name]["resumed"] == r[name]["train"][1:]  # stop at step 1 + resume = an unbroken run
        assert r0[name]["state"] == r1[name]["state"]  # every data rank's position, the same on every rank
    for r in (r0, r1):  # workers: a torch stream keeps its order; a datasets stream gives each worker its files
        assert r["torch_w"]["train"] == r["torch"]["train"]
        assert sorted(sum(r["hf_w"]["train"], [])) != sum(r["hf_w"]["train"], [])
    assert r0["torch"]["eval"][-1] == [12, 14, 16] and r1["torch"]["eval"][-1] == [13, 15, -1]
    assert any(-1 in batch for r in (r0, r1) for batch in r["hf"]["eval"])
    assert "another source" in r0["other_files"]
    for r in (x["tp"] for x in res):  # tp peers read other samples: the replica check names the habit and the fix
        assert "split_dataset_by_node(ds, rank=topo.data_rank" in r["world_split"], r["world_split"]
    # a torch stream saved at dp=2 after one step resumes at one process: the rest of the pass, each sample once
    one = mesh_dataloader(Counting(17), layout_topology({"dp": 1}, 0), global_batch_size=6)
    one.load_state_dict(r0["torch"]["state"])
    assert ids(one) == [list(range(6, 12))]  # 12..16 are less than a global batch: dropped, as in the unbroken run
    with pytest.raises(DataError, match="num_workers=2"):  # a datasets stream's worker positions need as many
        mesh_dataloader(hf_stream(files), layout_topology({"dp": 2}, 0), global_batch_size=6).load_state_dict(
            r0["hf_w"]["state"]
        )
    for r in (r0, r1):
        assert r["torch_w"]["resumed_w0"] == r["torch"]["train"][1:]  # saved with 2 workers, resumed with none


def test_context_parallel_stream_trains_resumes_and_evaluates_like_one_process(launched):
    _, res, ref = launched
    steps = CP_EPOCHS * (min(sum(CP_TRAIN[0::2]), sum(CP_TRAIN[1::2])) // (CP_BATCH // 2))
    assert len(ref["losses"]) == steps == 6
    worst = 0.0
    for r in (x["cp"] for x in res):
        assert len(r["losses"]) == steps and r["state"] == (CP_EPOCHS, steps)  # stopped after 2, resumed to 6
        worst = max(worst, *(abs(a - b) for a, b in zip(r["losses"], ref["losses"])))
        worst = max(worst, *((r["params"][n] - p).abs().max().item() for n, p in ref["params"].items()))
    assert worst <= 1e-12, worst
    for r in (x["cp"] for x in res):
        ev = r["eval"]
        assert ev["labels"] == ref["labels"]  # every label of the held-out stream once, over dp x cp
        assert abs(ev["loss_sum"] - ref["loss_sum"]) <= 1e-12 * abs(ref["loss_sum"]), (ev, ref["loss_sum"])
    by_dr = {r["cp"]["data_rank"]: r["cp"]["eval"]["ids"] for r in res}
    assert len(by_dr[0]) == len(by_dr[1])  # the short share ran out first and stepped on with padding
    assert sorted(i for batches in by_dr.values() for batch in batches for i in batch) == ref["ids"]
    print("cp stream: largest difference to one process", worst)
