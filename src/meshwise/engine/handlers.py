"""Rank-aware ignite handlers for a training run: checkpoints saved and resumed, one progress bar (global
rank 0), periodic evaluation with its history, and a time budget every rank stops at together."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events

from meshwise.checkpoint import Checkpointer
from meshwise.checkpoint.objects import classify
from meshwise.debug import guarded, interrupt
from meshwise.engine import stop
from meshwise.engine.worlds import WorldHistory
from meshwise.errors import CheckpointError, MeshwiseError
from meshwise.topology import Topology, resolve

__all__ = ["Checkpointing", "EngineState", "PeriodicEvaluation", "ProgressBar", "TimeBudget", "scalar"]

log = logging.getLogger(__name__)


def scalar(value: Any) -> float | None:
    """``value`` as a float when it is a number or a one-element tensor, else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().reshape(()).item())
    return None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshwiseError(f"{name} must be a positive int, got {value!r}")
    return value


def _run_end(state: Any) -> int | None:
    """The iteration at which the engine's run stops (``max_iters``, or ``max_epochs`` × ``epoch_length``)."""
    if state.max_iters is not None:
        return int(state.max_iters)
    if state.max_epochs is not None and state.epoch_length is not None:
        return int(state.max_epochs * state.epoch_length)
    return None


class ProgressBar:
    """One tqdm bar for a run, drawn by global rank 0 only (a 4-process run draws one bar, not four).

    ``total`` is the number of iterations this run will do (e.g. ``max_iters - start``); by default it is
    what is left of the run at its first iteration (a resumed run counts only what remains). The bar shows
    the epoch (``epoch 2/3``), ``engine.state.output`` as ``output_name``, the learning rate, the rate
    (``samples/s``, and ``tok/s`` for token-id inputs, averaged over recent steps) and this rank's peak memory
    from the engine's :class:`~meshwise.engine.observe.Observer` (``create_trainer`` attaches one; on another
    engine the bar attaches one without the FLOP count), and, with ``attach(..., evaluators={"val":
    evaluator})``, each evaluator's latest metrics as ``val_<name>``. ``tqdm_kwargs`` go to tqdm (``desc=``,
    ``file=``, ``ncols=``, ...). On other ranks :meth:`attach` adds nothing; ``enabled`` tells which.
    """

    BAR_FORMAT = "{desc}[{n_fmt}/{total_fmt}] {percentage:3.0f}%|{bar}|{postfix} [{elapsed}<{remaining}]"

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        total: int | None = None,
        output_name: str = "loss",
        **tqdm_kwargs: Any,
    ) -> None:
        self.topology = resolve(topology)
        self.total = None if total is None else _positive_int("total", total)
        if not isinstance(output_name, str) or not output_name:
            raise MeshwiseError(f"output_name must be a non-empty string, got {output_name!r}")
        self.output_name = output_name
        self.tqdm_kwargs = {"bar_format": self.BAR_FORMAT, **tqdm_kwargs}
        self.enabled = self.topology.rank == 0
        self.evaluators: dict[str, Engine] = {}
        self.bar: Any = None
        self.observer: Any = None
        self._epoch: int | None = None

    def attach(self, engine: Engine, evaluators: Mapping[str, Engine] | None = None) -> ProgressBar:
        """Draw the bar over ``engine``'s iterations (rank 0 only); show ``evaluators``' metrics by their tag."""
        self.evaluators = dict(evaluators or {})
        if self.enabled:
            from meshwise.engine.observe import observe

            self.observer = observe(engine, self.topology, collectives=False)  # attached on rank 0 only
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._update)
            engine.add_event_handler(Events.COMPLETED, lambda _: self.close())
        return self

    def _open(self, engine: Engine) -> None:
        from tqdm.auto import tqdm

        total = self.total
        if total is None:
            end = _run_end(engine.state)
            # this is the first iteration's handler: the run started one iteration ago
            total = None if end is None else end - engine.state.iteration + 1
        self.bar = tqdm(total=total, **self.tqdm_kwargs)

    def postfix(self, engine: Engine) -> dict[str, Any]:
        """What the bar shows after the numbers: the loss, lr, rates and memory, then each evaluator's metrics."""
        shown: dict[str, Any] = {}
        loss = scalar(engine.state.output)
        if loss is not None:
            shown[self.output_name] = loss
        observed = self.observer.values if self.observer is not None else {}
        rates = self.observer.smoothed if self.observer is not None else {}
        if "lr" in observed:
            shown["lr"] = f"{observed['lr']:.3g}"
        if "samples_per_s" in rates:
            shown["samples/s"] = f"{rates['samples_per_s']:.4g}"
        if "tokens_per_s" in rates:
            shown["tok/s"] = f"{rates['tokens_per_s']:.4g}"
        if "mfu" in rates:
            shown["mfu"] = f"{rates['mfu']:.1%}"
        if "peak_mem_mb" in observed:
            shown["mem"] = f"{observed['peak_mem_mb']:.0f}MB"
        for tag, evaluator in self.evaluators.items():
            for name, value in evaluator.state.metrics.items():
                number = scalar(value)
                if number is not None:
                    shown[f"{tag}_{name}"] = number
        return shown

    def _update(self, engine: Engine) -> None:
        if self.bar is None:
            self._open(engine)
        epoch, most = engine.state.epoch, engine.state.max_epochs
        if epoch != self._epoch and "desc" not in self.tqdm_kwargs:
            self._epoch = epoch
            self.bar.set_description(f"epoch {epoch}/{most} " if most else f"epoch {epoch} ", refresh=False)
        self.bar.set_postfix(self.postfix(engine), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PeriodicEvaluation:
    """Run an evaluator on ``loader`` every ``every`` trainer iterations, keeping the history of its metrics.

    Evaluations happen at ``ITERATION_COMPLETED`` when the trainer's iteration is a multiple of ``every``,
    with ``at_start`` also at ``STARTED`` (attach it after a :class:`Checkpointing` that resumes, so that
    it evaluates the resumed model) and with ``at_end`` also at ``COMPLETED`` unless the last iteration was
    just evaluated. ``latest`` is the last evaluation's metrics (None before the first); ``history`` is a list
    of ``{"iteration": i, "epoch": e, "metrics": {...}}``, saved by ``state_dict`` so that a resumed run
    continues it. Every rank must take part: the evaluator's metrics sync over the mesh.
    """

    def __init__(
        self,
        evaluator: Engine,
        loader: Any,
        *,
        every: int,
        at_start: bool = False,
        at_end: bool = True,
    ) -> None:
        if not isinstance(evaluator, Engine):
            raise MeshwiseError(
                f"PeriodicEvaluation needs an ignite Engine (meshwise.create_evaluator), got {type(evaluator).__name__}"
            )
        if loader is None:
            raise MeshwiseError("PeriodicEvaluation needs a loader to evaluate on: mesh_dataloader(..., mode='eval')")
        self.evaluator, self.loader = evaluator, loader
        self.every = _positive_int("every", every)
        self.at_start, self.at_end = bool(at_start), bool(at_end)
        self.history: list[dict[str, Any]] = []
        self._evaluated_at: int | None = None  # trainer iteration of the last evaluation of this process

    @property
    def latest(self) -> dict[str, Any] | None:
        """The metrics of the last evaluation, or None before the first."""
        return self.history[-1]["metrics"] if self.history else None

    def attach(self, trainer: Engine) -> PeriodicEvaluation:
        if self.at_start:
            trainer.add_event_handler(Events.STARTED, self.evaluate)
        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=self.every), self.evaluate)
        if self.at_end:
            trainer.add_event_handler(Events.COMPLETED, self._evaluate_at_end)
        return self

    def evaluate(self, trainer: Engine) -> dict[str, Any]:
        """Run the evaluator now and record its metrics at the trainer's iteration; returns them."""
        self.evaluator.run(self.loader)
        metrics = dict(self.evaluator.state.metrics)
        self.history.append({"iteration": trainer.state.iteration, "epoch": trainer.state.epoch, "metrics": metrics})
        self._evaluated_at = trainer.state.iteration
        return metrics

    def _evaluate_at_end(self, trainer: Engine) -> None:
        if self._evaluated_at != trainer.state.iteration:
            self.evaluate(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(h, metrics=dict(h["metrics"])) for h in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        history = state.get("history")
        if not isinstance(history, list):
            raise MeshwiseError(f"PeriodicEvaluation state needs a 'history' list, got {type(history).__name__}")
        self.history = [dict(h) for h in history]


class TimeBudget:
    """Stop a run once ``seconds`` have passed since ``STARTED``, at the same iteration on every rank.

    ignite's own ``TimeLimit`` reads each rank's clock, so ranks could stop at different iterations and the
    others would wait in the next step's collectives. Here every ``check_every`` iterations (counted from
    the start of this run) the ranks take the largest elapsed time with one all-reduce over the world.
    The clock starts when this handler's ``STARTED`` runs: attach it after handlers whose ``STARTED`` work
    (an initial evaluation, a resume) should not count.
    """

    def __init__(self, seconds: float, topology: Topology | None = None, *, check_every: int = 5) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise MeshwiseError(f"TimeBudget needs a positive number of seconds, got {seconds!r}")
        self.seconds = float(seconds)
        self.topology = resolve(topology)
        self.check_every = _positive_int("check_every", check_every)
        self.started = math.nan
        self.iterations = 0

    def attach(self, engine: Engine) -> TimeBudget:
        engine.add_event_handler(Events.STARTED, self._start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._check)
        return self

    def _start(self, _: Engine) -> None:
        self.started, self.iterations = time.perf_counter(), 0

    def elapsed(self) -> float:
        """The largest time since ``STARTED`` over every rank (a collective: every rank must call it)."""
        topo = self.topology
        value = torch.tensor([time.perf_counter() - self.started], dtype=torch.float64, device=topo.device)
        if topo.world_size > 1:
            with guarded(topo, topo.dims, "time budget"):
                dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def _check(self, engine: Engine) -> None:
        self.iterations += 1
        if self.iterations % self.check_every == 0 and self.elapsed() > self.seconds:
            engine.terminate()


def _limit_text(state: Any) -> str:
    return f"max_iters={state.max_iters}" if state.max_iters is not None else f"max_epochs={state.max_epochs}"


class EngineState:
    """An ignite engine as a checkpoint object whose load keeps *this* run's end (``max_epochs``/``max_iters``).

    ``state_dict()`` is the engine's. ``load_state_dict(sd)`` restores the iteration, refusing a checkpoint
    taken with another ``epoch_length`` or past this run's end, and keeps the ``max_epochs``/``max_iters``
    given to ``run``, so a resumed run stops where this invocation says.
    """

    def __init__(self, engine: Engine) -> None:
        if not isinstance(engine, Engine):
            raise CheckpointError(f"EngineState wraps an ignite Engine, got {type(engine).__name__}")
        self.engine = engine

    @property
    def state(self) -> Any:
        """The engine's ``state``: a ``Checkpointer(score="name")`` finds ``state.metrics["name"]`` through it."""
        return self.engine.state

    def state_dict(self) -> dict[str, Any]:
        return dict(self.engine.state_dict())

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.engine.load_state_dict(self.resume_state(sd))

    def resume_state(self, sd: Mapping[str, Any]) -> dict[str, Any]:
        """The saved engine state with this run's termination (max_epochs / max_iters) in place of the saved one."""
        sd, state = dict(sd), self.engine.state
        done = sd.get("iteration", 0)
        if state.epoch_length is not None and sd.get("epoch_length") not in (None, state.epoch_length):
            raise CheckpointError(
                f"the checkpoint at iteration {done} has {sd['epoch_length']} iterations per epoch but this run "
                f"has {state.epoch_length}: resume with the same global batch size and dataset"
            )
        sd.pop("max_epochs", None)
        sd.pop("max_iters", None)
        if state.max_iters is not None:
            sd["max_iters"] = state.max_iters
        else:
            sd["max_epochs"] = state.max_epochs
        if state.max_iters is not None and done > state.max_iters:
            raise CheckpointError(
                f"the checkpoint is at iteration {done}, past this run's max_iters={state.max_iters}: raise max_iters"
            )
        if state.max_epochs is not None and sd.get("epoch_length") and done > state.max_epochs * sd["epoch_length"]:
            raise CheckpointError(
                f"the checkpoint is at iteration {done} (epoch {done // sd['epoch_length']}), past this run's "
                f"max_epochs={state.max_epochs}: raise max_epochs to continue"
            )
        return sd


class Checkpointing:
    """Save a run's objects every N iterations and/or epochs, and resume from ``latest`` when the run starts.

    ``objects`` (model, optimizer, loader, scheduler, ...) go to ``checkpointer.save(step, **objects)``
    with the engine itself as ``"engine"``; the step is ``engine.state.iteration``. With ``resume``, at
    ``Events.STARTED`` of a run that starts at iteration 0 the latest checkpoint (if any) is loaded, RNG
    states included, with the engine wrapped in :class:`EngineState` so this run keeps its own
    ``max_epochs``/``max_iters``; pass the loader so it continues from its cursor. A checkpoint that already
    completes the run is said so (INFO on rank 0) and the run ends without an iteration;
    ``engine.state.output`` then stays None. At ``COMPLETED`` a pending async save is waited for.
    ``resumed`` is the :class:`~meshwise.checkpoint.CheckpointInfo` of the load, or None.

    Every start of a run in the checkpoint folder adds a line to its ``worlds.jsonl`` (world size, mesh, nodes,
    the step resumed from, the steps lost since the last world's last step); a start after another, such as an
    elastic restart on fewer nodes, says so in one warning (:class:`~meshwise.engine.worlds.WorldHistory`;
    ``meshwise report`` shows the history).

    A run stopped by SIGINT or SIGTERM (Ctrl-C, SLURM's pre-kill signal, ``scancel``) stops on every rank after
    the same step; with ``save_on_stop`` (the default) a checkpoint of that step is written and waited for
    before the process exits, so the resume loses no step. Saves are atomic: a save cut short by the final
    kill leaves the previous checkpoint as ``latest``. ``save_on_stop=False`` exits at once, resuming from the
    last periodic save.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        *,
        every_iterations: int | None = None,
        every_epochs: int | None = None,
        resume: bool = True,
        save_on_stop: bool = True,
        **objects: Any,
    ) -> None:
        if not isinstance(checkpointer, Checkpointer):
            raise CheckpointError(
                f"Checkpointing needs a meshwise.Checkpointer, got {type(checkpointer).__name__}: "
                "build one with meshwise.Checkpointer(root, topo)"
            )
        for name, value in (("every_iterations", every_iterations), ("every_epochs", every_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CheckpointError(f"{name} must be a positive int, got {value!r}")
        if every_iterations is None and every_epochs is None and not resume:
            raise CheckpointError("Checkpointing needs every_iterations=, every_epochs= or resume=True")
        classify(objects)  # the checkpointer's own check: fail at set-up, not at the first save
        self.checkpointer = checkpointer
        self.every_iterations, self.every_epochs, self.resume = every_iterations, every_epochs, resume
        self.save_on_stop = bool(save_on_stop)
        self.objects = dict(objects)
        self.resumed: Any = None
        self._started = False
        self.history = WorldHistory(checkpointer.root, checkpointer.topology)

    def attach(self, engine: Engine) -> Checkpointing:
        names = [name for name, obj in self.objects.items() if obj is engine]
        if names:
            self.objects[names[0]] = EngineState(engine)
        elif "engine" in self.objects:
            raise CheckpointError("the name 'engine' is taken by another object: pass the engine as engine=")
        else:
            self.objects["engine"] = EngineState(engine)
        if self.resume:
            engine.add_event_handler(Events.STARTED, self._resume)
        engine.add_event_handler(Events.STARTED, self._record_world)
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: self.history.reached(e.state.iteration))
        if self.every_iterations is not None:
            engine.add_event_handler(Events.ITERATION_COMPLETED(every=self.every_iterations), self._save)
        if self.every_epochs is not None:
            engine.add_event_handler(Events.EPOCH_COMPLETED(every=self.every_epochs), self._save)
        engine.add_event_handler(Events.COMPLETED, lambda _: self.checkpointer.wait())
        engine.add_event_handler(Events.TERMINATE, self._on_stop)
        return self

    def _on_stop(self, engine: Engine) -> None:
        if not stop.stopping(engine):
            return  # terminate() by the user or TimeBudget: COMPLETED follows and waits for the save
        if self.save_on_stop:
            self._save(engine)
        self.checkpointer.wait()
        step = self.checkpointer.latest_step()
        interrupt.note_checkpoint(step, self.checkpointer.root, step == engine.state.iteration)

    def _record_world(self, engine: Engine) -> None:
        if self.history.started:
            return  # another run() in this process: the same world
        if self.history.writes:
            self.checkpointer.folder.make_root()
        self.history.start(None if self.resumed is None else self.resumed.step)

    def _save(self, engine: Engine) -> None:
        if self.checkpointer.last_saved_step != engine.state.iteration:
            self.history.check_owner()  # rank 0: its error ends this world's save on every rank
            self.checkpointer.save(engine.state.iteration, **self.objects)

    def _resume(self, engine: Engine) -> None:
        if self._started or engine.state.iteration != 0:
            return  # a run() continuing in this process: its state is already right
        self._started = True
        if self.checkpointer.latest_step() is None:
            return
        self.resumed = self.checkpointer.load("latest", **self.objects)
        end = _run_end(engine.state)
        if end is not None and engine.state.iteration >= end and self.checkpointer.topology.rank == 0:
            log.warning(
                "checkpoint step %d in %s already completes this run (%s): nothing left to train. To train again "
                "from the start, delete that folder or give the run another one; to train on, raise %s",
                self.resumed.step,
                self.checkpointer.root,
                _limit_text(engine.state),
                "max_iters" if engine.state.max_iters is not None else "max_epochs",
            )
