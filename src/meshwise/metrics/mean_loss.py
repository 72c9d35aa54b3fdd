"""MeanLoss: a sample- or token-weighted mean loss whose float64 sums do not depend on how samples were split."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from meshwise.errors import MetricError

__all__ = ["MeanLoss"]


class MeanLoss(Metric):
    """Mean of a loss over every valid sample or token of the data group: ``sum(loss * weight) / sum(weight)``.

    ``update(values, weight=None)`` takes per-sample (``[B]``) or per-token (``[B, T]``) losses, each
    element weighing 1 (or ``weight``, broadcast to ``values``), or a scalar batch mean with
    ``weight=count``. With ``loss_fn`` it is ``update(preds, target, weight=None)`` and the values are
    ``loss_fn(preds, target)``, which must not reduce (e.g. ``reduction="none"``). States are float64
    sums, so the result does not depend on how samples were split over ranks. ``nan`` when nothing counted.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    total: Tensor
    weight: Tensor

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loss_fn = loss_fn
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, *args: Tensor, weight: Tensor | float | None = None) -> None:
        if self.loss_fn is not None:
            if len(args) != 2:
                raise MetricError(f"MeanLoss(loss_fn=...) updates with (preds, target), got {len(args)} arguments")
            values = self.loss_fn(*args)
        else:
            if len(args) != 1:
                raise MetricError(
                    f"MeanLoss() updates with (values, weight=None), got {len(args)} positional arguments: "
                    "pass loss_fn= to update with (preds, target)"
                )
            values = args[0]
        values = torch.as_tensor(values).detach().to(torch.float64)
        w = torch.ones_like(values) if weight is None else torch.as_tensor(weight, dtype=torch.float64)
        try:
            w = torch.broadcast_to(w.to(values.device), values.shape)
        except RuntimeError:
            raise MetricError(
                f"MeanLoss weight of shape {tuple(w.shape)} does not broadcast to the losses {tuple(values.shape)}: "
                "give one weight per loss element, or a scalar count for a scalar mean loss"
            ) from None
        self.total += (values * w).sum()
        self.weight += w.sum()

    def compute(self) -> Tensor:
        return self.total / self.weight if self.weight > 0 else torch.tensor(math.nan, dtype=torch.float64)
