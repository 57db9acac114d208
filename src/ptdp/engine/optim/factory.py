"""The optimizer of a stage, for every sharding strategy: AdamW with decoupled weight decay on
weight matrices, float32 main parameters for 16-bit models, the distributed optimizer over a
sharded gradient buffer or over sharded parameters."""

from __future__ import annotations

from typing import Any

from torch import nn

from ptdp.config.schema import TrainConfig
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.data_parallel.units import ParamUnits
from ptdp.engine.optim.adamw import MainParamsAdamW, adamw
from ptdp.engine.optim.zero import ShardedAdamW
from ptdp.layout.lr_schedule import lr_at


def build_optimizer(
    model: nn.Module,
    cfg: TrainConfig,
    grads: GradBuffer,
    *,
    param_gather_units: list[tuple[nn.Module, list[nn.Parameter]]] | None = None,
    units: ParamUnits | None = None,
    params: list[nn.Parameter] | None = None,
):
    """AdamW over the stage's parameters; weight decay on every tensor with >= 2 dims (weight
    matrices, word and position embeddings), none on biases and LayerNorm parameters.

    Sharded ``grads``: :class:`~ptdp.engine.optim.zero.ShardedAdamW` (``param_gather_units``:
    overlap the parameter all-gather with the next forward; ``units``: ``optim_grads_params``).
    ``params``: the parameters of ``grads`` (default: all of ``model``'s).
    Otherwise float32/float64 parameters are updated in place and 16-bit ones through
    :class:`~ptdp.engine.optim.adamw.MainParamsAdamW`. Skip an update on the device with
    :func:`~ptdp.engine.optim.adamw.step_unless` (the wrappers: ``step(skip)``).
    """
    kwargs: dict[str, Any] = dict(lr=lr_at(0, cfg), betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if units is not None:
        return ShardedAdamW(units.grads, weight_decay=cfg.weight_decay, units=units, **kwargs)
    if grads.sharded:
        return ShardedAdamW(grads, weight_decay=cfg.weight_decay, overlap_with=param_gather_units, **kwargs)
    params = list(model.parameters()) if params is None else params
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if grads.uses_main_grad:
        return MainParamsAdamW(groups, grads, **kwargs)
    return adamw(groups, **kwargs)
