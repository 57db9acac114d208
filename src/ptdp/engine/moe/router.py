"""Top-k routing of tokens to experts, in the router's dtype whatever the compute dtype.

Scores (``T`` tokens, ``E`` experts, ``k`` per token; Megatron-Core's options):

- ``softmax``: the top-k of the logits, weights the softmax over those k logits; with
  ``pre_softmax`` the softmax over all E first, weights its top-k values.
- ``sigmoid`` (DeepSeek-V3, arXiv:2412.19437, §2.1.2): scores ``sigmoid(logits)``, the top-k of
  them, weights those scores normalised to sum 1 when k > 1.
- ``expert_bias`` (aux-loss-free balancing, arXiv:2408.15664) is added to the scores (softmax
  without pre-softmax: to the logits) for the choice only, never to the weights.
- group-limited (DeepSeek-V3): the experts form ``num_groups`` equal groups; a group's score is the
  sum of its best ``k / group_topk`` choice scores; only the best ``group_topk`` groups are eligible.
- the weights are multiplied by ``scaling_factor``.

The scores that the auxiliary losses use are the full distribution: the softmax over E, or the
sigmoid scores normalised over E.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class _RouterLinear(torch.autograd.Function):
    """``x @ weight.T`` in ``dtype`` (``[T, h] x [E, h] -> [T, E]``), keeping ``x`` and ``weight`` in
    their own dtypes for backward (no ``dtype`` copy of the tokens); gradients computed in ``dtype``
    and returned in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        return torch.nn.functional.linear(x.to(dtype), weight.to(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = (grad @ weight.to(ctx.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (grad.t() @ x.to(ctx.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def router_logits(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The router's logits ``[T, E]`` in ``dtype`` of tokens ``x`` ``[T, h]`` and the router ``[E, h]``;
    backward keeps them as they are (Megatron-Core's router GEMM does the same)."""
    return _RouterLinear.apply(x, weight, dtype)


@dataclass(frozen=True)
class Routing:
    """One micro-batch's routing on one rank; per-rank ``T`` local tokens.

    Attributes:
        weights: ``[T, k]`` combine weights of the chosen experts, in the router dtype.
        experts: ``[T, k]`` int64 expert indices, in the top-k order (best first).
        scores: ``[T, E]`` the full score distribution for the balancing losses.
        logits: ``[T, E]`` the router logits (the z-loss's input).
    """

    weights: torch.Tensor
    experts: torch.Tensor
    scores: torch.Tensor
    logits: torch.Tensor


def _limit_to_groups(choice: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """``choice`` ``[T, E]`` with the experts outside each token's best ``group_topk`` groups set to
    -inf; a group's score is the sum of its best ``topk // group_topk`` choice scores."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(group_topk, dim=-1).indices
    keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return choice.masked_fill(~keep.repeat_interleave(experts // num_groups, dim=1), float("-inf"))


def route(
    logits: torch.Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    scaling_factor: float | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    expert_bias: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
) -> Routing:
    """The routing of ``logits`` ``[T, E]`` (module docstring); ``forced`` ``[T, k]``: these experts
    instead of the top-k (:func:`balanced_assignment`), weighted as if chosen. Raises ValueError for
    an unknown ``score_function``."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
        if pre_softmax:
            choice = scores if expert_bias is None else scores + expert_bias
        else:
            choice = logits if expert_bias is None else logits + expert_bias
    elif score_function == "sigmoid":
        sig = torch.sigmoid(logits)
        scores = sig / sig.sum(dim=-1, keepdim=True)
        choice = sig if expert_bias is None else sig + expert_bias
    else:
        raise ValueError(f"score_function={score_function!r} must be softmax or sigmoid")
    if forced is not None:
        experts = forced
    else:
        if num_groups is not None and group_topk is not None:
            choice = _limit_to_groups(choice, topk, num_groups, group_topk)
        experts = choice.topk(topk, dim=-1).indices
    if score_function == "softmax":
        weights = scores.gather(1, experts) if pre_softmax else torch.softmax(logits.gather(1, experts), dim=-1)
    else:
        weights = sig.gather(1, experts)
        if topk > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling_factor is not None:
        weights = weights * scaling_factor
    return Routing(weights=weights, experts=experts, scores=scores, logits=logits)


def balanced_assignment(token_ids: torch.Tensor, topk: int, num_experts: int) -> torch.Tensor:
    """``[T, k]`` experts of the forced balanced routing: token ``t`` (its index in the micro-batch,
    ``token_ids``) goes to experts ``(t k + j) mod E``, ``j < k``."""
    slots = token_ids.unsqueeze(1) * topk + torch.arange(topk, device=token_ids.device)
    return slots % num_experts
