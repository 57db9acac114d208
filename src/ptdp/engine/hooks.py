"""Where code outside the engine may act during a training step (nothing is registered by default).

``PHASE_HOOKS``: called as ``hook(rank, iteration, phase)`` on entering a phase
(:func:`ptdp.engine.activity.set_phase`; rank and 1-based iteration None before the first step).
``STEP_HOOKS``: called as ``hook(rank, iteration, module)`` at the start of
:func:`ptdp.engine.step.train_step` with this rank's first model chunk; what a hook returns, if
not None, is called with no arguments when the step's forward and backward have run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PhaseHook = Callable[[int | None, int | None, str], None]
StepHook = Callable[[int, int, Any], Callable[[], None] | None]

PHASE_HOOKS: list[PhaseHook] = []
STEP_HOOKS: list[StepHook] = []
