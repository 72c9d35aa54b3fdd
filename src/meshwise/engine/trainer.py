"""``create_trainer``: an ignite Engine whose step (a :class:`TrainStep`) trains a model placed on the topology
like one process would."""

from __future__ import annotations

import importlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn

from meshwise.causal_lm import IGNORE_INDEX
from meshwise.dryrun import note_trainer
from meshwise.engine import stop
from meshwise.engine.attach_checks import check_on_attach
from meshwise.engine.ignite_engine import run_ignite_checks
from meshwise.engine.observe import Observer
from meshwise.engine.pipeline_steps import PipelineTrainStep
from meshwise.engine.train_step import LossWeight, TrainStep, call_loss
from meshwise.topology import Topology, resolve

__all__ = ["IGNORE_INDEX", "LossWeight", "MeshEngine", "TrainStep", "call_loss", "create_trainer"]


REFERENCE_KEY = "meshwise_reference"


class MeshEngine(Engine):
    """ignite's ``Engine`` that also resumes a run saved mid-way through its first pass over a stream.

    Its state also carries the step's ``reference``: without it a resumed step scales its backward by another
    number than the unbroken run's, equal in exact arithmetic but not in floating point (AdamW showed 3e-9).

    ignite learns a stream's ``epoch_length`` only when the first pass ends, so a state saved before that has
    ``epoch_length=None``, which ``Engine.load_state_dict`` refuses (it derives the epoch from it). That state
    is the first epoch at ``iteration``: this engine restores it as such, and ``run()`` counts the epoch on
    from there, learning the epoch's length when the resumed loader's pass ends, as an unbroken run does.
    """

    def state_dict(self) -> OrderedDict:
        """ignite's state, plus the step's ``reference`` (the last global count): a resume scales backward alike."""
        state = super().state_dict()
        reference = getattr(self._process_function, "reference", None)
        if isinstance(reference, float):
            state[REFERENCE_KEY] = reference
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state_dict = dict(state_dict)
        reference = state_dict.pop(REFERENCE_KEY, None)
        if reference is not None and hasattr(self._process_function, "reference"):
            self._process_function.reference = float(reference)
        done = state_dict.get("iteration")
        first_pass = state_dict.get("epoch_length") is None and "epoch" not in state_dict
        if not (first_pass and isinstance(done, int) and done > 0):
            super().load_state_dict(state_dict)
            return
        super().load_state_dict({**state_dict, "iteration": 0})
        self.state.iteration, self.state.epoch = done, 0

    def run(self, data: Any = None, max_epochs: int | None = None, max_iters: int | None = None, **kw: Any) -> Any:
        """ignite's ``run``; a run stopped inside an epoch and run again goes on in that epoch, as its resume would.

        ignite counts a new epoch from batch 0 there (for a list it restarts it), while meshwise's loaders go on
        from their position: a stream's length would be learnt short and later epochs cut there.
        """
        s = self.state
        if max_iters is not None and None not in (s.max_iters, s.max_epochs, s.epoch_length):
            s.max_epochs = None  # ignite set it from a stream's learnt length; its max_iters mode check would refuse
        more_iters, more_epochs = max_iters or s.max_iters, max_epochs or s.max_epochs
        going_on = not (
            (more_iters is not None and s.iteration >= more_iters)
            or (more_epochs is not None and s.epoch >= more_epochs)
            or (None not in (more_epochs, s.epoch_length) and s.iteration >= more_epochs * s.epoch_length)
        )
        inside = s.iteration > 0 and s.epoch > 0 and (s.epoch_length is None or s.iteration % s.epoch_length)
        if self.should_terminate and going_on and inside:
            # ignite adds an epoch as it starts; its first batch count then comes from the iteration, as on a resume
            s.epoch -= 1
            self.should_terminate = False
        return super().run(data, max_epochs=max_epochs, max_iters=max_iters, **kw)


def create_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    topology: Topology | None = None,
    *,
    observe: bool = True,
    **options: Any,
) -> Engine:
    """An ignite ``Engine`` whose step trains ``model`` on one local batch per iteration, like one process would.

    ``options`` are :class:`TrainStep`'s keyword options, with its defaults: ``grad_clip=None``,
    ``norm_type=2.0``, ``accumulation_steps=1``, ``micro_batch_size=None``, ``loss_weight="samples"``, ``prepare=None``,
    ``forward=None``, ``step_context=None``, ``input_key="input"``, ``target_key="target"``; an unknown one
    raises ``TypeError``.

    Each iteration takes this rank's batch (a dict; ``valid`` False rows are excluded), applies
    ``prepare(batch)``, splits it into ``accumulation_steps`` micro-batches (or, with ``micro_batch_size``, into as
    many as keep each at most that size: the global batch stays the loader's on any data size, so a run that
    restarts on fewer ranks accumulates more; docs/cluster.md, "Elastic runs"), and for each runs
    ``output = forward(model, micro)`` (default ``model(micro[input_key])``) and
    ``loss = loss_fn(output, micro[target_key])`` (``loss_fn(output, micro)`` when ``target_key`` is None),
    inside ``step_context()`` if given (e.g. ``torch.distributed.tensor.parallel.loss_parallel``), then
    backward. A transformers ``ModelOutput`` reaches ``loss_fn`` as its ``logits``. ``loss_fn`` must return
    the mean over the units that ``loss_weight`` counts: ``"samples"`` (rows), ``"tokens"`` (elements of
    the target), ``"labels"`` (target elements other than ``IGNORE_INDEX`` (-100), Hugging Face's
    ``num_items_in_batch``: targets must already be aligned with the logits, i.e. shifted) or
    ``callable(micro) -> count``. ``"samples"``/``"tokens"`` refuse targets holding -100 (MeshwiseError).
    A batch field ``shift_labels`` (transformers' already shifted labels) is used as the target. Under
    ``"labels"`` the first steps refuse targets equal to the inputs (``labels = input_ids`` with a ``loss_fn``
    that shifts inside): ``prepare=meshwise.engine.shift_labels`` shifts them on the batch instead. The
    optimizer must hold the model's own parameters (after :func:`~meshwise.parallel.reshard`, which this
    calls): one built on FSDP2's gathered copies, after a forward without backward, is refused.
    Gradients are those of the mean over the *global* batch; with ``grad_clip`` they are clipped by
    their global norm (``norm_type``) across every mesh. Nothing is moved except to ``topology.device``.

    After each iteration, the same on every rank:

    - ``engine.state.output``: the global mean loss as a float (``nan`` if the global batch had no valid
      row: the step is then skipped);
    - ``engine.state.loss_count``: the global count the loss is the mean over (0.0 for a skipped step);
    - ``engine.state.grad_norm``: with ``grad_clip``, the global gradient norm before clipping.

    The step is a :class:`TrainStep`; build ``MeshEngine(TrainStep(...))`` yourself to keep a reference to it.
    The engine is a :class:`MeshEngine`: a state saved mid-way through the first pass over a stream (whose
    ``epoch_length`` ignite does not know yet) resumes with a plain ``trainer.run(loader, max_epochs=...)``.
    With ``observe`` (the default) an :class:`~meshwise.engine.observe.Observer` fills ``engine.state.observed``
    (learning rate, step time, samples/s, tokens/s, peak memory, bytes read, an MFU estimate: docs/training.md).
    """
    if "deepspeed" in sys.modules:  # a DeepSpeed engine steps itself: its integration names the road instead
        importlib.import_module("meshwise.deepspeed").refuse_trainer(model, optimizer)
    step_class = TrainStep
    if resolve(topology).size(resolve(topology).stage_dims) > 1:  # the stages run a schedule (docs/pipeline.md)
        step_class = PipelineTrainStep
    step = step_class(model, optimizer, loss_fn, topology, **options)
    engine = MeshEngine(step)  # an Engine that also resumes mid-way through a stream's first pass
    # ignite's own metrics and checkpoint handlers attached to it, and its loader's sampler, checked at each run
    engine.add_event_handler(Events.STARTED, run_ignite_checks, step.topology)
    if observe:  # rate, lr, memory, MFU for ProgressBar/RunLogger: no collective after the first step
        Observer(step.topology, optimizer=optimizer, input_key=step.input_key).attach(engine)
    check_on_attach(engine, step.topology)  # ignite loggers leader-only, a DiskSaver of shards refused when attached
    note_trainer(engine, optimizer)  # a dry run records its steps and stops it after a few (meshwise.dryrun)
    stop.attach(engine)  # SIGINT/SIGTERM: every rank stops at one agreed step, a checkpoint first (engine/stop.py)
    return engine
