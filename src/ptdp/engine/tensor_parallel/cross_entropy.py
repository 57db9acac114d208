"""Cross entropy over vocabulary-sharded logits, without gathering the logits.

Each tp rank holds the logits of its vocabulary slice ``[vocab_start, vocab_start + V_local)``.
The loss ``log(sum_j exp(z_j)) - z_target`` needs three all-reduces of ``b*s`` elements on tp in
forward (max, target logit, sum of exponentials) and none in backward: ``softmax - onehot`` is
local to each slice (Shoeybi et al. 2019, arXiv:1909.08053, §3). Padded vocabulary entries are
never in the logits; a rank holding only padding passes ``[b, s, 0]`` logits.
Labels equal to :data:`IGNORE_INDEX` (-100, as PyTorch) give loss 0 and no gradient; any other
label outside ``[0, V)`` is an error (:func:`check_labels`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ptdp.engine.comm import AxisGroup, all_reduce

IGNORE_INDEX = -100
"""The label of a token that contributes no loss and no gradient (``F.cross_entropy``'s default)."""


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, axis, ignore_index):
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
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill_(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[-1] > 0:
            hit = (~outside).to(grad.dtype)
            grad.scatter_add_(-1, safe_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None


def check_labels(target: torch.Tensor, vocab_size: int, ignore_index: int = IGNORE_INDEX) -> None:
    """Raise ``ValueError`` (CPU) if a label is outside ``[0, vocab_size)`` and not ``ignore_index``.

    On a GPU the check is queued on the device (``torch._assert_async``, no host
    synchronisation): a bad label then fails the next synchronising call with the same message.
    """
    bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
    if target.device.type != "cpu":
        torch._assert_async(~bad.any(), f"a label is outside [0, {vocab_size}) and not the ignore index {ignore_index}")
        return
    if bool(bad.any()):
        value = int(target[bad][0])
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"label {value} at position {where} is outside the vocabulary [0, {vocab_size}) and is "
            f"not the ignore index {ignore_index}"
        )


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    axis: AxisGroup,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token cross entropy of vocab-sharded logits: ``[b, s]`` losses in nats, replicated on tp.

    ``logits``: ``[b, s, V_local]``, this rank's real columns from global id ``vocab_start``
    (``V_local`` may be 0); ``target``: ``[b, s]`` global ids in ``[0, vocab_size)`` or
    ``ignore_index`` (loss 0, no gradient); ``axis``: the tp axis. Forward: 3 all-reduces of
    ``b*s`` elements on tp; backward: none. With tp of size 1 this is ``F.cross_entropy``.
    Raises ValueError for any other label outside ``[0, V)`` (:func:`check_labels`; on a GPU
    reported asynchronously).
    """
    check_labels(target, vocab_size, ignore_index)
    if axis.size == 1:
        b, s, v = logits.shape
        return F.cross_entropy(
            logits.reshape(b * s, v), target.reshape(b * s), reduction="none", ignore_index=ignore_index
        ).view(b, s)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, axis, ignore_index)
