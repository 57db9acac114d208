"""Cross entropy over vocabulary-sharded logits, without gathering the logits.

Each tp rank holds the logits of its vocabulary slice ``[vocab_start, vocab_start + V_local)``.
The loss ``log(sum_j exp(z_j)) - z_target`` needs three all-reduces of ``b*s`` elements on the tp
axis in forward (max for stability, the target logit, the sum of exponentials) and none in
backward: the gradient ``softmax - onehot`` is local to each slice (Shoeybi et al. 2019, §3).
Padded vocabulary entries are never part of the logits (the caller passes only real rows), so they
cannot affect the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ptdp.comm import AxisGroup, all_reduce


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, axis):
        local_v = logits.shape[-1]
        if local_v > 0:
            logits_max = logits.amax(dim=-1)
        else:
            logits_max = logits.new_full(logits.shape[:-1], float("-inf"))
        all_reduce(logits_max, axis, op="max", tag="ce_max")
        shifted = logits - logits_max.unsqueeze(-1)

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_v)
        safe_target = local_target.masked_fill(outside, 0)
        if local_v > 0:
            target_logit = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
            target_logit = target_logit.masked_fill(outside, 0.0)
        else:
            target_logit = shifted.new_zeros(shifted.shape[:-1])
        all_reduce(target_logit, axis, tag="ce_target")

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, axis, tag="ce_sum_exp")
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[-1] > 0:
            hit = (~outside).to(grad.dtype)
            grad.scatter_add_(-1, safe_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int, axis: AxisGroup
) -> torch.Tensor:
    """Per-token cross entropy of vocab-sharded logits.

    Args:
        logits: ``[b, s, V_local]``, this rank's real vocabulary columns starting at ``vocab_start``.
        target: ``[b, s]`` token ids in ``[0, V)`` (global ids).
        vocab_start: global id of this rank's first column.
        axis: the tp axis.

    Returns:
        ``[b, s]`` losses in nats, replicated on every tp rank.

    Communication: forward 3 all-reduces of ``b*s`` elements on tp (max, target logit, sum of
    exponentials); backward none. With tp of size 1 this is ``F.cross_entropy``.
    """
    if axis.size == 1:
        b, s, v = logits.shape
        return F.cross_entropy(logits.reshape(b * s, v), target.reshape(b * s), reduction="none").view(b, s)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, axis)
