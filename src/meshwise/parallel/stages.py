"""Pipeline stages over the topology's stage dim: cut a model into stage modules that keep the full model's
parameter names, place TP and FSDP2 on each, and build torch.distributed.pipelining schedules for them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from meshwise.causal_lm import loss_input
from meshwise.errors import ParallelError
from meshwise.parallel.pipeline_probe import agree_input, meta_copy, probe_stages
from meshwise.parallel.pipeline_shared import SharedParameter, check_shared, find_shared, sum_shared_grads
from meshwise.parallel.plugins import Registry
from meshwise.topology import Topology

__all__ = [
    "SCHEDULES",
    "Cut",
    "PipelineModel",
    "StageCutter",
    "check_microbatches",
    "check_schedule",
    "cutter_of",
    "on_stage_cutter",
    "pipeline_of",
    "pipeline_units",
    "split_model",
    "stage_cuts",
]

# meshwise's names (lower case) -> torch.distributed.pipelining class names; whether the schedule is multi-stage
SCHEDULES = {"gpipe": ("ScheduleGPipe", False), "1f1b": ("Schedule1F1B", False)}
SCHEDULES["interleaved1f1b"] = ("ScheduleInterleaved1F1B", True)
_ALIASES = {"interleaved": "interleaved1f1b", "interleaved_1f1b": "interleaved1f1b"}
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

Cut = Sequence[str] | Callable[[list[str], int], Sequence[str]]


class StageCutter(Protocol):
    """How to cut a family of models that an integration knows (meshwise.hf: transformers decoders) into stages."""

    def claims(self, model: nn.Module) -> bool:
        """Whether this cutter cuts ``model`` (it may raise for a model of its family it cannot cut)."""

    def units(self, model: nn.Module) -> list[str]:
        """The pieces a cut may separate, in model order."""

    def default_cuts(self, model: nn.Module, stages: int) -> list[str]:
        """The pieces each stage after the first starts at when no ``cut`` is given."""

    def stage(self, model: nn.Module, keep: set[str]) -> nn.Module:
        """The stage module running the pieces in ``keep``, with the full model's parameter names."""


_CUTTERS: Registry[StageCutter] = Registry()


def on_stage_cutter(cutter: StageCutter) -> None:
    """Register a :class:`StageCutter` (integrations do, so this layer never imports them)."""
    _CUTTERS.add(cutter)


def cutter_of(model: nn.Module) -> StageCutter | None:
    """The registered cutter that claims ``model``, or None (the generic cut of children and containers)."""
    return _CUTTERS.claimant(model)


def check_schedule(schedule: str, stages_per_rank: int | None) -> tuple[str, int]:
    """The schedule's key in :data:`SCHEDULES` and the number of stages each rank holds; bad input raises."""
    key = str(schedule).lower().replace("-", "").replace("schedule", "")
    key = _ALIASES.get(key, key)
    if not isinstance(schedule, str) or key not in SCHEDULES:
        raise ParallelError(
            f"schedule={schedule!r} is not a pipeline schedule meshwise runs: use one of 'GPipe', '1F1B' or "
            "'Interleaved1F1B' (several stages per rank, stages_per_rank=2 by default)"
        )
    multi = SCHEDULES[key][1]
    if stages_per_rank is None:
        stages_per_rank = 2 if multi else 1
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ParallelError(f"stages_per_rank must be an int >= 1, got {stages_per_rank!r}")
    if not multi and stages_per_rank != 1:
        raise ParallelError(
            f"schedule {schedule!r} runs one stage per rank, stages_per_rank={stages_per_rank}: use "
            "schedule='Interleaved1F1B' for several stages per rank"
        )
    return key, stages_per_rank


def check_microbatches(microbatches: int, rows: int, schedule: str, ranks: int, stages: int) -> None:
    """Refuse a micro-batch count that the schedule cannot run on a local batch of ``rows`` samples."""
    if rows % microbatches:
        raise ParallelError(
            f"microbatches={microbatches} does not divide the local batch of {rows} samples: each micro-batch "
            f"must hold the same number of rows; pick a global batch size whose local batch is a multiple of "
            f"{microbatches}, or a micro-batch count dividing {rows}"
        )
    if schedule == "1f1b" and microbatches < stages:
        raise ParallelError(f"schedule '1F1B' needs microbatches >= the {stages} stages, got {microbatches}")
    rounds = max(1, microbatches // ranks)
    if schedule == "interleaved1f1b" and microbatches % rounds:
        raise ParallelError(
            f"schedule 'Interleaved1F1B' needs microbatches to be a multiple of max(1, microbatches // {ranks} "
            f"stage ranks) = {rounds}, got {microbatches}: use a multiple of {ranks}"
        )


# --------------------------------------------------------------------------- cutting a model into stages


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module``'s children in order, a module registered under two names listed under both (``named_children``
    lists it once), ``None`` entries left out."""
    return [(n, m) for n, m in module.named_modules(remove_duplicate=False) if n and "." not in n]


def _ancestors(names: Sequence[str]) -> set[str]:
    """Every proper ancestor path of each dotted name (``"a.b.c"`` gives ``"a"`` and ``"a.b"``)."""
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return out


def pipeline_units(model: nn.Module, cut: Sequence[str] | None = None) -> list[str]:
    """The pieces a cut may separate, in model order: the model's children, every container (``ModuleList``,
    ``ModuleDict``, ``Sequential``) opened at any depth (``"transformer.h.0"``, ``"transformer.h.1"``, ...), and
    every module on the path to a name in ``cut`` opened too, so a cut may name any submodule path. A Hugging
    Face decoder-only model cuts inside its base model instead: ``model.embed_tokens``, ``model.layers.0`` ...,
    ``model.norm``, ``lm_head`` (:mod:`meshwise.hf.pipeline`)."""
    cutter = cutter_of(model)
    if cutter is not None:
        return cutter.units(model)
    opened = _ancestors([c for c in cut or () if isinstance(c, str)])
    units: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in _children(module):
            path = prefix + name
            if (isinstance(child, _CONTAINERS) and len(child)) or path in opened:
                walk(child, path + ".")
            else:
                units.append(path)

    walk(model, "")
    return units


def _opened_modules(model: nn.Module, units: list[str]) -> list[tuple[str, nn.Module]]:
    """(path, module) of the root and of every module opened into pieces (the ancestors of the units)."""
    return [("", model), *((p, model.get_submodule(p)) for p in sorted(_ancestors(units), key=_units_order(units)))]


def _units_order(units: list[str]) -> Callable[[str], int]:
    """A sort key putting a path where its first piece stands in ``units``."""
    return lambda path: next(i for i, u in enumerate(units) if u == path or u.startswith(path + "."))


def _default_cuts(model: nn.Module, units: list[str], stages: int) -> list[str]:
    """Cut the model's largest container of blocks (at any depth) into equal runs of blocks; what comes before
    and after goes to the first and last stage."""
    containers = [  # blocks: a list of one class (not a ModuleDict of an embedding, a norm, ...), the longest first
        (len({type(c) for _, c in _children(m)}) == 1, len(m), -_units_order(units)(p), p)
        for p, m in _opened_modules(model, units)
        if p and isinstance(m, _CONTAINERS) and len(m)
    ]
    if isinstance(model, nn.Sequential) or not containers:
        blocks = units
    else:
        path = max(containers)[3]
        blocks = [f"{path}.{name}" for name, _ in _children(model.get_submodule(path))]
    if stages > len(blocks):
        raise ParallelError(
            f"{stages} pipeline stages but the model has {len(blocks)} blocks to share out ({blocks[:4]}...): "
            "use fewer stages (a smaller pp, or fewer stages_per_rank) or a model with more blocks"
        )
    starts = [blocks[i * len(blocks) // stages] for i in range(1, stages)]
    return [next(u for u in units if u == s or u.startswith(s + ".")) for s in starts]


def _bad_cut(model: nn.Module, name: str, units: list[str]) -> ParallelError:
    """The error for a cut naming no submodule: the valid paths at the depth where the name goes wrong."""
    parts, node, depth = name.split("."), model, 0
    while depth < len(parts) - 1:
        child = dict(_children(node)).get(parts[depth])
        if child is None:
            break
        node, depth = child, depth + 1
    prefix = ".".join(parts[:depth])
    here = [f"{prefix}.{n}" if prefix else n for n, _ in _children(node)]
    where = f"under {prefix!r}" if prefix else f"of {type(model).__name__}"
    return ParallelError(
        f"cut names {name!r}, which is not a submodule a stage can start at: the submodules {where} are {here}; "
        f"a cut may name any submodule path, in model order (pipeline_units(model) lists the default pieces: "
        f"{units})"
    )


def stage_cuts(model: nn.Module, stages: int, cut: Cut | None = None) -> list[list[str]]:
    """The units (:func:`pipeline_units`) of each of ``stages`` stages.

    ``cut`` names the submodule each stage after the first starts at (``stages - 1`` dotted paths at any depth,
    in model order; a container's path starts at its first item), or is a function ``(units, stages) -> those
    names``; None cuts the largest block container evenly.
    """
    cutter = cutter_of(model)
    hf = cutter is not None
    default_units = pipeline_units(model)
    if cut is None:
        if len(default_units) < stages:
            raise ParallelError(
                f"{stages} pipeline stages but {type(model).__name__} has only {len(default_units)} pieces to cut "
                f"({default_units}): use fewer stages (a smaller pp, or fewer stages_per_rank) or split the model "
                "into more blocks"
            )
        starts = cutter.default_cuts(model, stages) if cutter else _default_cuts(model, default_units, stages)
    else:
        starts = list(cut(list(default_units), stages) if callable(cut) else cut)
        if isinstance(cut, str) or not all(isinstance(s, str) for s in starts):
            raise ParallelError(f"cut must be a list of module names (or a function returning one), got {cut!r}")
    units = default_units if hf else pipeline_units(model, starts)
    if len(starts) != stages - 1:
        raise ParallelError(
            f"cut names {len(starts)} stage start(s) {starts}, but {stages} stages need {stages - 1}: name the "
            f"unit each stage after the first starts at, from {units}"
        )
    named = set() if hf else {n for n, _ in model.named_modules(remove_duplicate=False)}
    resolved = []
    for s in starts:
        first = next((u for u in units if u == s or (s in named and u.startswith(s + "."))), None)
        if first is None:
            if hf:
                raise ParallelError(
                    f"cut names {[s]}, which is not a piece of {type(model).__name__} a stage can start at: use "
                    f"names from {units} (the pieces pipeline_units lists, in model order)"
                )
            raise _bad_cut(model, s, units)
        resolved.append(first)
    positions = [units.index(s) for s in resolved]
    if positions != sorted(set(positions)) or (positions and positions[0] == 0):
        raise ParallelError(
            f"cut {starts} must name distinct units in model order, none of them the first ({units[0]!r}): each "
            "stage needs at least one unit"
        )
    bounds = [0, *positions, len(units)]
    return [units[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def _prune(model: nn.Module, keep: set[str], units: Sequence[str] | None = None) -> nn.Module:
    """A deep copy of ``model`` holding only the units in ``keep`` (of ``units``, default: the pieces the kept
    names open), every name unchanged.

    A dropped piece becomes None (the model's forward must skip None pieces), except in a container (or a
    ``Sequential`` root), where it is removed, so iterating the container runs the kept items in order and
    their names keep their original keys.
    """
    cutter = cutter_of(model)
    if cutter is not None:
        return cutter.stage(model, keep)
    stage = copy.deepcopy(model)
    for unit in units if units is not None else pipeline_units(model, sorted(keep)):
        if unit in keep:
            continue
        parent_path, _, leaf = unit.rpartition(".")
        parent = stage.get_submodule(parent_path) if parent_path else stage
        if isinstance(parent, _CONTAINERS):
            delattr(parent, leaf)  # del container[i] would renumber the items that follow
        else:
            setattr(parent, leaf, None)
    return stage


def _check_opened(model: nn.Module, units: list[str]) -> None:
    """Pieces held by the root (or by a module opened into pieces) itself cannot go to one stage: refuse them."""
    for path, module in _opened_modules(model, units):
        own = [n for n, _ in module.named_parameters(recurse=False)]
        buffers = [n for n, _ in module.named_buffers(recurse=False)]
        if buffers:  # a non-persistent buffer (rotary tables) is not state: no stage needs to own it
            saved = module.state_dict(keep_vars=True)
            own += [n for n in buffers if n in saved]
        if own:
            who = f"{type(model).__name__}" if not path else f"{path!r} ({type(module).__name__})"
            raise ParallelError(
                f"{who} holds {own} itself; pipeline stages are cut from its children, so no stage would own "
                "them: move them into a submodule (e.g. an nn.Embedding or a small nn.Module)"
                + ("" if not path else f", or cut outside {path!r}")
            )


# --------------------------------------------------------------------------- the model a rank holds


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under ``root`` at dotted ``path``, making plain ``nn.Module`` shells on the way.

    Shells, not the stage's own containers: two local stages (interleaved) each hold part of one container,
    and neither stage's copy may gain the other's pieces (it would run them).
    """
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if getattr(node, name, None) is None:
            node.add_module(name, nn.Module())
        node = getattr(node, name)
    if not hasattr(node, leaf):  # rotary embeddings: every stage has a copy, without parameters
        node.add_module(leaf, module)


class PipelineModel(nn.Module):
    """This rank's pipeline stages as one module whose parameter names are the full model's.

    Its children are the pieces of the local stage modules (``stage_modules``, not registered as children)
    under their original names, so ``parameters()``, ``state_dict()`` and DCP checkpoints read as the
    one-process model's subset: a checkpoint reshards across stage counts and cuts. Calling it directly
    is an error: :func:`meshwise.create_trainer` and :func:`meshwise.create_evaluator` run its schedule.
    """

    def __init__(
        self,
        stage_modules: list[nn.Module],
        stage_indices: list[int],
        num_stages: int,
        topology: Topology,
        schedule: str,
        microbatches: int | None,
        units: list[list[str]],
    ) -> None:
        super().__init__()
        for module, index in zip(stage_modules, stage_indices):
            if hasattr(module, "pieces"):  # an HF decoder stage: pieces nest below the base model
                for path, piece in module.pieces():
                    _attach(self, path, piece)
                continue
            for path in units[index]:  # under shells: a piece of another stage is not reachable here
                _attach(self, path, module.get_submodule(path))
        self.stage_modules = list(stage_modules)  # a plain list: not children, so names stay the full model's
        self.stage_indices, self.num_stages = list(stage_indices), num_stages
        self.topology, self.schedule_name = topology, schedule
        self.ranks = topology.size(topology.stage_dims)
        self.microbatches = microbatches if microbatches is not None else num_stages
        self.units = units
        self.shared: list[SharedParameter] = []  # parameters several stages hold (set by split_model)
        self.probes: list[nn.Module] = []  # every stage on meta tensors, to try a new input shape on
        self._schedules: dict[tuple, Any] = {}
        self._probed: set[tuple] = set()

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def train(self, mode: bool = True) -> PipelineModel:
        super().train(mode)
        for module in self.stage_modules:
            module.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ParallelError(
            "a pipelined model runs only through its schedule (each rank holds some stages): train it with "
            "meshwise.create_trainer and evaluate it with meshwise.create_evaluator"
        )

    def check_rows(self, rows: int) -> None:
        """Refuse a local batch the micro-batch count does not divide (before any collective)."""
        check_microbatches(self.microbatches, rows, self.schedule_name, self.ranks, self.num_stages)

    def agree_input(self, value: torch.Tensor | None) -> tuple:
        """This step's input ``(shape, dtype)`` on every stage (one all-reduce over the stage group; ``value``:
        the input on the first stage, None elsewhere). A shape seen for the first time is first run through
        every stage on meta tensors (:func:`~meshwise.parallel.pipeline_probe.probe_stages`)."""
        group = self.topology.group(self.topology.stage_dims)
        key = agree_input(value if self.is_first else None, group, self.topology.device)
        if key not in self._probed and self.probes:
            shape, dtype = key
            if shape and shape[0] % self.microbatches == 0:
                micro = (shape[0] // self.microbatches, *shape[1:])
                probe_stages(self.probes, self.units, micro, dtype)
            self._probed.add(key)
        return key

    def schedule(self, rows: int, loss_fn: Callable[..., torch.Tensor] | None, key: tuple = ()) -> Any:
        """The torch schedule for local batches of ``rows`` samples; ``loss_fn=None``: forward only.

        torch's stages size their receive buffers from the first micro-batch they see, so each input shape
        (``key`` from :meth:`agree_input`; at least the row count) and training vs evaluation gets its own
        stages and schedule, built once.
        """
        key = (rows, key, loss_fn is None)
        if key not in self._schedules:
            self.check_rows(rows)
            from torch.distributed import pipelining

            group = self.topology.group(self.topology.stage_dims)
            stages = [
                pipelining.PipelineStage(m, i, self.num_stages, self.topology.device, group=group)
                for m, i in zip(self.stage_modules, self.stage_indices)
            ]
            cls = getattr(pipelining, SCHEDULES[self.schedule_name][0])
            first = stages if SCHEDULES[self.schedule_name][1] else stages[0]
            # Gradients come out as meshwise weights them (counts, not a mean over micro-batches).
            self._schedules[key] = cls(first, self.microbatches, loss_fn=loss_fn, scale_grads=False)
        return self._schedules[key]

    def sum_shared_grads(self) -> None:
        """Sum the gradient of every parameter several stages hold over those stages (after backward, before
        clipping and the optimizer step); :func:`meshwise.create_trainer` calls it. Nothing when none is shared."""
        if self.shared:
            group = self.topology.group(self.topology.stage_dims)
            sum_shared_grads(self.shared, self, self.stage_indices, group, self.topology.device)


def _logits_of_model_output(module: nn.Module, args: Any, output: Any) -> Any:
    """The last stage's forward hook: a transformers ``ModelOutput`` becomes its ``logits``.

    torch's schedules take only tensors (or tuples of them) from a stage, and the trainer gives ``loss_fn`` a
    ``ModelOutput``'s logits anyway (:func:`meshwise.causal_lm.loss_input`); other outputs pass unchanged.
    """
    return loss_input(output)


def pipeline_of(model: Any) -> PipelineModel | None:
    """``model`` if it is a :class:`PipelineModel` (what :func:`meshwise.parallelize` returns over a stage dim)."""
    return model if isinstance(model, PipelineModel) else None


def split_model(
    model: nn.Module,
    topology: Topology,
    *,
    cut: Cut | None,
    schedule: str,
    microbatches: int | None,
    stages_per_rank: int | None,
    place: Callable[[nn.Module], nn.Module],
) -> PipelineModel:
    """Cut ``model`` into stages, keep this rank's (loop order: rank r holds r, r + pp, ...), place each with
    ``place`` (TP and data parallel) and wrap them in a :class:`PipelineModel`. Checks everything first."""
    name, per_rank = check_schedule(schedule, stages_per_rank)
    ranks = topology.size(topology.stage_dims)
    num_stages = ranks * per_rank
    if microbatches is not None and (
        isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1
    ):
        raise ParallelError(f"microbatches must be an int >= 1, got {microbatches!r}")
    units = stage_cuts(model, num_stages, cut)
    _check_opened(model, [u for part in units for u in part])
    shared = find_shared(model, units)  # before any stage drops a piece: one Parameter under two stages' names
    probes = _probes(model, units)
    rank = topology.coordinate(topology.stage_dims)
    indices = list(range(rank, num_stages, ranks))
    flat = [u for part in units for u in part]
    modules = [place(_prune(model, set(units[i]), flat)) for i in indices]
    if num_stages - 1 in indices:
        modules[indices.index(num_stages - 1)].register_forward_hook(_logits_of_model_output)
    pipeline = PipelineModel(modules, indices, num_stages, topology, name, microbatches, units)
    pipeline.probes = probes
    if shared:
        check_shared(shared, pipeline, indices, topology.group(topology.stage_dims))
        pipeline.shared = shared
    return pipeline


def _probes(model: nn.Module, units: list[list[str]]) -> list[nn.Module]:
    """Every stage of ``model`` on meta tensors (no data), to run a new input shape through before a step; none
    for a transformers decoder, whose stage forward is meshwise's own."""
    if cutter_of(model) is not None:
        return []
    meta = meta_copy(model)
    flat = [u for part in units for u in part]
    return [_prune(meta, set(part), flat) for part in units]


def stage_plan(plan: Mapping[str, Any], module: nn.Module, matches: Callable[[nn.Module, str], bool]) -> dict:
    """The entries of a TP plan that name something in ``module`` (one stage of the model)."""
    return {k: v for k, v in plan.items() if matches(module, k)}
