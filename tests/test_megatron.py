"""Megatron-core's groups and layers trained, clipped and checkpointed through meshwise (issue 42).

Written as a Megatron-core user writes the script: ``torch.distributed.init_process_group``, then
``parallel_state.initialize_model_parallel(...)`` (both rank orders), their own ``ColumnParallelLinear`` →
``RowParallelLinear`` MLP built with ``ModelParallelConfig(use_cpu_initialization=True, params_dtype=float64)``, a
replicated head, torch's ``DDP`` over Megatron's dp group, then ``meshwise.megatron.adopt()``, ``mesh_dataloader``,
``create_trainer(..., grad_clip=...)`` and ``Checkpointing``. The oracle is plain torch in one process: the same full
weights (Megatron's CPU initialisation re-played: a float32 master weight per layer under one seed), the same global
batches (the sampler's global order), AdamW and ``torch.nn.utils.clip_grad_norm_``.

One launch of 4 gloo ranks runs the adoptions, the refusals, the tp=2 x dp=2 run (a checkpoint copied at step 3)
and its resume at tp=4; one launch of 1 process resumes the same checkpoint in one process.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pytest.importorskip("megatron.core", reason="megatron-core is the 'megatron' extra (pip install 'meshwise[megatron]')")

from meshwise.testing import run_distributed  # noqa: E402

D, H, N, B = 8, 16, 48, 8  # features, hidden (split over tp), samples, global batch: 6 steps an epoch
SEED, CLIP, LR = 1234, 0.05, 0.02
STEPS, SAVED_AT = 6, 3


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    return x, torch.sin(x @ torch.randn(D, D, generator=g, dtype=torch.float64))


def _init_method() -> functools.partial:
    return functools.partial(nn.init.normal_, mean=0.0, std=0.5)


class MegatronMLP(nn.Module):
    """The user's model: Megatron's column- then row-parallel linears, and a replicated torch head."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        config = ModelParallelConfig(
            tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float64
        )
        self.fc1 = ColumnParallelLinear(D, H, config=config, init_method=_init_method(), bias=True, gather_output=False)
        self.fc2 = RowParallelLinear(
            H, D, config=config, init_method=_init_method(), bias=True, input_is_parallel=True, skip_bias_add=False
        )
        self.head = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        y, _ = self.fc2(torch.tanh(h))
        return self.head(torch.tanh(y))


class PlainMLP(nn.Module):
    """The one-process oracle: the same full weights in plain torch layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(D, D, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _plain_model() -> PlainMLP:
    """Megatron's CPU initialisation re-played: a float32 master weight per layer (then float64), zero biases,
    then the torch head, all under one seed."""
    torch.manual_seed(SEED)
    masters = []
    for shape in ((H, D), (D, H)):
        w = torch.empty(shape, dtype=torch.float32)
        _init_method()(w)
        masters.append(w.double())
    model = PlainMLP().double()
    with torch.no_grad():
        for layer, w in zip((model.fc1, model.fc2), masters):
            layer.weight.copy_(w)
            layer.bias.zero_()
    torch.manual_seed(SEED)  # the head is drawn after the masters in both: re-draw it in the same place
    for shape in ((H, D), (D, H)):
        _init_method()(torch.empty(shape, dtype=torch.float32))
    model.head = nn.Linear(D, D, dtype=torch.float64)
    return model


def _reference(order: list[int], steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, plain torch: the trained full weights and each step's gradient norm before clipping."""
    x, y = _data()
    model = _plain_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for s in range(steps):
        idx = order[s * B : (s + 1) * B]
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _megatron_model(tp: int) -> MegatronMLP:
    torch.manual_seed(SEED)
    return MegatronMLP(tp)


def _full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole: Megatron's shards gathered over the tp group along their partition dim."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    out = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=group)
            out[name] = torch.cat(parts, dim=p.partition_dim)
        else:
            out[name] = p.detach().clone()
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _error(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the class and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _train(topo, model, opt, root: str | None, on_saved=None) -> dict:
    """``create_trainer`` with clipping on ``mesh_dataloader`` batches, as the user runs it; what each step saw."""
    from ignite.engine import Events

    import meshwise
    from meshwise.data import ArrayDataset, mesh_dataloader
    from meshwise.engine import Checkpointing

    x, y = _data()
    loader = mesh_dataloader(ArrayDataset({"input": x, "target": y}), topo, global_batch_size=B, seed=3)
    trainer = meshwise.create_trainer(model, opt, F.mse_loss, topo, grad_clip=CLIP)
    seen: dict = {"norms": {}, "index": {}, "loss": {}}

    @trainer.on(Events.ITERATION_COMPLETED)
    def record(engine):
        it = engine.state.iteration
        seen["norms"][it] = engine.state.grad_norm
        seen["index"][it] = engine.state.batch["index"].tolist()
        seen["loss"][it] = engine.state.output

    ckpt = None
    if root is not None:
        ckpt = meshwise.Checkpointer(root, topo)
        handler = Checkpointing(ckpt, every_iterations=SAVED_AT, model=model, optimizer=opt, loader=loader)
        handler.attach(trainer)
        if on_saved is not None:
            trainer.add_event_handler(Events.ITERATION_COMPLETED(once=SAVED_AT), on_saved, ckpt)
    trainer.run(loader, max_epochs=1)
    if ckpt is not None:
        seen["resumed"] = handler.resumed.step if handler.resumed is not None else None
        ckpt.close()
    seen["order"] = [int(i) for i in loader.sampler.order(0)]
    return seen


def _adoptions(rank: int) -> dict:
    """Both of Megatron's rank orders, pipeline stages, expert parallel, a mesh the user built in the wrong order."""
    from megatron.core import parallel_state as ps
    from torch.distributed.device_mesh import DeviceMesh

    import meshwise
    import meshwise.megatron

    out: dict = {}
    for order in ("tp-cp-ep-dp-pp", "dp-tp-pp"):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, order=order)
        topo = meshwise.megatron.adopt()
        out[order] = {
            "dims": topo.dims,
            "roles": topo.roles,
            "coords": topo.coordinates(),
            "own_groups": topo.group("tp") is ps.get_tensor_model_parallel_group()
            and topo.group("dp") is ps.get_data_parallel_group(),
            "data_rank": (topo.data_rank, ps.get_data_parallel_rank()),
            "tp_rank": (topo.coordinate("tp"), ps.get_tensor_model_parallel_rank()),
        }
        if order == "dp-tp-pp":  # the user's own mesh, dims named in the order they think of them: refused
            tp_g, dp_g = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
            meshwise.shutdown()
            grid = torch.tensor([[0, 2], [1, 3]])  # dp along rows: rank r's dp line is its dp group
            mesh = DeviceMesh.from_group([dp_g, tp_g], "cpu", mesh=grid, mesh_dim_names=("dp", "tp"))
            out["own_mesh"] = _error(functools.partial(meshwise.init, mesh))
        meshwise.shutdown()
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    topo = meshwise.megatron.adopt()
    out["pp"] = {
        "dims": topo.dims,
        "roles": topo.roles,
        "stage": topo.coordinate("pp") == ps.get_pipeline_model_parallel_rank(),
    }
    meshwise.shutdown()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    out["expert"] = _error(meshwise.megatron.adopt)
    ps.destroy_model_parallel()
    out["not_initialised"] = _error(meshwise.megatron.adopt)
    return out


def _four_ranks(root: str) -> dict:
    from megatron.core import parallel_state as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    import meshwise
    import meshwise.megatron

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"adopt": _adoptions(rank)}

    # tp=2 x dp=2: refusals first, then the run (its step-3 checkpoint copied for the resumes)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    topo = meshwise.megatron.adopt()
    model = _megatron_model(2)
    full = _full_weights(model)
    out["init_diff"] = _max_diff(full, {k: v for k, v in _plain_model().state_dict().items()})
    other = _megatron_model(2)  # DDP over the world broadcasts rank 0's shards: not on the model we train
    out["world_ddp"] = _error(
        lambda: meshwise.create_trainer(DDP(other), torch.optim.SGD(other.parameters(), lr=0.1), F.mse_loss, topo)
    )
    out["parallelize"] = _error(lambda: meshwise.parallelize(_megatron_model(2), topo))
    ddp = DDP(model, process_group=ps.get_data_parallel_group())
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)

    def copy_saved(engine, ckpt) -> None:  # the checkpoint of step 3, as a run killed right after it would leave it
        assert ckpt.latest_step() == SAVED_AT  # waits until 'latest' names it (it moves in the background)
        if rank == 0:
            for name in ("tp4", "one"):
                shutil.copytree(os.path.join(root, "run"), os.path.join(root, name))
        dist.barrier()

    out["run"] = _train(topo, ddp, opt, os.path.join(root, "run"), copy_saved)
    out["run_weights"] = _full_weights(model)
    meshwise.shutdown()
    ps.destroy_model_parallel()

    # resumed at tp=4 (dp=1: no DDP needed)
    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    topo = meshwise.megatron.adopt()
    torch.manual_seed(99)  # other weights than the run's: the checkpoint must bring them
    model = MegatronMLP(4)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out["tp4"] = _train(topo, model, opt, os.path.join(root, "tp4"))
    out["tp4_weights"] = _full_weights(model)
    meshwise.shutdown()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def _one_process(root: str) -> dict:
    from megatron.core import parallel_state as ps

    import meshwise
    import meshwise.megatron

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    topo = meshwise.megatron.adopt()
    torch.manual_seed(99)
    model = MegatronMLP(1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"one": _train(topo, model, opt, os.path.join(root, "one"))}
    out["one_weights"] = _full_weights(model)
    meshwise.shutdown()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def test_megatron_groups_clipping_ddp_and_resharded_checkpoints(tmp_path):
    four = run_distributed(_four_ranks, 4, str(tmp_path), timeout=240)
    one = run_distributed(_one_process, 1, str(tmp_path), timeout=120)[0]

    adopt = [r["adopt"] for r in four]
    # Megatron's default order varies tp fastest: mesh (dp, tp); "dp-tp-pp" varies dp fastest: mesh (tp, dp)
    assert [a["tp-cp-ep-dp-pp"]["dims"] for a in adopt] == [("dp", "tp")] * 4
    assert [a["dp-tp-pp"]["dims"] for a in adopt] == [("tp", "dp")] * 4
    for a in adopt:
        for order in ("tp-cp-ep-dp-pp", "dp-tp-pp"):
            got = a[order]
            assert got["roles"] == {"dp": "batch", "tp": "replica"} or got["roles"] == {"tp": "replica", "dp": "batch"}
            assert got["own_groups"], order
            assert got["data_rank"][0] == got["data_rank"][1] and got["tp_rank"][0] == got["tp_rank"][1], (order, got)
        assert a["pp"]["dims"] == ("dp", "pp", "tp") and a["pp"]["roles"]["pp"] == "stage" and a["pp"]["stage"]
        assert a["expert"].startswith("TopologyError") and "expert" in a["expert"], a["expert"]
        assert a["not_initialised"].startswith("TopologyError") and "initialize_model_parallel" in a["not_initialised"]
        own = a["own_mesh"]
        assert own.startswith("TopologyError") and "from_group" in own and "adopt_groups" in own, own
    # the coordinates follow Megatron's ranks: rank 1 is tp=1 under tp-first, dp=1 under dp-first
    assert adopt[1]["tp-cp-ep-dp-pp"]["coords"] == {"dp": 0, "tp": 1}
    assert adopt[1]["dp-tp-pp"]["coords"] == {"tp": 0, "dp": 1}

    r0 = four[0]
    assert r0["init_diff"] == 0.0  # the oracle starts from Megatron's own weights
    assert (
        r0["world_ddp"].startswith("ParallelError") and "process_group=topo.group(topo.metric_dims)" in r0["world_ddp"]
    ), r0["world_ddp"]
    assert r0["parallelize"].startswith("ParallelError") and "DistributedDataParallel" in r0["parallelize"]

    order = r0["run"]["order"]
    ref, ref_norms = _reference(order, STEPS)
    # tp=2 x dp=2 with clipping (it bites: every norm is above CLIP) equals one process, norms and weights
    assert min(ref_norms) > CLIP
    for r in four:
        norms = [r["run"]["norms"][i] for i in range(1, STEPS + 1)]
        assert max(abs(a - b) for a, b in zip(norms, ref_norms)) <= 1e-12 * max(ref_norms), (norms, ref_norms)
        assert _max_diff(r["run_weights"], ref) <= 1e-12, _max_diff(r["run_weights"], ref)
    # resumed at tp=4 and in one process from the step-3 checkpoint: the same batches, weights as the unbroken run
    for run, weights in [(r["tp4"], r["tp4_weights"]) for r in four] + [(one["one"], one["one_weights"])]:
        assert run["resumed"] == SAVED_AT
        assert sorted(run["index"]) == list(range(SAVED_AT + 1, STEPS + 1))
        for it, index in run["index"].items():
            assert sorted(index) == sorted(order[(it - 1) * B : it * B]), it
        assert _max_diff(weights, ref) <= 1e-12, _max_diff(weights, ref)
    print(
        "megatron vs one process: norms",
        max(abs(a - b) for r in four for a, b in zip([r["run"]["norms"][i] for i in range(1, STEPS + 1)], ref_norms)),
        "tp2xdp2",
        max(_max_diff(r["run_weights"], ref) for r in four),
        "tp4 resume",
        max(_max_diff(r["tp4_weights"], ref) for r in four),
        "one-process resume",
        _max_diff(one["one_weights"], ref),
        "first norm",
        ref_norms[0],
    )

    # meshwise export writes the whole tensors (saved at tp=4 here), which load into the plain model
    from meshwise.checkpoint import export

    out = export(str(tmp_path / "tp4"), str(tmp_path / "model.pt"))
    exported = torch.load(out, weights_only=True)
    assert {k for k in exported if k.endswith("_extra_state")} == {"fc1._extra_state", "fc2._extra_state"}
    plain = PlainMLP().double()
    plain.load_state_dict({k: v for k, v in exported.items() if not k.endswith("_extra_state")})  # Megatron's own
    assert _max_diff({k: v for k, v in plain.state_dict().items()}, ref) <= 1e-12


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "megatron", "train.py")


def test_megatron_example_trains_at_tp2_dp2_and_resumes_at_tp4(tmp_path):
    """examples/megatron/train.py as its help says: 4 steps at tp=2 x dp=2, then on to 8 steps at tp=4."""
    from meshwise.testing import run_script

    def torchrun(tp: int, steps: int) -> str:  # the unmodified script as torchrun --nproc-per-node 4 runs it
        args = ["--tp", str(tp), "--steps", str(steps), "--dir", str(tmp_path)]
        return run_script(EXAMPLE, 4, args, timeout=180)[0]

    first, second = torchrun(2, 4), torchrun(4, 8)
    steps = [line for line in first.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1", "2", "3", "4"], first[-3000:]
    assert "mesh dp=2 (batch), tp=2 (replica) resumed_from None" in first, first[-3000:]
    resumed = [line for line in second.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in resumed] == ["5", "6", "7", "8"], second[-3000:]  # the cursor went on at step 5
    assert "mesh dp=1 (batch), tp=4 (replica) resumed_from 4" in second, second[-3000:]
    losses = [float(s.split()[3]) for s in steps + resumed]
    assert losses[-1] < losses[0], losses
