"""AdamW with decoupled weight decay on weight matrices, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ptdp.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over the stage's parameters; weight decay only on tensors with >= 2
    dims (weights and embeddings), none on biases and LayerNorm parameters."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=lr_at(0, cfg),
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
    )


def lr_at(iteration: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``iteration`` (0-based).

    Linear warmup from lr / warmup to lr over ``lr_warmup_iters`` steps, then cosine decay to
    ``min_lr`` at ``lr_decay_iters`` (default ``train_iters``), constant after.
    """
    warmup, decay_end = cfg.lr_warmup_iters, cfg.decay_iters
    if iteration < warmup:
        return cfg.lr * (iteration + 1) / warmup
    if iteration >= decay_end:
        return cfg.min_lr
    progress = (iteration - warmup) / max(1, decay_end - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
