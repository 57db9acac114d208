"""Dynamic loss scaling for float16 training (Micikevicius et al., "Mixed Precision Training",
arXiv:1710.03740, §3.2).

The loss is multiplied by ``scale`` before backward so small gradients survive float16; the
gradients are divided by it after the data-parallel reduction. If any gradient element on any rank
is inf or nan, every rank skips the step (one max all-reduce of a flag over the world, which spans
the tp, pp and dp axes) and halves the scale; after ``growth_interval`` good steps in a row the
scale doubles. All ranks see the same flag, so they keep the same scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptdp.engine.comm import AxisGroup, all_reduce


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0

    def found_overflow(self, grads: torch.Tensor, world: AxisGroup) -> bool:
        """Whether any rank's ``grads`` hold an inf or nan (collective over ``world``)."""
        flag = torch.tensor([0.0 if torch.isfinite(grads).all() else 1.0], device=grads.device)
        all_reduce(flag, world, op="max", tag="overflow")
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]
