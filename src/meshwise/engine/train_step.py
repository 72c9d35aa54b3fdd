"""``TrainStep``: one optimizer step on this rank's local batch, equal to one process's step on the global batch
(micro-batches, the loss weighted by the global count, global-norm clipping), and the checks of its options, model,
optimizer, loss and labels. The pipeline's step subclasses it (:mod:`meshwise.engine.pipeline_steps`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from ignite.engine import Engine
from torch import nn

from meshwise.causal_lm import IGNORE_INDEX, SHIFT_LABELS_KEY, Batch, labels_unshifted, loss_input, target_of
from meshwise.debug import guarded
from meshwise.debug.replicas import check_replicas, needs_check
from meshwise.engine.batch import local_value, ready_batch, row_count, split_rows, take_rows
from meshwise.engine.ignite_engine import check_model
from meshwise.errors import MeshwiseError
from meshwise.parallel.clipping import clip_coefficient, grads_of, local_norm_contribution, norm_from_power, scale_grads
from meshwise.parallel.data_parallel import reshard
from meshwise.parallel.precision import check_trainer_precision, precision_of
from meshwise.topology import Topology, resolve

__all__ = ["LABEL_CHECK_STEPS", "LossWeight", "TrainStep", "call_loss", "check_scalar_loss"]


LossWeight = str | Callable[[Batch], int | float | torch.Tensor]

LABEL_CHECK_STEPS = 3
"""Steps whose batches are checked for ``labels = input_ids`` under ``"labels"``, until one decides."""

_WEIGHTS = ("samples", "tokens", "labels")


def _check_options(
    model: Any,
    optimizer: Any,
    accumulation_steps: Any,
    micro_batch_size: Any,
    grad_clip: Any,
    loss_weight: Any,
    target_key: Any,
) -> None:
    if not isinstance(model, nn.Module):
        raise MeshwiseError(f"create_trainer() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MeshwiseError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise MeshwiseError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    if micro_batch_size is not None:
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise MeshwiseError(f"micro_batch_size must be an int >= 1 or None, got {micro_batch_size!r}")
        if accumulation_steps != 1:
            raise MeshwiseError(
                f"accumulation_steps={accumulation_steps} and micro_batch_size={micro_batch_size} both set the "
                "number of micro-batches: give one (micro_batch_size keeps the global batch on any data size)"
            )
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
        raise MeshwiseError(f"grad_clip must be a positive number or None, got {grad_clip!r}")
    if not (callable(loss_weight) or loss_weight in _WEIGHTS):
        raise MeshwiseError(
            f"loss_weight must be 'samples', 'tokens', 'labels' or a function of the batch, got {loss_weight!r}"
        )
    if loss_weight in ("tokens", "labels") and target_key is None:
        raise MeshwiseError(f"loss_weight={loss_weight!r} counts the elements of batch[target_key]: set target_key")


def _refuse_ignored(target: Any, loss_weight: str) -> None:
    """A -100 target under a weighting that counts it means a silently wrong mean: stop, naming the fix."""
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and bool((target == IGNORE_INDEX).any()):
        unit = "sample" if loss_weight == "samples" else "target element"
        raise MeshwiseError(
            f"batch targets hold ignored labels ({IGNORE_INDEX}) but loss_weight={loss_weight!r} weights each "
            f"micro-batch's mean by its {unit} count, so ranks with more ignored labels would weigh too much: "
            "use loss_weight='labels' (the mean over the non-ignored labels of the whole global batch, as "
            "Hugging Face's num_items_in_batch) with a loss_fn that returns the mean over its non-ignored labels"
        )


def _check_placement(model: nn.Module, topo: Topology) -> None:
    check_model(model, topo)  # also refuses idist.auto_model's DDP over the whole world beside tp/cp dims


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must hold the model's own parameters: refuse tensors it holds that the model does not train.

    The model is resharded first (FSDP2 leaves a forward without backward gathered: docs/torch.md,
    "Checkpoints (DCP)"), so its ``parameters()`` are the sharded ones FSDP2 updates and a checkpoint reads. An
    optimizer built while the gathered copies were registered holds those instead, and its steps never reach the
    model as one process's would (0.10 off after 2 steps in the tests). Any other tensor outside the model would
    miss the trainer's gradient scaling, clipping and data-parallel averaging.
    """
    gathered = {id(p) for p in model.parameters()}
    reshard(model)  # parameters() are now the sharded ones, whatever forward ran before
    own = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in own]
    if not foreign:
        return
    shown = ", ".join(f"{tuple(p.shape)}" for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    what = f"the optimizer holds {len(foreign)} of its {len(held)} tensors that are not the model's parameters"
    if any(id(p) in gathered for p in foreign):  # registered on the model until the reshard just above
        raise MeshwiseError(
            f"{what} (shapes {shown}) but FSDP2's gathered copies of them: a forward ran without a backward before "
            "the optimizer was made (a no-grad probe, an evaluation), which leaves FSDP2's unsharded parameters "
            "registered on the model, and the optimizer was built on those instead of the sharded parameters "
            "FSDP2 trains, so training would be silently wrong. Build the optimizer right after "
            "meshwise.parallelize() / load_hf(), before any forward, or call meshwise.parallel.reshard(model) "
            "before building it (the model is resharded now: building it again from model.parameters() works)"
        )
    raise MeshwiseError(
        f"{what} (shapes {shown}): the trainer scales, clips and averages over data ranks only the model's "
        "gradients, so those would train unlike one process. Build the optimizer from model.parameters() after "
        "meshwise.parallelize() (which replaces the parameters it shards) and before any forward (under FSDP2 a "
        "forward without a backward leaves gathered copies registered until meshwise.parallel.reshard(model)); "
        "make any other trained tensor a parameter of the model (a submodule) before parallelize()"
    )


def call_loss(loss_fn: Callable[..., torch.Tensor], output: Any, target: Any) -> torch.Tensor:
    """``loss_fn(output, target)``, with an error that says what ``loss_fn`` gets when it reads ``output.loss``."""
    try:
        return loss_fn(output, target)
    except AttributeError as exc:
        if not isinstance(output, torch.Tensor) or getattr(exc, "obj", None) is not output:
            raise
        raise MeshwiseError(
            f"loss_fn read output.{exc.name}, but it receives the model's output as a tensor: a transformers "
            "ModelOutput reaches loss_fn as its logits, never whole, and never its .loss, which is a mean over "
            "labels shifted inside one micro-batch that the trainer cannot weigh into the global batch's mean. "
            "Write loss_fn(logits, target) returning the micro-batch's mean over what loss_weight counts, e.g. "
            "F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100) with "
            "loss_weight='labels' and shifted targets (prepare=meshwise.engine.shift_labels for "
            "labels = input_ids); docs/hf.md, 'Loss'"
        ) from exc


def check_scalar_loss(loss: Any) -> None:
    """``loss_fn`` must return the batch's mean as a scalar tensor: meshwise weights it by the count itself."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise MeshwiseError(
            f"loss_fn returned {shape}, not a scalar tensor: return the mean over the batch "
            "(e.g. reduction='mean'); meshwise weights it by the sample or token count itself"
        )
    from torch.distributed.tensor import DTensor

    if hasattr(loss, "placements") and not isinstance(loss, DTensor):  # e.g. PhysicsNeMo's ShardTensor
        raise MeshwiseError(
            f"loss_fn returned a {type(loss).__name__} (a value the split ranks share), but the trainer weighs each "
            "rank's own mean by its own count: compute the loss on this rank's tile, e.g. forward= returning "
            "model(shard_tensor).to_local() and loss_fn=F.mse_loss on the loader's target tile (docs/physicsnemo.md)"
        )


class TrainStep:
    """One optimizer step on this rank's local batch, equal to one process's step on the global batch.

    Call it as ignite's process function (``Engine(TrainStep(...))``, which :func:`create_trainer` does):
    ``step(engine, batch)`` returns the global mean loss and puts ``loss_count`` (and ``grad_norm``, when
    clipping) in ``engine.state``; :meth:`train` does the same work without an engine. The options are
    those of :func:`create_trainer`. State kept between steps: ``reference``, the previous step's global
    count, by which backward scales the loss (see :meth:`train`); ``loss_count`` and ``grad_norm``, the last
    step's global count and global gradient norm (None before the first step or without clipping).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        topology: Topology | None = None,
        *,
        grad_clip: float | None = None,
        norm_type: float = 2.0,
        accumulation_steps: int = 1,
        micro_batch_size: int | None = None,
        loss_weight: LossWeight = "samples",
        prepare: Callable[[Batch], Batch] | None = None,
        forward: Callable[[nn.Module, Batch], Any] | None = None,
        step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        input_key: str = "input",
        target_key: str | None = "target",
    ) -> None:
        topo = resolve(topology)
        _check_options(model, optimizer, accumulation_steps, micro_batch_size, grad_clip, loss_weight, target_key)
        _check_placement(model, topo)
        _check_optimizer(model, optimizer)
        self.model, self.optimizer, self.loss_fn, self.topology = model, optimizer, loss_fn, topo
        self.max_norm = None if grad_clip is None else float(grad_clip)
        self.norm_type = norm_type
        self.accumulation_steps, self.micro_batch_size = accumulation_steps, micro_batch_size
        self.loss_weight = loss_weight
        self.prepare = prepare
        self.forward = forward or (lambda m, b: m(b[input_key]))
        self.step_context = step_context or contextlib.nullcontext
        self.input_key, self.target_key = input_key, target_key
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.data_parallel = topo.size(topo.metric_dims)
        self.metric_group = topo.group(topo.metric_dims) if self.data_parallel > 1 else None
        # The fused reduction for clipping runs over the world; count and loss are identical on the replica ranks.
        self.replica_copies = topo.world_size // self.data_parallel
        self.no_sync = (accumulation_steps > 1 or micro_batch_size is not None) and hasattr(
            model, "set_requires_gradient_sync"
        )
        self.reference = 1.0
        # parallelize(precision=...)'s policy: autocast for the forward, and for fp16 a loss scaler (docs/precision.md)
        self.precision = precision_of(model)
        check_trainer_precision(model, self.precision)
        self.scaler = self.precision.scaler()
        self.replicas_checked = not needs_check(topo)  # the first step compares batches (every step in debug)
        self.loss_count: float | None = None
        self.grad_norm: float | None = None
        # the first steps under "labels" look for labels = input_ids (docs/hf.md, "Loss")
        self.label_checks = LABEL_CHECK_STEPS if loss_weight == "labels" and target_key is not None else 0

    def __call__(self, engine: Engine, batch: Batch) -> float:
        topo = self.topology
        if not self.replicas_checked or topo.debug:
            # One small all-gather: a loader that gives tp (or cp) peers different samples stops here.
            check_replicas(topo, batch, engine.state.iteration)
            self.replicas_checked = True
        # Every rank takes part in some collective of a step (FSDP, TP, the loss reduction): if one fails, the
        # error names the step and the ranks that never started it, e.g. one that left its loop early.
        with guarded(topo, topo.dims, "trainer step", step=engine.state.iteration, region=True):
            loss = self.train(batch)
        engine.state.loss_count = self.loss_count
        if self.max_norm is not None and self.grad_norm is not None:
            engine.state.grad_norm = self.grad_norm
        if self.scaler is not None:
            engine.state.skipped_steps, engine.state.loss_scale = self.scaler.skipped, self.scaler.scale
        return loss

    def parts_of(self, rows: int) -> int:
        """How many micro-batches a local batch of ``rows`` runs as: ``accumulation_steps``, or with
        ``micro_batch_size`` as many as keep each at most that size (more when the data size shrinks)."""
        if self.micro_batch_size is None:
            return self.accumulation_steps
        return max(1, -(-rows // self.micro_batch_size))

    def count_of(self, micro: Batch) -> float:
        """How many units (samples, tokens, non-ignored labels, or the user's count) ``micro``'s mean loss is over."""
        if self.loss_weight in ("samples", "tokens") and self.target_key is not None:
            _refuse_ignored(micro.get(self.target_key), self.loss_weight)
        if self.loss_weight == "samples":
            return float(row_count(micro, self.input_key))
        if self.loss_weight == "tokens":
            return float(micro[self.target_key].numel())
        if self.loss_weight == "labels":
            return float((micro[self.target_key] != IGNORE_INDEX).sum())
        value = self.loss_weight(micro)
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def train(self, batch: Batch) -> float:
        """One step on ``batch``; the global mean loss (``nan``, and no step, if the global batch had no valid row).

        Backward runs on ``loss * count * data_parallel / reference``: gradients arrive scaled by
        (global count / reference), fixed afterwards in the same pass as clipping. The reference is the
        previous step's global count (the same on every rank), so for steady batches no pass is needed.
        Under ``loss_weight="labels"`` counts change every step, and a factor that is no power of two makes
        float32 parts of a float64 model (Hugging Face's RMSNorm) round unlike one process (3.7e-7 after 4
        steps): there the step's own global count comes first, in one scalar all-reduce over the data ranks.
        """
        if not self.model.training:
            self.model.train()
        batch = ready_batch(batch, self.prepare, self.topology.device, "trainer")
        if self.target_key is not None and isinstance(batch.get(SHIFT_LABELS_KEY), torch.Tensor):
            batch = {**batch, self.target_key: target_of(batch, self.target_key)}
        if self.label_checks:
            self.check_labels(batch)
        if self.counts_first():  # scale backward by this step's own global count
            count = self._global_count(batch)
            if count > 0:
                self.reference = count
        elif self.scaler is not None and self.loss_count is None:  # a first reference near the global count
            self.reference = max(1.0, self.count_of(batch) * self.data_parallel)
        rows = row_count(batch, self.input_key)
        micros = split_rows(batch, rows, self.parts_of(rows))
        self.optimizer.zero_grad(set_to_none=True)
        local_count, loss_sum = 0.0, None
        for j, micro in enumerate(micros):
            count, weighted = self.backward(micro, last=j == len(micros) - 1)
            if count:
                local_count += count
                loss_sum = weighted if loss_sum is None else loss_sum + weighted
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.topology.device)
        grads = grads_of(self.params)  # plain shards marked as such (Megatron's tensor-parallel weights)
        count, loss_total, norm_power = self.reduce(local_count, loss_sum, grads)
        if count <= 0:
            self.loss_count = 0.0
            return math.nan
        factor = self.reference / count
        if self.scaler is not None:  # norm_power is the world's: every rank skips the same steps
            factor /= self.scaler.scale
            if not self.scaler.update(norm_power is not None and math.isfinite(norm_power)):
                self.optimizer.zero_grad(set_to_none=True)
                self.reference, self.loss_count = count, count
                return loss_total / count
        if self.max_norm is not None:
            self.grad_norm = norm_from_power(norm_power, self.norm_type) * factor
            factor *= clip_coefficient(self.grad_norm, self.max_norm)
        scale_grads(grads, factor)
        self.reference = count
        self.optimizer.step()
        self.loss_count = count
        return loss_total / count

    def check_labels(self, batch: Batch) -> None:
        """Refuse targets that are the inputs (``labels = input_ids``) under ``"labels"``, on every rank alike.

        Each rank judges its own batch (:func:`~meshwise.engine.batch.labels_unshifted`; a pipeline stage
        without both inputs and targets abstains) and one small world all-reduce adds the verdicts, so every
        rank raises or none does. Checking stops at the first step any rank could decide, or after
        ``LABEL_CHECK_STEPS`` steps.
        """
        topo = self.topology
        verdict = labels_unshifted(batch, self.input_key, self.target_key)
        flags = torch.tensor([float(verdict is True), float(verdict is not None)], dtype=torch.float64)
        if topo.world_size > 1:
            flags = flags.to(topo.device)
            dist.all_reduce(flags)
        unshifted, decided = flags.tolist()
        self.label_checks = 0 if decided else self.label_checks - 1
        if unshifted:
            key = self.target_key
            inp = self.input_key if isinstance(batch.get(self.input_key), torch.Tensor) else "input_ids"
            raise MeshwiseError(
                f"loss_weight='labels' counts batch[{key!r}] as labels aligned with the logits (label t scores "
                f"the logit of token t, i.e. the next token), but batch[{key!r}] equals batch[{inp!r}] at every "
                "scored position: the causal-LM habit labels = input_ids, with a loss_fn that shifts inside. "
                "The trainer would then count one label a row that the loss never scores (and under context "
                "parallel the shift would pair tokens across ranks), training silently unlike one process. "
                "Shift the labels on the batch and drop the shift from loss_fn: create_trainer(..., "
                f"prepare=meshwise.engine.shift_labels) (functools.partial(shift_labels, key={key!r}) for "
                "another key name), or a 'shift_labels' batch field as transformers makes it, with "
                "loss_fn=lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten(), "
                "ignore_index=-100). If the targets really are the inputs (an autoencoder), count them with "
                f"loss_weight=lambda b: (b[{key!r}] != -100).sum() instead"
            )

    def counts_first(self) -> bool:
        """Whether a step counts its global batch before backward: under ``"labels"``, whose counts vary."""
        return self.loss_weight == "labels"

    def _global_count(self, batch: Batch) -> float:
        """This step's global count (valid rows only), summed over the data ranks in one scalar all-reduce."""
        rows = row_count(batch, self.input_key)
        valid = batch.get("valid")
        if isinstance(valid, torch.Tensor) and not bool(valid.all()):
            batch = take_rows(batch, rows, valid) if bool(valid.any()) else {}
        local = self.count_of(batch) if batch and rows else 0.0
        if self.metric_group is None:
            return local
        vec = torch.tensor([local], dtype=torch.float64, device=self.topology.device)
        dist.all_reduce(vec, group=self.metric_group)
        return float(vec.item())

    def backward(self, micro: Batch, last: bool) -> tuple[float, torch.Tensor | None]:
        """Forward and backward of one micro-batch; its count and ``count * loss`` (float64), or ``(0, None)``."""
        n = row_count(micro, self.input_key)
        valid = micro.get("valid")
        empty = False
        if isinstance(valid, torch.Tensor) and not bool(valid.all()):
            if bool(valid.any()):
                micro = take_rows(micro, n, valid)
            else:  # every rank must still run forward/backward (collectives inside); weight 0
                micro, empty = take_rows(micro, n, slice(0, 1)), True
        count = 0.0 if empty else self.count_of(micro)
        if not count and self.loss_weight == "labels":
            # A mean over no labels is 0/0: NaN gradients even at weight 0. Label class 0 keeps the loss finite;
            # the weight stays 0, yet the forward and backward (and their collectives) still run on every rank.
            micro = {**micro, self.target_key: torch.zeros_like(micro[self.target_key])}
        if self.no_sync:
            self.model.set_requires_gradient_sync(last)
        with self.step_context():
            with self.precision.autocast():
                output = loss_input(self.forward(self.model, micro))
            loss = call_loss(self.loss_fn, output, micro if self.target_key is None else micro[self.target_key])
            check_scalar_loss(loss)
            scale = count * self.data_parallel / self.reference * (self.scaler.scale if self.scaler else 1.0)
            (loss if scale == 1.0 else loss * scale).backward()
        if not count:
            return 0.0, None
        return count, local_value(loss).double() * count

    def reduce(
        self, local_count: float, loss_sum: torch.Tensor, grads: list[torch.Tensor]
    ) -> tuple[float, float, float | None]:
        """Global count, global ``Σ count·loss`` and (when clipping) the global norm's power-sum, in one reduction.

        With clipping the three travel in one world all-reduce, each divided by its number of identical
        copies (:func:`~meshwise.parallel.clipping.local_norm_contribution`); ``norm_type=inf`` needs a MAX.
        """
        topo, norm_type = self.topology, self.norm_type
        norm_power = None
        wants_norm = self.max_norm is not None or self.scaler is not None  # the scaler's inf/nan check rides on it
        if wants_norm and not math.isinf(norm_type):
            norm_part = local_norm_contribution(grads, topo, norm_type)
            copies = self.replica_copies
            vec = torch.stack([loss_sum.new_tensor(local_count) / copies, loss_sum / copies, norm_part])
            if topo.world_size > 1:
                dist.all_reduce(vec)
            count, loss_total, norm_power = vec.tolist()
            return count, loss_total, norm_power
        if self.metric_group is not None:
            vec = torch.stack([loss_sum.new_tensor(local_count), loss_sum])
            dist.all_reduce(vec, group=self.metric_group)
            count, loss_total = vec.tolist()
        else:
            count, loss_total = local_count, loss_sum.item()
        if wants_norm:
            peak = local_norm_contribution(grads, topo, norm_type)
            if topo.world_size > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            norm_power = peak.item()
        return count, loss_total, norm_power
