"""The output layer and the cross entropy in one chunked operation, on the padded vocabulary.

``loss[i] = logsumexp_j(z[i, j]) - z[i, y_i]`` with ``z = x W^T`` over the real vocabulary,
computed in chunks of tokens. The GEMM runs on this rank's padded shard
``W [V_pad / t, h]``; padding columns (global id ``>= V``) are set to ``-inf``, so they add 0 and
get no gradient. Tokens go in chunks of ``c`` rows, each reduced to three float32 numbers per token
(local max, sum of exponentials, target logit). The logits are kept for backward when
:func:`~ptdp.layout.vocab.keeps_logits` allows, else recomputed (a third GEMM).

Vocabulary parallelism (Shoeybi et al. 2019, §3): the statistics are combined with the three
all-reduces of :func:`~ptdp.engine.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`;
the input enters as f (backward all-reduce of its gradient). Sequence parallelism (Korthikanti et
al. 2022, §4.2.2): input ``[s/t, b, h]``, all-gathered along dim 0 in forward and again in backward
(``<tag>_regather``) before the reduce-scatter of its gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ptdp.engine.comm import AxisGroup, all_reduce
from ptdp.engine.tensor_parallel.cross_entropy import IGNORE_INDEX, check_labels
from ptdp.engine.tensor_parallel.sequence import start_sequence_gather, start_sequence_reduce_scatter
from ptdp.engine.tensor_parallel.wgrad import add_weight_grad, fuse_here
from ptdp.layout.vocab import keeps_logits

CHUNK_LOGIT_BYTES = 2**28
"""Bytes of one chunk's float32 logits that :func:`default_chunk_tokens` aims at (256 MiB)."""


def default_chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk so that a chunk's float32 logits ``[c, local_vocab]`` take at most
    :data:`CHUNK_LOGIT_BYTES`, rounded down to a multiple of 64 (at least 64). Example: GPT-2's
    ``V_pad = 50,304`` at tp = 1 gives 1,280 tokens (246 MiB of float32 logits per chunk)."""
    tokens = CHUNK_LOGIT_BYTES // (4 * max(local_vocab, 1))
    return max(64, tokens // 64 * 64)


@dataclass(frozen=True)
class _Shard:
    """What the autograd function needs to know about this rank's slice of the vocabulary."""

    vocab_start: int
    num_real: int
    axis: AxisGroup
    chunk: int
    sequence_parallel: bool
    tag: str
    ignore_index: int
    compiled: bool = False
    keep_logits: bool = False


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked(raw: torch.Tensor, num_real: int) -> torch.Tensor:
    """Logits ``raw [c, V_pad / t]`` in the compute dtype -> float32 (float64 stays float64), the
    padding columns ``[num_real, V_pad / t)`` set to ``-inf``: in place when ``raw`` already has
    that dtype, except under ``torch.compile``, where mutating a graph input would make inductor
    copy the result back into it."""
    z = raw.to(_softmax_dtype(raw.dtype))
    if num_real < z.shape[-1]:
        if torch.compiler.is_compiling():
            columns = torch.arange(z.shape[-1], device=z.device)
            return torch.where(columns < num_real, z, float("-inf"))
        z[:, num_real:] = float("-inf")
    return z


def _local_target(labels: torch.Tensor, vocab_start: int, num_real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The label as a column of this shard (0 where it is not on it) and whether it is on it."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < num_real)
    return local.masked_fill(~inside, 0), inside


def _statistics(
    raw: torch.Tensor, labels: torch.Tensor, vocab_start: int, num_real: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's per-token local max, sum of ``exp(z - max)`` (0 on a shard of padding only)
    and target logit (0 where the label is on another shard), each ``[c]``, from its logits."""
    z = _masked(raw, num_real)
    peak = z.amax(dim=-1)
    finite_peak = torch.where(peak == float("-inf"), 0.0, peak)  # a shard of padding only
    sum_exp = (z - finite_peak.unsqueeze(-1)).exp_().sum(dim=-1)
    column, inside = _local_target(labels, vocab_start, num_real)
    target_logit = z.gather(-1, column.unsqueeze(-1)).squeeze(-1).masked_fill_(~inside, 0.0)
    return peak, sum_exp, target_logit


def _chunk_statistics(
    rows: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int, num_real: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_statistics` of the logits ``rows [c, h] @ weight^T`` (made here, then freed)."""
    return _statistics(rows @ weight.t(), labels, vocab_start, num_real)


def _grad_logits(
    raw: torch.Tensor,
    labels: torch.Tensor,
    log_sum_exp: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int,
    num_real: int,
) -> torch.Tensor:
    """One chunk's ``(softmax - onehot) * scale`` in the logits' dtype, ``[c, V_pad / t]``, the
    padding columns 0. Eager: in place (one chunk-sized buffer; float32 and float64 logits are
    overwritten, kept logits being used once). Under ``torch.compile``: out of place, which
    inductor fuses into one pass without writing into its input."""
    column, inside = _local_target(labels, vocab_start, num_real)
    if torch.compiler.is_compiling():
        probs = torch.exp(_masked(raw, num_real) - log_sum_exp.unsqueeze(-1))
        target = (torch.arange(raw.shape[-1], device=raw.device) == column.unsqueeze(-1)) & inside.unsqueeze(-1)
        return ((probs - target.to(probs.dtype)) * scale.unsqueeze(-1)).to(raw.dtype)
    probs = _masked(raw, num_real).sub_(log_sum_exp.unsqueeze(-1)).exp_()
    probs.scatter_add_(-1, column.unsqueeze(-1), -inside.to(probs.dtype).unsqueeze(-1))
    return probs.mul_(scale.unsqueeze(-1)).to(raw.dtype)


def _chunk_grad_logits(
    rows: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    log_sum_exp: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int,
    num_real: int,
) -> torch.Tensor:
    """:func:`_grad_logits` of the logits recomputed as ``rows [c, h] @ weight^T``."""
    return _grad_logits(rows @ weight.t(), labels, log_sum_exp, scale, vocab_start, num_real)


@functools.cache
def _compiled(fn):
    """``fn`` compiled by ``torch.compile`` (inductor fuses the chunk's mask, max, exponentials,
    sums and gathers around the GEMM), made once per function."""
    return torch.compile(fn)


def _chunk_functions(shard: _Shard):
    """(statistics, gradient of the logits) of a chunk: from its kept logits (``keep_logits``) or
    from its input rows and the weight (the GEMM inside); compiled with ``compiled``."""
    pair = (_statistics, _grad_logits) if shard.keep_logits else (_chunk_statistics, _chunk_grad_logits)
    return tuple(_compiled(f) for f in pair) if shard.compiled else pair


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, shard: _Shard):
        full = start_sequence_gather(x, shard.axis, shard.tag)() if shard.sequence_parallel else x
        rows, labels = full.reshape(-1, full.shape[-1]), target.reshape(-1)
        n, dtype = rows.shape[0], _softmax_dtype(weight.dtype)
        local_max = rows.new_empty(n, dtype=dtype)
        sum_exp = rows.new_empty(n, dtype=dtype)
        target_logit = rows.new_empty(n, dtype=dtype)
        statistics, _ = _chunk_functions(shard)
        kept = rows.new_empty(n, weight.shape[0]) if shard.keep_logits else None
        for start in range(0, n, shard.chunk):
            stop = min(n, start + shard.chunk)
            inputs: tuple[torch.Tensor, ...]
            if kept is None:
                inputs = (rows[start:stop], weight)
            else:
                inputs = (torch.mm(rows[start:stop], weight.t(), out=kept[start:stop]),)
            local_max[start:stop], sum_exp[start:stop], target_logit[start:stop] = statistics(
                *inputs, labels[start:stop], shard.vocab_start, shard.num_real
            )
        global_max = all_reduce(local_max.clone(), shard.axis, op="max", tag="ce_max")
        all_reduce(target_logit, shard.axis, tag="ce_target")
        sum_exp.mul_((local_max - global_max).exp_())  # each rank's sum rescaled to the global max
        all_reduce(sum_exp, shard.axis, tag="ce_sum_exp")
        log_sum_exp = global_max + sum_exp.log_()
        ignored = labels == shard.ignore_index
        ctx.shard, ctx.shape = shard, full.shape
        ctx.save_for_backward(x, weight, labels, log_sum_exp, kept)
        return (log_sum_exp - target_logit).masked_fill_(ignored, 0.0).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, labels, log_sum_exp, kept = ctx.saved_tensors
        shard = ctx.shard
        full = x
        if shard.sequence_parallel:
            full = start_sequence_gather(x, shard.axis, shard.tag + "_regather")()
        rows = full.reshape(-1, full.shape[-1])
        scale = grad_loss.reshape(-1).masked_fill(labels == shard.ignore_index, 0.0).to(log_sum_exp.dtype)
        grad_rows = torch.empty_like(rows)
        fused = fuse_here(weight)  # straight into the float32 main_grad (tensor_parallel/wgrad.py)
        grad_weight = None  # float32/float64 weights: made by the first chunk's GEMM
        if fused:
            grad_weight = weight.main_grad
        elif weight.dtype != _softmax_dtype(weight.dtype):  # 16-bit: summed over chunks in float32
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        _, grad_logits_of = _chunk_functions(shard)
        for start in range(0, rows.shape[0], shard.chunk):
            stop = min(rows.shape[0], start + shard.chunk)
            inputs = (rows[start:stop], weight) if kept is None else (kept[start:stop],)
            grad_logits = grad_logits_of(
                *inputs,
                labels[start:stop],
                log_sum_exp[start:stop],
                scale[start:stop],
                shard.vocab_start,
                shard.num_real,
            )
            torch.mm(grad_logits, weight, out=grad_rows[start:stop])
            if grad_weight is None:  # the first chunk's product is the weight gradient so far
                grad_weight = grad_logits.t().mm(rows[start:stop])
            else:
                add_weight_grad(grad_weight, grad_logits, rows[start:stop])
        grad_x = grad_rows.view(ctx.shape)
        if shard.sequence_parallel:
            grad_x = start_sequence_reduce_scatter(grad_x, shard.axis, shard.tag)()
        else:
            all_reduce(grad_x, shard.axis, tag=shard.tag)
        if grad_weight is None:  # no tokens
            grad_weight = torch.zeros_like(weight)
        return grad_x, None if fused else grad_weight.to(weight.dtype), None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    axis: AxisGroup,
    sequence_parallel: bool = False,
    chunk_tokens: int | None = None,
    tag: str = "output",
    ignore_index: int = IGNORE_INDEX,
    compiled: bool = False,
    keep_logits: bool | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of ``x W^T`` over the vocabulary shards, in chunks of tokens.

    ``x``: ``[s, b, h]`` hidden states replicated over tp (``[s/t, b, h]`` with
    ``sequence_parallel``); ``weight``: this rank's padded shard ``[V_pad / t, h]`` from global row
    ``vocab_start``; ``target``: ``[s, b]`` global ids in ``[0, vocab_size)`` or ``ignore_index``;
    ``axis``: tp; ``tag``: of the input's communication; ``compiled``: chunks through
    ``torch.compile``; ``keep_logits``: keep the logits for backward (default: without
    ``chunk_tokens``, per :func:`~ptdp.layout.vocab.keeps_logits`).
    Returns ``[s, b]`` losses in nats, replicated on tp (0 where ignored). Forward: 3 all-reduces
    of ``s b`` on tp (+ the all-gather of ``x`` with sp); backward: 1 all-reduce of ``s b h`` (sp:
    all-gather and reduce-scatter). Raises ValueError for a bad label or ``chunk_tokens < 1``.
    """
    check_labels(target, vocab_size, ignore_index)
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be at least 1")
    local_vocab = weight.shape[0]
    num_real = max(0, min(local_vocab, vocab_size - vocab_start))
    sp = sequence_parallel and axis.size > 1
    if keep_logits is None:  # an explicit chunk size asks for the bounded-memory path
        keep_logits = chunk_tokens is None and keeps_logits(target.numel(), local_vocab, weight.element_size())
    shard = _Shard(
        vocab_start,
        num_real,
        axis,
        chunk_tokens or default_chunk_tokens(local_vocab),
        sp,
        tag,
        ignore_index,
        compiled,
        keep_logits,
    )
    return _LinearCrossEntropy.apply(x, weight, target, shard)
