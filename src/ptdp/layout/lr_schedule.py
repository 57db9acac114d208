"""The learning-rate schedule: linear warmup, then cosine decay to the minimum, constant after."""

from __future__ import annotations

import math
from typing import Protocol


class LRSettings(Protocol):
    """The schedule's settings (a :class:`ptdp.config.schema.TrainConfig`)."""

    @property
    def lr(self) -> float: ...

    @property
    def min_lr(self) -> float: ...

    @property
    def warmup_iters(self) -> int: ...

    @property
    def decay_iters(self) -> int: ...


def lr_at(iteration: int, cfg: LRSettings) -> float:
    """Learning rate for optimizer step ``iteration`` (0-based).

    Linear warmup from lr / warmup to lr over ``cfg.warmup_iters`` steps, then cosine decay to
    ``min_lr`` at ``lr_decay_iters`` (default ``train_iters``), constant after.
    """
    warmup, decay_end = cfg.warmup_iters, cfg.decay_iters
    if iteration < warmup:
        return cfg.lr * (iteration + 1) / warmup
    if iteration >= decay_end:
        return cfg.min_lr
    progress = (iteration - warmup) / max(1, decay_end - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
