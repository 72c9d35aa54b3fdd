"""Pipeline stages over the topology's stage dim: cut a model into stage modules that keep the full model's
parameter names, place TP and FSDP2 on each, and build torch.distributed.pipelining schedules for them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from meshwise.errors import ParallelError
from meshwise.topology import Topology

__all__ = [
    "SCHEDULES",
    "Cut",
    "PipelineModel",
    "check_microbatches",
    "check_schedule",
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


def pipeline_units(model: nn.Module) -> list[str]:
    """The pieces a cut may separate, in order: the model's children, containers (``ModuleList``,
    ``ModuleDict``, ``Sequential``) opened one level (``"blocks.0"``, ``"blocks.1"``, ...). A Hugging Face
    decoder-only model cuts inside its base model instead: ``model.embed_tokens``, ``model.layers.0`` ...,
    ``model.norm``, ``lm_head`` (:mod:`meshwise.parallel.hf_pipeline`)."""
    from meshwise.parallel.hf_pipeline import hf_decoder_parts, hf_units

    if hf_decoder_parts(model) is not None:
        return hf_units(model)
    units = []
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS) and len(child):
            units.extend(f"{name}.{key}" for key, _ in child.named_children())
        else:
            units.append(name)
    return units


def _default_cuts(model: nn.Module, units: list[str], stages: int) -> list[str]:
    """Cut the model's largest container of blocks into equal runs; what comes before and after goes to the ends."""
    containers = [(len(c), n) for n, c in model.named_children() if isinstance(c, _CONTAINERS) and len(c)]
    if isinstance(model, nn.Sequential) or not containers:
        blocks = units
    else:
        name = max(containers)[1]
        blocks = [u for u in units if u.split(".")[0] == name]
    if stages > len(blocks):
        raise ParallelError(
            f"{stages} pipeline stages but the model has {len(blocks)} blocks to share out ({blocks[:4]}...): "
            "use fewer stages (a smaller pp, or fewer stages_per_rank) or a model with more blocks"
        )
    return [blocks[i * len(blocks) // stages] for i in range(1, stages)]


def stage_cuts(model: nn.Module, stages: int, cut: Cut | None = None) -> list[list[str]]:
    """The units (:func:`pipeline_units`) of each of ``stages`` stages.

    ``cut`` names the unit each stage after the first starts at (``stages - 1`` names, in model order),
    or is a function ``(units, stages) -> those names``; None cuts the largest block container evenly.
    """
    units = pipeline_units(model)
    if len(units) < stages:
        raise ParallelError(
            f"{stages} pipeline stages but {type(model).__name__} has only {len(units)} pieces to cut ({units}): "
            "use fewer stages (a smaller pp, or fewer stages_per_rank) or split the model into more blocks"
        )
    from meshwise.parallel.hf_pipeline import hf_decoder_parts, hf_default_cuts

    if cut is None:
        hf = hf_decoder_parts(model) is not None
        starts = hf_default_cuts(model, stages) if hf else _default_cuts(model, units, stages)
    else:
        starts = list(cut(list(units), stages) if callable(cut) else cut)
        if isinstance(cut, str) or not all(isinstance(s, str) for s in starts):
            raise ParallelError(f"cut must be a list of module names (or a function returning one), got {cut!r}")
    if len(starts) != stages - 1:
        raise ParallelError(
            f"cut names {len(starts)} stage start(s) {starts}, but {stages} stages need {stages - 1}: name the "
            f"unit each stage after the first starts at, from {units}"
        )
    missing = [s for s in starts if s not in units]
    if missing:
        raise ParallelError(
            f"cut names {missing}, which is not a piece of {type(model).__name__} a stage can start at: use names "
            f"from {units} (the pieces pipeline_units lists, in model order)"
        )
    positions = [units.index(s) for s in starts]
    if positions != sorted(set(positions)) or (positions and positions[0] == 0):
        raise ParallelError(
            f"cut {starts} must name distinct units in model order, none of them the first ({units[0]!r}): each "
            "stage needs at least one unit"
        )
    bounds = [0, *positions, len(units)]
    return [units[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def _prune(model: nn.Module, keep: set[str]) -> nn.Module:
    """A deep copy of ``model`` holding only the units in ``keep``, every name unchanged.

    A dropped child of the root becomes None (the model's forward must skip None pieces), except in a
    ``Sequential`` root, where it is removed; a dropped container item is removed, so iterating the
    container runs the kept items in order and their names keep their original keys.
    """
    from meshwise.parallel.hf_pipeline import hf_decoder_parts, hf_stage

    if hf_decoder_parts(model) is not None:
        return hf_stage(model, keep)
    stage = copy.deepcopy(model)
    for name, child in list(stage.named_children()):
        if isinstance(child, _CONTAINERS) and len(child):
            for key in [k for k, _ in child.named_children() if f"{name}.{k}" not in keep]:
                delattr(child, key)  # del child[i] would renumber the items that follow
        elif name not in keep:
            if isinstance(stage, nn.Sequential):
                delattr(stage, name)
            else:
                setattr(stage, name, None)
    return stage


def _check_root(model: nn.Module) -> None:
    """Pieces held by the root itself cannot go to one stage: refuse them."""
    own = [n for n, _ in model.named_parameters(recurse=False)]
    buffers = [n for n, _ in model.named_buffers(recurse=False)]
    if buffers:  # a non-persistent buffer (rotary tables) is not state: no stage needs to own it
        saved = model.state_dict(keep_vars=True)
        own += [n for n in buffers if n in saved]
    if own:
        raise ParallelError(
            f"{type(model).__name__} holds {own} itself; pipeline stages are cut from its children, so no stage "
            "would own them: move them into a submodule (e.g. an nn.Embedding or a small nn.Module)"
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
        for module in stage_modules:
            if hasattr(module, "pieces"):  # an HF decoder stage: pieces nest below the base model
                for path, piece in module.pieces():
                    _attach(self, path, piece)
                continue
            for name, child in module.named_children():  # None (a piece of another stage) is skipped
                if not isinstance(child, _CONTAINERS):
                    self.add_module(name, child)
                    continue
                if not hasattr(self, name):
                    self.add_module(name, nn.Module())
                for key, item in child.named_children():
                    getattr(self, name).add_module(key, item)
        self.stage_modules = list(stage_modules)  # a plain list: not children, so names stay the full model's
        self.stage_indices, self.num_stages = list(stage_indices), num_stages
        self.topology, self.schedule_name = topology, schedule
        self.ranks = topology.size(topology.stage_dims)
        self.microbatches = microbatches if microbatches is not None else num_stages
        self.units = units
        self._schedules: dict[tuple[int, bool], Any] = {}

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

    def schedule(self, rows: int, loss_fn: Callable[..., torch.Tensor] | None) -> Any:
        """The torch schedule for local batches of ``rows`` samples; ``loss_fn=None``: forward only.

        torch's stages size their receive buffers from the first micro-batch they see, so each batch
        size (and training vs evaluation) gets its own stages and schedule, built once.
        """
        key = (rows, loss_fn is None)
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


def _logits_of_model_output(module: nn.Module, args: Any, output: Any) -> Any:
    """The last stage's forward hook: a transformers ``ModelOutput`` becomes its ``logits``.

    torch's schedules take only tensors (or tuples of them) from a stage, and the trainer gives ``loss_fn`` a
    ``ModelOutput``'s logits anyway (:func:`meshwise.engine.trainer.loss_input`); other outputs pass unchanged.
    """
    from meshwise.engine.trainer import loss_input

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
    _check_root(model)
    units = stage_cuts(model, num_stages, cut)
    rank = topology.coordinate(topology.stage_dims)
    indices = list(range(rank, num_stages, ranks))
    modules = [place(_prune(model, set(units[i]))) for i in indices]
    if num_stages - 1 in indices:
        modules[indices.index(num_stages - 1)].register_forward_hook(_logits_of_model_output)
    return PipelineModel(modules, indices, num_stages, topology, name, microbatches, units)


def stage_plan(plan: Mapping[str, Any], module: nn.Module, matches: Callable[[nn.Module, str], bool]) -> dict:
    """The entries of a TP plan that name something in ``module`` (one stage of the model)."""
    return {k: v for k, v in plan.items() if matches(module, k)}
