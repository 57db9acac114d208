"""AdamW with decoupled weight decay on weight matrices, float32 main parameters for bfloat16
models, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ptdp.spec import TrainConfig
from ptdp.engine.data_parallel.buffer import GradBuffer


class MainParamsAdamW:
    """AdamW on float32 copies ("main parameters") of low-precision model parameters.

    Each step updates the float32 copies from the float32 gradient buffer, then copies them into the
    model's parameters (rounding once), so updates smaller than the model dtype's resolution are not
    lost (Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740; Megatron's
    ``Float16OptimizerWithFloat16Params``). Memory: 4 bytes per parameter more than plain AdamW.
    """

    def __init__(self, groups: list[dict], grads: GradBuffer, **adam_kwargs) -> None:
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        main_groups = []
        for group in groups:
            mains = []
            for p in group["params"]:
                main = nn.Parameter(p.detach().float().clone())
                main.grad = grads.grad(p)
                self.pairs.append((p, main))
                mains.append(main)
            main_groups.append({**group, "params": mains})
        self.inner = torch.optim.AdamW(main_groups, **adam_kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        for p, main in self.pairs:
            p.copy_(main)


def build_optimizer(model: nn.Module, cfg: TrainConfig, grads: GradBuffer, *,
                    param_gather_units: list[tuple[nn.Module, list[nn.Parameter]]] | None = None):
    """AdamW over the stage's parameters; weight decay on every tensor with >= 2 dims (weight
    matrices, word and position embeddings), none on biases and LayerNorm parameters.

    With a sharded ``grads`` (distributed optimizer) :class:`~ptdp.engine.data_parallel.zero.ShardedAdamW`;
    otherwise float32/float64 parameters are updated in place (their ``.grad`` views ``grads``)
    and bfloat16 parameters through :class:`MainParamsAdamW` (``grads`` is then float32).
    ``param_gather_units`` (sharded only): overlap the parameter all-gather with the next forward,
    each module waiting for its own parameters (:class:`~ptdp.engine.data_parallel.zero.ShardedAdamW`).
    """
    kwargs = dict(lr=lr_at(0, cfg), betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if grads.sharded:
        from ptdp.engine.data_parallel.zero import ShardedAdamW

        return ShardedAdamW(grads, weight_decay=cfg.weight_decay, overlap_with=param_gather_units,
                            **kwargs)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if grads.uses_main_grad:
        return MainParamsAdamW(groups, grads, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


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


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
