"""What one training step reports: its metrics on the device (:class:`PendingStep`, returned by
:func:`ptdp.engine.step.train_step`) until read to the host, once per logged step and for many
steps at a time (:func:`read_results`), and the :class:`StepResult` they become, with why a step
was skipped."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import overload

import torch

NONFINITE_LOSS = "non-finite loss"
NONFINITE_GRAD_NORM = "non-finite gradient norm"
FP16_OVERFLOW = "float16 overflow"


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Mean loss (nats per token) over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping, of the unscaled gradients with float16 (inf/nan when a
    gradient it counts is; an overflow it does not count still skips the step: ``skip_reason``)."""
    lr: float
    skipped: bool = False
    """No update on any rank (see ``skip_reason``)."""
    loss_scale: float | None = None
    """The loss scale this step multiplied its loss by (float16 only; the next step's is halved
    after a skip)."""
    skip_reason: str | None = None
    """:data:`NONFINITE_LOSS` or :data:`NONFINITE_GRAD_NORM` (on some rank), or
    :data:`FP16_OVERFLOW`: float16 gradients overflowed at a loss scale that can still be halved
    (the scaler's ordinary business, not a failure)."""

    @property
    def nonfinite(self) -> bool:
        """Skipped because the loss or the gradient norm was not finite."""
        return self.skip_reason in (NONFINITE_LOSS, NONFINITE_GRAD_NORM)


class PendingStep:
    """What :func:`train_step` returns: the step's metrics while they are still on the device.

    ``values`` is a float64 ``[5]`` tensor on the stage's device, the same on every rank: the mean
    loss, the gradient norm before clipping, how many ranks found a non-finite loss, how many a
    non-finite gradient norm (with float16: or an inf/nan in their unscaled gradients), and the
    loss scale the step used (1 without a scaler). Nothing is read to the host until
    :meth:`result` (or :func:`read_results` for many steps, one synchronisation for all) is
    called; the attributes of :class:`StepResult` read it on first use. ``min_scale``: the
    float16 scaler's smallest scale (None without a scaler), which tells an overflow the scaler
    handles (:data:`FP16_OVERFLOW`) from one it cannot (:data:`NONFINITE_GRAD_NORM`).
    """

    def __init__(self, values: torch.Tensor, lr: float, min_scale: float | None = None) -> None:
        self.values, self.lr, self.min_scale = values, lr, min_scale
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """The step's :class:`StepResult` (reads ``values`` to the host once: a synchronisation)."""
        if self._result is None:
            return read_results([self])[0]
        return self._result

    def _resolve(self, row: list[float]) -> None:
        loss, norm, bad_losses, bad_norms, scale = row
        scaled = self.min_scale is not None
        reason = None
        if bad_losses or not math.isfinite(loss):
            reason = NONFINITE_LOSS
        elif bad_norms or not math.isfinite(norm):  # float16: halving the scale is the remedy, unless it can't
            reason = FP16_OVERFLOW if self.min_scale is not None and scale > self.min_scale else NONFINITE_GRAD_NORM
        self._result = StepResult(
            loss=loss,
            grad_norm=norm,
            lr=self.lr,
            skipped=reason is not None,
            loss_scale=scale if scaled else None,
            skip_reason=reason,
        )

    loss = property(lambda self: self.result().loss)
    grad_norm = property(lambda self: self.result().grad_norm)
    skipped = property(lambda self: self.result().skipped)
    skip_reason = property(lambda self: self.result().skip_reason)
    loss_scale = property(lambda self: self.result().loss_scale)
    nonfinite = property(lambda self: self.result().nonfinite)


def read_results(steps: list[PendingStep]) -> list[StepResult]:
    """The results of ``steps``, reading every one not read yet to the host with one
    ``tolist()`` of their stacked values: one host synchronisation for all of them."""
    return read_results_with(steps)[0]


@overload
def read_results_with(steps: list[PendingStep], extra: torch.Tensor) -> tuple[list[StepResult], list[float]]: ...


@overload
def read_results_with(steps: list[PendingStep], extra: None = None) -> tuple[list[StepResult], None]: ...


def read_results_with(
    steps: list[PendingStep], extra: torch.Tensor | None = None
) -> tuple[list[StepResult], list[float] | None]:
    """:func:`read_results`, and the values of ``extra`` (a float64 ``[5]`` tensor on the steps'
    device, e.g. values reduced over ranks at log time) read in the same ``tolist()``: still one
    host synchronisation. Returns the results and ``extra``'s values (None without it)."""
    unread = [step for step in steps if step._result is None]
    values = [step.values for step in unread] + ([extra] if extra is not None else [])
    rows = torch.stack(values).tolist() if values else []
    for step, row in zip(unread, rows):
        step._resolve(row)
    return [step.result() for step in steps], (rows[-1] if extra is not None else None)
