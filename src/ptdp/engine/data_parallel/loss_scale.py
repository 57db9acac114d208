"""Dynamic loss scaling for float16 training (Micikevicius et al., "Mixed Precision Training",
arXiv:1710.03740, §3.2), kept on the device.

The loss is multiplied by ``scale`` before backward; after the data-parallel reduction
:meth:`DynamicLossScaler.unscale` divides the gradients by it and flags an inf or nan. The flag
rides the step's world all-reduce of the metrics (no collective of its own), so an overflow
anywhere skips the step on every rank; :meth:`DynamicLossScaler.update` then halves the scale
(never below ``min_scale``), and doubles it after ``growth_interval`` good steps in a row.
``scale`` and ``good_steps`` are 0-dim device tensors the host never reads inside a step.
"""

from __future__ import annotations

import torch


class DynamicLossScaler:
    """The loss scale and the count of good steps since the last skipped one, on ``device``.

    ``scale``: initial scale (a power of two keeps unscaling exact); ``growth_factor`` /
    ``backoff_factor``: applied when ``good_steps`` reaches a multiple of ``growth_interval`` /
    after a skipped step; ``min_scale``: the floor; ``good_steps``: good steps since the last skip.
    """

    def __init__(
        self,
        scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        good_steps: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.scale = torch.tensor(scale, dtype=torch.float32, device=device)
        """0-dim float32: the scale the next step multiplies its loss by."""
        self.good_steps = torch.tensor(good_steps, dtype=torch.int64, device=device)
        """0-dim int64: good steps in a row since the last skipped one."""

    def unscale(self, grads: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Divide this rank's reduced float32 ``grads`` (flat buffer or shard) by ``scale`` in
        place; returns a 0-dim float32 flag on the device, 1 where ``grads`` hold an inf or nan.

        One fused kernel (torch's ``_amp_foreach_non_finite_check_and_unscale_``, as
        ``torch.amp.GradScaler``). No communication, no host synchronisation.
        """
        found = torch.zeros((), dtype=torch.float32, device=grads.device)
        torch._amp_foreach_non_finite_check_and_unscale_([grads], found, scale.reciprocal())
        return found

    def update(self, skipped: torch.Tensor | bool) -> None:
        """After a step: halve the scale if it was ``skipped`` (a bool tensor, the same on every
        rank), never below ``min_scale``, and restart the count of good steps; otherwise count a
        good step and multiply the scale by ``growth_factor`` when the count reaches a multiple of
        ``growth_interval``. In place, by ``torch.where`` on the device (no host read)."""
        skipped = torch.as_tensor(skipped, device=self.scale.device)
        good = torch.where(skipped, torch.zeros_like(self.good_steps), self.good_steps + 1)
        grown = torch.where(good % self.growth_interval == 0, self.scale * self.growth_factor, self.scale)
        backed_off = torch.clamp(self.scale * self.backoff_factor, min=self.min_scale)
        self.scale.copy_(torch.where(skipped, backed_off, grown))
        self.good_steps.copy_(good)

    def state_dict(self) -> dict:
        """``{"scale": float, "good_steps": int}``: reads both to the host (for a checkpoint)."""
        return {"scale": self.scale.item(), "good_steps": int(self.good_steps.item())}

    def load_state_dict(self, state: dict) -> None:
        """Set the scale and the count from :meth:`state_dict`'s values (filled in place: the
        tensors the step holds stay the same objects)."""
        self.scale.fill_(float(state["scale"]))
        self.good_steps.fill_(int(state["good_steps"]))
