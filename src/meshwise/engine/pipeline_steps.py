"""The trainer and evaluator steps of a pipelined model: each runs the stages' torch schedule on the local
batch, with the loss weighted, reduced and clipped as :class:`~meshwise.engine.trainer.TrainStep` does."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from ignite.engine import Engine
from torch import nn

from meshwise.causal_lm import Batch
from meshwise.debug import guarded
from meshwise.engine.batch import full_tensors, local_value, ready_batch, row_count, take_rows
from meshwise.engine.train_step import TrainStep, call_loss, check_scalar_loss
from meshwise.errors import MetricError, ParallelError
from meshwise.parallel.clipping import local_norm_contribution
from meshwise.parallel.stages import PipelineModel, pipeline_of
from meshwise.topology import Topology

__all__ = ["PipelineEvalStep", "PipelineTrainStep", "stage_input"]


def stage_input(batch: Batch, key: str, pipeline: PipelineModel, who: str) -> torch.Tensor:
    """``batch[key]`` on a stage that needs it, with what to change when the loader did not read it."""
    value = batch.get(key)
    if not isinstance(value, torch.Tensor):
        where = "first" if pipeline.is_first and who == "input" else "last"
        raise ParallelError(
            f"the {where} pipeline stage needs batch[{key!r}] (the {who}), and this batch has {sorted(batch)}: "
            f"read it on the {where} stage, e.g. mesh_dataloader(..., stage_fields={{'first': ['input'], "
            "'last': ['target']}}) with your field names, or set input_key=/target_key="
        )
    return value


def _take_output(output: Any, rows: int, keep: slice | torch.Tensor) -> Any:
    """The rows ``keep`` of a stage output (tensor, DTensor, or a tuple/list/dict of them)."""
    if isinstance(output, torch.Tensor):
        return output[keep] if output.ndim and output.shape[0] == rows else output
    if isinstance(output, dict):
        return {k: _take_output(v, rows, keep) for k, v in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(_take_output(v, rows, keep) for v in output)
    return output


class PipelineTrainStep(TrainStep):
    """A :class:`TrainStep` for a model that :func:`meshwise.parallelize` cut into pipeline stages.

    Each accumulation part of the local batch runs one schedule step (``microbatches`` micro-batches). The
    loss is computed on the last stage, per micro-batch, on its valid rows only (padded rows still flow
    through the stages, so shapes stay fixed) and scaled by ``count * data_parallel / reference`` before
    the schedule's backward, exactly as :meth:`TrainStep.backward` scales it. Count, loss and the clipping
    norm's power-sum travel in one world all-reduce, so every rank of every stage gets the same
    ``state.output``, ``loss_count`` and ``grad_norm``. Options are those of :func:`create_trainer`, except
    ``forward`` (the first stage is called on ``batch[input_key]``). As in :class:`TrainStep`, a transformers
    ``ModelOutput`` from the last stage reaches ``loss_fn`` as its ``logits`` (a forward hook of the last stage
    takes them out: torch's schedules carry only tensors), and under ``loss_weight="labels"``
    a micro-batch without a scored label weighs 0 and leaves no NaN.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, *args: Any, **kw: Any):
        pipeline = pipeline_of(model)
        if pipeline is None:
            raise ParallelError(
                "the mesh has a pipeline (stage) dim but the model is not cut into stages: build it with "
                "meshwise.parallelize(model, topo, cut=..., schedule=..., microbatches=...) first"
            )
        if kw.get("forward") is not None:
            raise ParallelError(
                "forward= is not used with pipeline stages: the first stage is called on batch[input_key] and "
                "each later stage on the previous stage's output; put extra steps inside the stage modules"
            )
        super().__init__(model, optimizer, loss_fn, *args, **kw)
        self.pipeline = pipeline
        topo = self.topology
        # Count and loss exist on the last stage only, held identically by its replica ranks.
        self.replica_copies = topo.world_size // (self.data_parallel * topo.size(topo.stage_dims))
        self._part: Batch = {}
        self._rows = 0
        self._counts: list[float] = []
        self._selected: list[tuple[dict[str, Any], slice | torch.Tensor | None, bool]] = []
        self._losses: dict[int, torch.Tensor] = {}

    def counts_first(self) -> bool:
        """Backward is scaled by this step's own global count, not the previous one's, under a built-in weight.

        The count travels in one scalar world all-reduce before the schedule runs. Scaling by the exact count
        gives each rank's gradients as one process's times the data-parallel size, so float32 islands inside
        a float64 model (Hugging Face's ``LlamaRMSNorm`` computes in float32, backward too) round as in one
        process: with the previous step's count the factor fixed afterwards is no power of two and those
        islands round differently (1e-6 off one process after 3 steps of a tiny Llama under ``"labels"``).
        A ``loss_weight`` function keeps the previous step's count (its counts need not add over rows).
        """
        return not callable(self.loss_weight)

    def _global_count(self, batch: Batch) -> float:
        """The global batch's count (valid rows only) under a built-in ``loss_weight``: the last stage counts."""
        local = 0.0
        if self.pipeline.is_last:
            rows = row_count(batch, self.input_key)
            valid = batch.get("valid")
            if isinstance(valid, torch.Tensor) and not bool(valid.all()):
                batch = take_rows(batch, rows, valid)
            local = self.count_of(batch) if rows else 0.0
        vec = torch.tensor([local / self.replica_copies], dtype=torch.float64, device=self.topology.device)
        dist.all_reduce(vec)
        return float(vec.item())

    def backward(self, micro: Batch, last: bool) -> tuple[float, torch.Tensor | None]:
        """One schedule step on ``micro`` (an accumulation part); its count and ``Σ count·loss`` on the last stage."""
        pipe, topo = self.pipeline, self.topology
        rows = row_count(micro, self.input_key)
        pipe.check_rows(rows)  # the same on every rank, before any collective
        self._part, self._rows, self._losses = micro, rows, {}
        n = pipe.microbatches
        args = (stage_input(micro, self.input_key, pipe, "input"),) if pipe.is_first else ()
        target = None
        if pipe.is_last:
            if self.target_key is not None:
                stage_input(micro, self.target_key, pipe, "target")
            # each micro-batch's valid rows, selected once a step: the loss of micro-batch i reuses them
            self._selected = [self._select(i) for i in range(n)]
            self._counts = [0.0 if empty else self.count_of(part) for part, _, empty in self._selected]
            if self.loss_weight == "labels" and self.target_key is not None:
                # as TrainStep.backward: a mean over no labels is 0/0, NaN gradients even at weight 0; class 0
                # keeps it finite while the micro-batch still flows through every stage (weight 0)
                self._selected = [
                    ({**part, self.target_key: torch.zeros_like(part[self.target_key])}, keep, empty)
                    if not count
                    else (part, keep, empty)
                    for (part, keep, empty), count in zip(self._selected, self._counts)
                ]
            # the schedule splits this like the inputs: each micro-batch's loss learns which rows it has
            target = torch.arange(rows, device=topo.device)
        # every stage learns the input's shape (batches padded to a length of their own build their own stages)
        schedule = pipe.schedule(rows, self._stage_loss, pipe.agree_input(args[0] if args else None))
        with self.step_context():
            schedule.step(*args, target=target, return_outputs=False)
        if last:  # a parameter several stages hold (a tied embedding and head) gets the sum of their gradients
            pipe.sum_shared_grads()
        if not pipe.is_last or not any(self._counts):
            return 0.0, None
        weighted = [self._losses[i] * c for i, c in enumerate(self._counts) if c]
        return float(sum(self._counts)), torch.stack(weighted).sum()

    def _select(self, i: int) -> tuple[dict[str, Any], slice | torch.Tensor | None, bool]:
        """Micro-batch ``i``'s valid rows, the selection to apply to its output (None: all), and whether it is empty."""
        size = self._rows // self.pipeline.microbatches
        part = take_rows(self._part, self._rows, slice(i * size, (i + 1) * size))
        valid = part.get("valid")
        if not isinstance(valid, torch.Tensor) or bool(valid.all()):
            return part, None, False
        kept = int(valid.sum())
        if kept == 0:  # the schedule still runs it (collectives inside); weight 0
            return take_rows(part, size, slice(0, 1)), slice(0, 1), True
        keep: slice | torch.Tensor = slice(0, kept) if bool(valid[:kept].all()) else valid  # padding comes last
        return take_rows(part, size, keep), keep, False

    def _stage_loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (``rows``: its row positions), scaled for backward."""
        size = self._rows // self.pipeline.microbatches
        i = int(rows[0]) // size
        micro, keep, _ = self._selected[i]
        if keep is not None:
            output = _take_output(output, size, keep)
        loss = call_loss(self.loss_fn, output, micro if self.target_key is None else micro[self.target_key])
        check_scalar_loss(loss)
        self._losses[i] = local_value(loss).double()  # torch's shape inference calls this once first: overwritten
        scale = self._counts[i] * self.data_parallel / self.reference
        return loss if scale == 1.0 else loss * scale

    def reduce(
        self, local_count: float, loss_sum: torch.Tensor, grads: list[torch.Tensor]
    ) -> tuple[float, float, float | None]:
        """Like :meth:`TrainStep.reduce`, but over the world always: count and loss live on the last stage."""
        if self.max_norm is not None and not math.isinf(self.norm_type):
            return super().reduce(local_count, loss_sum, grads)
        topo, copies = self.topology, self.replica_copies
        vec = torch.stack([loss_sum.new_tensor(local_count) / copies, loss_sum / copies])
        dist.all_reduce(vec)
        count, loss_total = vec.tolist()
        norm_power = None
        if self.max_norm is not None:
            peak = local_norm_contribution(grads, topo, self.norm_type)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            norm_power = peak.item()
        return count, loss_total, norm_power


class PipelineEvalStep:
    """The evaluator's process function for a pipelined model: a forward-only schedule, metrics on the last stage.

    Built by :func:`meshwise.create_evaluator` from its ordinary step (``base``: model, topology, metrics,
    select, prepare). Only the last stage holds outputs; :class:`~meshwise.metrics.MeshMetric` computes
    there and sends the values to the other stages, so every rank gets the same ``state.metrics``.
    """

    def __init__(self, base: Any, input_key: str, forward: Callable | None) -> None:
        if forward is not None:
            raise MetricError(
                "forward= is not used with pipeline stages: the first stage is called on batch[input_key]; "
                "use select= to pick what the metrics see from the last stage's output"
            )
        self.pipeline = pipeline_of(base.model)
        self.topology: Topology = base.topology
        self.metrics, self.select, self.prepare = base.metrics, base.select, base.prepare
        self.input_key = input_key

    def __call__(self, engine: Engine, batch: Batch) -> Any:
        topo, pipe = self.topology, self.pipeline
        with guarded(topo, topo.dims, "evaluator step", step=engine.state.iteration, region=True):
            batch = ready_batch(batch, self.prepare, topo.device, "evaluator", MetricError)
            rows = row_count(batch, self.input_key)
            args = (stage_input(batch, self.input_key, pipe, "input"),) if pipe.is_first else ()
            with torch.no_grad():
                output = pipe.schedule(rows, None, pipe.agree_input(args[0] if args else None)).step(*args)
                if pipe.is_last:
                    output = full_tensors(output)
                    self.metrics.update(output, batch, self.select)
            return output
