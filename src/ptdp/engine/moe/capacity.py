"""Which routed assignments an expert keeps when it has a capacity.

An expert takes at most ``ceil(CF x n x k / E)`` of the assignments of one micro-batch's ``n = b s``
tokens (all of them, gathered from the ranks that share the micro-batch, so the decision does not
depend on the layout). Over-full experts keep, by ``policy``: ``probs``, the highest weights, ties
to the earlier token, then the earlier slot; ``position``, the earliest tokens, then the earlier
slot. A token's id is its place in the micro-batch, ``sample x s + position``.
"""

from __future__ import annotations

import math

import torch

from ptdp.engine.moe.losses import counts_of

POLICIES = ("probs", "position")


def expert_capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """``ceil(factor x tokens x topk / num_experts)`` assignments per expert."""
    return math.ceil(factor * tokens * topk / num_experts)


def keep_mask(
    experts: torch.Tensor,
    weights: torch.Tensor,
    token_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    policy: str = "probs",
) -> torch.Tensor:
    """``[N, k]`` bool: the assignments kept (module docstring) among ``experts`` ``[N, k]`` with
    their ``weights`` ``[N, k]`` for tokens ``token_ids`` ``[N]``. Deterministic: stable sorts on
    (expert, -weight or token, token, slot). Raises ValueError for an unknown ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
    n, k = experts.shape
    flat_expert = experts.reshape(-1)
    flat_token = token_ids.unsqueeze(1).expand(n, k).reshape(-1)
    flat_slot = torch.arange(k, device=experts.device).repeat(n)
    order = torch.arange(n * k, device=experts.device)
    # least significant key first; each stable sort keeps the order of the keys sorted before
    keys = [flat_slot, flat_token]
    if policy == "probs":
        keys.append(-weights.reshape(-1))
    keys.append(flat_expert)
    for key in keys:
        order = order[torch.sort(key[order], stable=True).indices]
    sorted_expert = flat_expert[order]
    counts = counts_of(flat_expert, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n * k, device=experts.device) - starts[sorted_expert]
    keep = torch.empty(n * k, dtype=torch.bool, device=experts.device)
    keep[order] = rank_in_expert < capacity
    return keep.view(n, k)
