"""The router's balancing losses, as each rank's share of a layout-independent value.

A loss is defined over units of tokens: ``aux_loss`` one micro-batch (its ``b s`` tokens),
``seq_aux_loss`` one sequence (``s`` tokens, averaged over the micro-batch's ``b``),
``global_aux_loss`` one micro-batch with the previous step's global-batch counts scaled to it. For a unit of
``n`` tokens with ``c_i`` assignments to expert ``i`` (the router's choices, before any capacity
drop) and scores ``p_ti`` (:attr:`ptdp.engine.moe.router.Routing.scores`), the Switch loss (Fedus et
al. 2021, arXiv:2101.03961, eq. 4; Megatron-Core's normalisation with top-k)::

    aux = coeff x E / (k n^2) x sum_i c_i sum_t p_ti

The counts come from every rank sharing the unit (no gradient), the sum over ``t`` from this
rank's tokens: the ranks' shares add up to the unit's loss. The z-loss (Zoph et al. 2022,
arXiv:2202.08906, eq. 5) is ``coeff x mean_t logsumexp(logits_t)^2`` over the micro-batch, shared
the same way.
"""

from __future__ import annotations

import torch


def counts_of(index: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]`` int64: how often each value of ``index`` (int64, each in ``[0, size)``) occurs;
    a scatter-add into a tensor of known size (``torch.bincount`` reads the maximum to the host on
    CUDA)."""
    return torch.zeros(size, dtype=torch.int64, device=index.device).scatter_add_(0, index, torch.ones_like(index))


def expert_counts(experts: torch.Tensor, unit: torch.Tensor, num_units: int, num_experts: int) -> torch.Tensor:
    """``[units, E]`` assignments per unit and expert of this rank's ``experts`` ``[T, k]``, token
    ``t`` in unit ``unit[t]`` (float, the router dtype of the caller's choice: int64 here)."""
    index = unit.unsqueeze(1) * num_experts + experts
    return counts_of(index.reshape(-1), num_units * num_experts).view(num_units, num_experts)


def switch_aux_share(
    scores: torch.Tensor,
    unit: torch.Tensor,
    counts: torch.Tensor,
    unit_tokens: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """This rank's share of the mean over units of the Switch loss (module docstring): ``scores``
    ``[T, E]`` of its tokens, ``unit`` ``[T]`` their units, ``counts`` ``[units, E]`` over all ranks
    sharing them, ``unit_tokens`` tokens per unit. A 0-dim tensor in the scores' dtype."""
    units, num_experts = counts.shape
    per_token = (counts.to(scores.dtype)[unit] * scores).sum(dim=-1)
    return per_token.sum() * (coeff * num_experts / (topk * unit_tokens**2 * units))


def z_loss_share(logits: torch.Tensor, unit_tokens: int, coeff: float) -> torch.Tensor:
    """This rank's share of ``coeff x mean logsumexp(logits)^2`` over a micro-batch of
    ``unit_tokens`` tokens: its tokens' sum over ``unit_tokens``."""
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / unit_tokens)
