"""The norms of the GPT: LayerNorm and RMSNorm with parameters replicated on every tp rank, and
:func:`make_norm` building the configured one (``cfg.normalization``) for the residual stream
(width h) or for the query/key heads of ``--qk-layernorm`` (width d)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config.model import ModelConfig
from ptdp.engine.tensor_parallel.sequence import mark_sequence_parallel
from ptdp.engine.tensor_parallel.sharding import GlobalParam, make_parameter


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with parameters replicated on every tp rank."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_parameter(GlobalParam((hidden_size,), init="ones"), 1, dtype)
        self.bias = make_parameter(GlobalParam((hidden_size,), init="zeros"), 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang and Sennrich 2019, arXiv:1910.07467), ``x / sqrt(mean(x^2) + eps) * weight``
    over the last dim; the weight is replicated on every tp rank; no bias."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_parameter(GlobalParam((hidden_size,), init="ones"), 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def make_norm(
    cfg: ModelConfig, dtype: torch.dtype, sequence_parallel: bool = False, *, width: int | None = None
) -> nn.Module:
    """The configured normalization (``cfg.normalization``) of ``width`` channels (None: h); with
    ``sequence_parallel`` it normalizes sequence shards and its parameters are marked for the tp
    sum of their gradients."""
    kind = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    norm = kind(width if width is not None else cfg.hidden_size, cfg.layernorm_epsilon, dtype)
    if sequence_parallel:
        mark_sequence_parallel(norm.parameters())
    return norm
