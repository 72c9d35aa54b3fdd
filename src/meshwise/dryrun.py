"""Dry runs: this one process plays any rank of a planned world on torch's fake backend, and the rooms report
into a recorder what that rank would hold, read and write, for ``meshwise run --dry-run`` (docs/dryrun.md).

It sits just above the topology (which never imports it): :func:`meshwise.init` joins the fake backend itself, and
this module's :func:`meshwise.topology.on_init` hook, registered when it is first imported, records the topology
and gives ``ignite.distributed`` the planned placement. The loader, ``parallelize``, the trainer and the
checkpointer call the ``note_*`` functions, which do nothing unless a dry run is recording.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from meshwise import compat, rendezvous, topology
from meshwise.environment import Environment
from meshwise.layout import Layout, placement_warnings

__all__ = [
    "NOT_COMPUTED",
    "Recorder",
    "active",
    "begin",
    "end",
    "join_fake_group",
    "leave_ignite",
    "node_of",
    "note_advice",
    "note_checkpoint",
    "note_load",
    "note_loader",
    "note_model",
    "note_topology",
    "note_trainer",
    "render",
    "tensor_bytes",
]

#: How a dry run shows a number that only communication could produce (a global loss, a metric, a gathered list).
NOT_COMPUTED = "not computed (needs communication)"


@dataclass
class Recorder:
    """What the rooms reported during one dry run; :meth:`facts` and :meth:`report` read it at the end."""

    steps: int  # trainer steps to run before the trainer is stopped
    topology: Any = None
    loaders: list[Any] = field(default_factory=list)
    models: list[Any] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    trainer_steps: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    loads: list[dict[str, Any]] = field(default_factory=list)  # checkpoint loads asked for (none is read)
    advice: list[str] = field(default_factory=list)  # warnings the rooms gave this rank (e.g. empty FSDP2 shards)

    def facts(self) -> dict[str, Any]:
        """Everything recorded, as plain values (the report's content, for tools and tests)."""
        return {
            "topology": _topology_facts(self.topology) if self.topology is not None else None,
            "loaders": [_loader_facts(loader) for loader in self.loaders],
            "models": [_model_facts(m) for m in self.models],
            "optimizer_bytes": sum(_optimizer_bytes(o) for o in self.optimizers),
            "trainer_steps": self.trainer_steps,
            "checkpoints": self.checkpoints,
            "loads": self.loads,
            "advice": self.advice,
        }

    def report(self) -> str:
        """The dry run's report: groups, data slice, bytes per rank, files it would write, placement advice."""
        return render(self.facts())


_ACTIVE: Recorder | None = None


def begin(steps: int) -> Recorder:
    """Start recording (``meshwise run --dry-run`` does, before the script runs); returns the recorder."""
    global _ACTIVE
    _ACTIVE = Recorder(int(steps))
    return _ACTIVE


def end() -> Recorder | None:
    """Stop recording; returns what was recorded."""
    global _ACTIVE
    recorder, _ACTIVE = _ACTIVE, None
    return recorder


def active() -> Recorder | None:
    """The recorder of the dry run in progress, or None (a real run)."""
    return _ACTIVE


def join_fake_group(env: Environment, timeout: datetime.timedelta) -> None:
    """Be rank ``env.rank`` of ``env.world_size`` on torch's fake backend (what :func:`meshwise.init` does in a dry
    run), with ignite told the planned placement."""
    rendezvous.join_fake_group(env, timeout)
    _tell_ignite(env)


def _tell_ignite(env: Environment) -> None:
    """Give ``ignite.distributed`` the planned placement: its own discovery makes a gloo group (to learn the
    processes per node) and gathers every hostname, neither of which the fake backend can do."""

    class DryRunModel(compat.ignite_native_model_type()):  # type: ignore[misc]
        def _identify_local_rank(self) -> None:
            self._local_rank = env.local_rank

        def _compute_nproc_per_node(self) -> int:
            return env.local_world_size

    compat.set_ignite_model(DryRunModel())


def leave_ignite() -> None:
    """Hand ``ignite.distributed`` back to its own discovery (after a dry run, or when meshwise leaves its group)."""
    compat.set_ignite_model(compat.ignite_serial_model())
    compat.mark_ignite_unsynced()


def node_of(env: Environment) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Every rank's node as the launcher would number them (node by node), without asking anyone."""
    return topology.planned_nodes(env)


# --------------------------------------------------------------------------- what the rooms report


def note_topology(topo: Any) -> None:
    """``meshwise.init`` made ``topo`` (starts recording when the dry run was set up without the CLI)."""
    recorder = _ACTIVE
    if recorder is None and topo.environment.launcher == "dry-run":
        recorder = begin(2)
    if recorder is not None:
        recorder.topology = topo


def _joined(topo: Any) -> None:
    """The :func:`meshwise.topology.on_init` hook: a dry-run topology gets ignite's placement and is recorded."""
    if topo.environment.launcher == "dry-run":
        _tell_ignite(topo.environment)
    note_topology(topo)


topology.on_init(_joined)
if topology.current() is not None:  # init came before this module's first import: catch up
    _joined(topology.current())


def note_loader(loader: Any) -> None:
    if _ACTIVE is not None:
        _ACTIVE.loaders.append(loader)


def note_advice(message: str) -> None:
    """A room warned this rank (once, at set-up): the report lists it."""
    if _ACTIVE is not None and message not in _ACTIVE.advice:
        _ACTIVE.advice.append(message)


def note_model(model: Any) -> Any:
    """``parallelize`` placed ``model`` (returned, so the call wraps its result)."""
    if _ACTIVE is not None:
        _ACTIVE.models.append(model)
    return model


def note_trainer(engine: Any, optimizer: Any) -> None:
    """Record each trainer step (its samples, shapes, bytes read) and stop the trainer after the planned steps."""
    recorder = _ACTIVE
    if recorder is None:
        return
    from ignite.engine import Events

    recorder.optimizers.append(optimizer)
    clock = {"t0": 0.0, "read": 0}

    def started(engine: Any) -> None:
        loader = engine.state.dataloader
        if loader is not None and all(loader is not seen for seen in recorder.loaders):
            recorder.loaders.append(loader)  # a loader that reported nothing when built (a stream): described too
        clock["t0"] = time.perf_counter()
        clock["read"] = getattr(engine.state.dataloader, "bytes_read", 0)

    def completed(engine: Any) -> None:
        batch = engine.state.batch if isinstance(engine.state.batch, dict) else {}
        valid = batch.get("valid")
        index = batch.get("index")
        if index is not None and valid is not None:
            index = index[valid]
        recorder.trainer_steps.append(
            {
                "iteration": engine.state.iteration,
                "seconds": time.perf_counter() - clock["t0"],
                "samples": [] if index is None else [int(i) for i in index.tolist()],
                "shapes": {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)},
                "bytes_read": _planned_bytes(engine.state.dataloader, clock["read"]),
                "loss": NOT_COMPUTED,
            }
        )
        if len(recorder.trainer_steps) >= recorder.steps:
            engine.terminate()

    engine.add_event_handler(Events.GET_BATCH_STARTED, started)  # the batch is read after ITERATION_STARTED
    engine.add_event_handler(Events.ITERATION_COMPLETED, completed)


def _planned_bytes(loader: Any, before: int) -> int:
    """Bytes of this step under the planned read mode (the dry run read the shared batch itself: docs/dryrun.md)."""
    read = getattr(loader, "bytes_read", 0) - before
    planned = getattr(loader, "planned_read", "each")
    if planned == "broadcast" and loader.replica_rank != 0:
        return 0
    return -(-read // loader.replica_size) if planned == "scatter" else read


def note_checkpoint(root: Any, entry: Any, rank: int, state: dict[str, Any], small: dict[str, Any]) -> bool:
    """In a dry run, record what this rank would write for checkpoint ``entry`` and return True: write nothing."""
    if _ACTIVE is None:
        return False
    folder = f"{root}/step-{entry}" if isinstance(entry, int) else f"{root}/{entry}"
    shard = sum(_written_bytes(t, rank) for t in _tensors(state))
    files = [{"path": f"{folder}/__{rank}_0.distcp", "bytes": shard, "what": "DCP shards of this rank"}]
    files.append({"path": f"{folder}/rng/rank-{rank:05d}.pt", "bytes": None, "what": "this rank's RNG states"})
    if rank == 0:
        files.append({"path": f"{folder}/.metadata", "bytes": None, "what": "DCP metadata (rank 0)"})
        what = "state_dict (rank 0; objects/<name>.pt when it is not plain JSON data)"
        files += [{"path": f"{folder}/objects/{n}.json", "bytes": None, "what": what} for n in small]
    _ACTIVE.checkpoints.append({"folder": folder, "files": files})
    return True


def note_load(root: Any, entry: Any, objects: list[str]) -> None:
    """A checkpoint load was asked for: a dry run reads no checkpoint folder (the objects keep their state)."""
    if _ACTIVE is not None:
        _ACTIVE.loads.append({"folder": str(root), "entry": entry, "objects": objects})


# --------------------------------------------------------------------------- facts, from local tensors only


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t``: the local shard of a DTensor, the whole of a plain tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _written_bytes(t: torch.Tensor, rank: int) -> int:
    """DCP writes a replicated tensor once: a plain tensor on rank 0, a DTensor's shard on the first replica."""
    if not hasattr(t, "to_local"):
        return tensor_bytes(t) if rank == 0 else 0
    mesh = t.device_mesh
    for dim, placement in enumerate(t.placements):
        if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
            return 0
    return tensor_bytes(t)


def _ranks_text(ranks: list[int]) -> str:
    """``0-3`` or ``0,4,8,...,60 (every 4th)`` or the list: a group's ranks in a short line."""
    if len(ranks) <= 4:
        return ",".join(map(str, ranks))
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}-{ranks[-1]}" if step == 1 else f"{ranks[0]}..{ranks[-1]} step {step}"
    return ",".join(map(str, ranks[:3])) + f",... ({len(ranks)} ranks)"


def _topology_facts(topo: Any) -> dict[str, Any]:
    layout: Layout = topo.layout
    nodes = topo.nodes
    groups = []
    for dims in topo.group_dims:
        ranks = layout.group_ranks(topo.rank, dims)
        groups.append(
            {
                "dims": list(dims),
                "size": len(ranks),
                "count": layout.world_size // len(ranks),
                "coordinate": layout.coordinate(topo.rank, dims),
                "ranks": _ranks_text(ranks),
                "nodes": len({nodes[r] for r in ranks}),
            }
        )
    return {
        "mesh": layout.dims_text(),
        "world_size": layout.world_size,
        "rank": topo.rank,
        "coordinates": topo.coordinates(),
        "data_rank": topo.data_rank,
        "data_size": topo.data_size,
        "node": topo.node,
        "nodes": topo.num_nodes,
        "nproc_per_node": topo.environment.local_world_size,
        "backend": topo.backend,
        "groups": groups,
        "placement": placement_warnings(layout, nodes),
    }


def _loader_kind(loader: Any) -> str:
    """``arrays`` (MeshDataLoader), ``map-style`` (MeshSampleLoader), ``stream`` (MeshStreamLoader) or ``other``,
    from what each shows: a sampler's global cursor, a map-style dataset, a stream's fingerprint."""
    if getattr(getattr(loader, "sampler", None), "global_batch_size", None) is not None:
        return "map-style" if hasattr(loader, "specs") and hasattr(loader, "dataset") else "arrays"
    if hasattr(loader, "fingerprint") and hasattr(loader, "global_batch_size"):
        return "stream"
    return "other"


def _dataset_facts(dataset: Any) -> dict[str, Any]:
    """The source's class, length (None for a stream), shard count and columns, from its public attributes."""
    facts: dict[str, Any] = {"dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}"}
    try:
        facts["length"] = len(dataset)
    except TypeError:  # a stream has no length
        facts["length"] = None
    for name in ("num_shards", "column_names"):
        value = getattr(dataset, name, None)
        if isinstance(value, (int, list)):
            facts[name] = value
    return facts


def _loader_facts(loader: Any) -> dict[str, Any]:
    kind = _loader_kind(loader)
    parts = {}
    for name, part in dict(getattr(loader, "parts", None) or {}).items():
        parts[name] = {
            "sample_shape": list(part.sample_shape),
            "regions": [[[s.start, s.stop] for s in region] for region in part.regions],
            "shape": list(part.shape),
        }
    facts: dict[str, Any] = {"kind": kind, "parts": parts, "bytes_read": getattr(loader, "bytes_read", None)}
    if kind == "stream":
        topo = loader.topology
        data = _dataset_facts(loader.dataset)
        shards = data.get("num_shards")
        return {
            **facts,
            **data,
            "mode": loader.mode,
            "dataset_length": None,
            "global_batch_size": loader.global_batch_size,
            "local_batch_size": loader.local_batch_size,
            "data_rank": topo.data_rank,
            "data_size": topo.data_size,
            "steps_per_epoch": None,  # a stream's end is known when it comes
            "read": "each",
            "shards_per_rank": None if shards is None else shards // topo.data_size,
            "collate": getattr(loader.collate_fn, "__name__", type(loader.collate_fn).__name__),
        }
    sampler = loader.sampler
    facts |= {
        "mode": sampler.mode,
        "dataset_length": sampler.dataset_length,
        "global_batch_size": sampler.global_batch_size,
        "local_batch_size": sampler.local_batch_size,
        "data_rank": sampler.data_rank,
        "data_size": sampler.data_size,
        "steps_per_epoch": len(loader),
        "read": getattr(loader, "planned_read", loader.read),
    }
    if kind == "map-style":
        facts |= _dataset_facts(loader.dataset)
    blend = getattr(loader.dataset, "blend", None)
    if blend is not None:  # a mixture (meshwise.data.mix): its sources, the weights in force, samples a step
        weights = sampler.weights().at_sample(sampler.total) if hasattr(sampler, "weights") else None
        facts["mixture"] = {
            "sources": dict(zip(blend.names, blend.lengths)),
            "weights": weights,
            "exhausted": blend.exhausted,
            "per_rank_step": None if weights is None else {n: w * sampler.local_batch_size for n, w in weights.items()},
        }
    return facts


def _model_facts(model: Any) -> dict[str, Any]:
    params = []
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params.append(
            {
                "name": name,
                "shape": list(p.shape),
                "local_shape": list(local.shape),
                "dtype": str(local.dtype).replace("torch.", ""),
                "bytes": tensor_bytes(p),
            }
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in trainable if p.grad is not None]
    return {
        "parameters": params,
        "parameter_bytes": sum(x["bytes"] for x in params),
        # measured after the steps when the gradients still exist, else their size: one per trainable parameter
        "gradient_bytes": sum(map(tensor_bytes, grads)) if grads else sum(map(tensor_bytes, trainable)),
        "numel": sum(math.prod(x["shape"]) for x in params),
    }


def _optimizer_bytes(optimizer: Any) -> int:
    return sum(tensor_bytes(t) for state in optimizer.state.values() for t in _tensors(state))


# --------------------------------------------------------------------------- the report


def _size(n: float | None) -> str:
    if n is None:
        return "size known at write time"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def render(facts: dict[str, Any]) -> str:
    """The text of :meth:`Recorder.report` for ``facts``."""
    lines = ["meshwise dry run (fake backend: nothing was communicated)"]
    topo = facts["topology"]
    if topo is None:
        return "\n".join([*lines, "the script never called meshwise.init(): nothing to report"])
    coords = ", ".join(f"{d}={c}" for d, c in topo["coordinates"].items())
    lines += [
        f"rank {topo['rank']} of {topo['world_size']}: {coords}; data rank {topo['data_rank']} of "
        f"{topo['data_size']}; node {topo['node']} of {topo['nodes']} ({topo['nproc_per_node']} per node)",
        f"mesh {topo['mesh']}",
        "groups (one line per kind; this rank's group):",
    ]
    for g in topo["groups"]:
        lines.append(
            f"  {'+'.join(g['dims']):<16} {g['count']} groups of {g['size']}; coordinate {g['coordinate']}; "
            f"ranks {g['ranks']}; spans {g['nodes']} node(s)"
        )
    lines += [f"  placement advice: {w}" for w in topo["placement"]] or ["  placement advice: none"]
    for i, loader in enumerate(facts["loaders"]):
        kind = loader.get("kind", "arrays")
        source = f" {loader['dataset']}," if "dataset" in loader else ""
        if kind == "stream":
            shards = loader.get("num_shards")
            size = "a stream" + (f" of {shards} shards, {loader['shards_per_rank']} per data rank" if shards else "")
            steps = "steps/epoch known when the stream ends"
        else:
            size, steps = f"{loader['dataset_length']} samples", f"{loader['steps_per_epoch']} steps/epoch"
        read = "" if loader["bytes_read"] is None else f", {_size(loader['bytes_read'])} read"
        lines.append(
            f"loader {i} ({kind}, {loader['mode']}):{source} {size}, global batch {loader['global_batch_size']}, "
            f"local batch {loader['local_batch_size']} (data rank {loader['data_rank']} of {loader['data_size']}), "
            f"{steps}, read {loader['read']}{read}"
        )
        mixture = loader.get("mixture")
        if mixture is not None:
            weights = mixture["weights"] or "read every sample of every source once (eval)"
            lines.append(
                f"  mixture of {mixture['sources']} (samples), exhausted={mixture['exhausted']!r}; weights now "
                f"{weights}; samples of each source a rank reads a step, on average: {mixture['per_rank_step']}"
            )
        for name, part in loader["parts"].items():
            regions = " + ".join("[" + ", ".join(f"{a}:{b}" for a, b in r) + "]" for r in part["regions"])
            lines.append(f"  field {name}: sample {part['sample_shape']} -> part {regions}, shape {part['shape']}")
    for step in facts["trainer_steps"]:
        shown = step["samples"][:8]
        more = f" ... ({len(step['samples'])})" if len(step["samples"]) > 8 else ""
        lines.append(
            f"trainer step {step['iteration']}: samples {shown}{more}; read {_size(step['bytes_read'])}; "
            f"{step['seconds'] * 1e3:.1f} ms; loss {step['loss']}"
        )
    for i, model in enumerate(facts["models"]):
        lines.append(
            f"model {i}: {model['numel']:,} parameters; this rank holds {_size(model['parameter_bytes'])} of "
            f"parameters, {_size(model['gradient_bytes'])} of gradients"
        )
        for p in model["parameters"][:12]:
            lines.append(f"  {p['name']}: {p['shape']} -> local {p['local_shape']} {p['dtype']}, {_size(p['bytes'])}")
        if len(model["parameters"]) > 12:
            lines.append(f"  ... {len(model['parameters']) - 12} more parameters")
    lines.append(f"optimizer state on this rank: {_size(facts['optimizer_bytes'])}")
    for ckpt in facts["checkpoints"]:
        lines.append(f"checkpoint plan {ckpt['folder']} (nothing written):")
        lines += [f"  {f['path']}: {f['what']}, {_size(f['bytes'])}" for f in ckpt["files"]]
    for load in facts.get("loads", []):
        lines.append(
            f"checkpoint load {load['entry']!r} of {load['folder']}: not read in a dry run ({load['objects']})"
        )
    lines += [f"advice: {a}" for a in facts.get("advice", [])]
    lines.append(f"losses, metric values and gathered results: {NOT_COMPUTED}")
    return "\n".join(lines)
