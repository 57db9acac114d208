"""Causal attention computed block by block and merged by log-sum-exp (no communication).

A query block against one key/value block gives a partial output ``o_i`` and log-sum-exp ``l_i``;
partials of the same rows over disjoint keys merge exactly: ``l = log(exp(l_1) + exp(l_2))``,
``o = exp(l_1 - l) o_1 + exp(l_2 - l) o_2`` (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; Dao et al. 2022, flash-attention; Liu et al. 2023, "Ring Attention",
arXiv:2310.01889). Backward needs only the final ``o`` and ``l``: with ``P = exp(S - l)`` and
``D = rowsum(dO * o)``, ``dV = P^T dO``, ``dS = P * (dO V^T - D)``, ``dQ = scale * dS K``,
``dK = scale * dS^T Q`` (Dao et al. 2022, Algorithm 4). Dropout (Srivastava et al. 2014) with mask
``M``: ``P`` becomes ``P * ~M / (1 - p)`` in the output and ``dV``, and ``dO V^T`` is masked alike.

Shapes: q ``[b, heads, n, d]``, k and v ``[b, kv_heads, m, d]`` (grouped-query: query head ``i``
uses kv head ``i // (heads / kv_heads)``, as ``scaled_dot_product_attention(enable_gqa=True)``);
outputs ``[b, heads, n, d]`` and log-sum-exp ``[b, heads, n]`` in float32 (float64 for float64).
A key at ``p_k`` is visible to a query at ``p_q`` when ``p_k <= p_q``.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch


class Partial(NamedTuple):
    """Attention of some query rows over some keys: ``out`` ``[b, heads, n, d]`` and the rows'
    log-sum-exp ``lse`` ``[b, heads, n]``, both in the compute dtype."""

    out: torch.Tensor
    lse: torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else (16-bit inputs included)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int) -> float:
    """The softmax scale ``1 / sqrt(d)`` of scaled dot-product attention."""
    return 1.0 / math.sqrt(head_dim)


def block_kind(q_start: int, q_len: int, k_start: int, k_len: int) -> str:
    """How a query block at positions ``[q_start, q_start + q_len)`` sees a key block at
    ``[k_start, k_start + k_len)`` under a causal mask: ``"skip"`` (every key in the future),
    ``"full"`` (every key at or before every query), ``"causal"`` (bottom-right aligned: the last
    key is at the last query's position, ``q_len <= k_len``) or ``"masked"`` (another overlap)."""
    q_end, k_end = q_start + q_len - 1, k_start + k_len - 1
    if k_start > q_end:
        return "skip"
    if k_end <= q_start:
        return "full"
    if k_end == q_end and q_len <= k_len:
        return "causal"
    return "masked"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"expected q [b, heads, n, d], k and v [b, kv_heads, m, d]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")


def _scores(q: torch.Tensor, k: torch.Tensor, offset: int | None, scale: float) -> torch.Tensor:
    """Scaled scores ``[b, kv_heads, group, n, m]`` in the compute dtype, masked (-inf) where key
    ``j`` is after query ``i``: ``j > i + offset`` (``offset`` None: no mask)."""
    cd = compute_dtype(q.dtype)
    qg = q.to(cd).unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))
    scores = torch.matmul(qg, k.to(cd).unsqueeze(2).transpose(-1, -2)) * scale
    if offset is not None:
        n, m = q.shape[2], k.shape[2]
        rows = torch.arange(n, device=q.device).unsqueeze(1)
        future = torch.arange(m, device=q.device).unsqueeze(0) > rows + offset
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _offset(causal: bool | int, n: int, m: int) -> int | None:
    """The mask offset: None (full), ``m - n`` (causal, bottom-right aligned), or the given int."""
    if causal is False:
        return None
    if causal is True:
        if n > m:
            raise ValueError(f"a causal block needs no more queries than keys, got {n} queries, {m} keys")
        return m - n
    return int(causal)


def _dropped(probs: torch.Tensor, drop: torch.Tensor | None, p: float) -> torch.Tensor:
    """``probs [b, kv_heads, group, n, m]`` with the entries where ``drop [b, heads, n, m]`` is True
    zeroed and the rest scaled by ``1 / (1 - p)`` (``probs`` itself without a mask)."""
    if drop is None:
        return probs
    return probs.masked_fill(drop.unflatten(1, probs.shape[1:3]), 0.0) * (1.0 / (1.0 - p))


def attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool | int,
    scale: float,
    drop: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> Partial:
    """Attention of ``q`` over one key/value block, with its log-sum-exp.

    ``q [b, heads, n, d]``, ``k``, ``v [b, kv_heads, m, d]``. ``causal``: False (all keys), True
    (bottom-right aligned: query ``i`` sees keys ``j <= i + m - n``) or an int offset ``o`` (``j <=
    i + o``; a row seeing no key gets output 0, log-sum-exp -inf). ``drop``: the block's mask
    ``[b, heads, n, m]`` (True: dropped) with ``dropout_p``, or None. Returns a differentiable
    :class:`Partial` in the compute dtype; :func:`attention_block_backward` is its explicit backward.
    """
    _check(q, k, v)
    scores = _scores(q, k, _offset(causal, q.shape[2], k.shape[2]), scale)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    out = torch.matmul(_dropped(probs, drop, dropout_p), v.to(scores.dtype).unsqueeze(2))
    return Partial(out.flatten(1, 2), lse.squeeze(-1).flatten(1, 2))


def attention_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool | int,
    scale: float,
    drop: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the gradients, given the rows' *final* (merged) output and log-sum-exp.

    ``dout``: gradient of the rows' final output ``[b, heads, n, d]``; ``out``, ``lse``: their
    final output and log-sum-exp ``[b, heads, n]`` over every key; the rest as given to
    :func:`attention_block`. Returns this block's terms ``(dq [b, heads, n, d], dk, dv
    [b, kv_heads, m, d])`` of the sums over blocks, in the compute dtype.
    """
    _check(q, k, v)
    hk, group = k.shape[1], q.shape[1] // k.shape[1]
    scores = _scores(q, k, _offset(causal, q.shape[2], k.shape[2]), scale)
    cd = scores.dtype
    grouped = lambda t: t.to(cd).unflatten(1, (hk, group))  # noqa: E731 - [b, hk, g, rows, ...]
    lse_g = grouped(lse).unsqueeze(-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse_g), torch.zeros_like(lse_g), lse_g))
    dout_g = grouped(dout)
    delta = (dout_g * grouped(out)).sum(-1, keepdim=True)
    dv = torch.matmul(_dropped(probs, drop, dropout_p).transpose(-1, -2), dout_g).sum(2)
    dprobs = _dropped(torch.matmul(dout_g, v.to(cd).unsqueeze(2).transpose(-1, -2)), drop, dropout_p)
    dscores = probs * (dprobs - delta)
    dq = torch.matmul(dscores, k.to(cd).unsqueeze(2)).mul_(scale).flatten(1, 2)
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(cd).unflatten(1, (hk, group))).sum(2).mul_(scale)
    return dq, dk, dv


def merge(a: Partial, b: Partial) -> Partial:
    """Exact merge of two partial results of the same rows over disjoint key sets (differentiable)."""
    lse = torch.logaddexp(a.lse, b.lse)
    wa = torch.exp(a.lse - lse).unsqueeze(-1)
    wb = torch.exp(b.lse - lse).unsqueeze(-1)
    return Partial(a.out * wa + b.out * wb, lse)


def merge_into(acc: Partial, part: Partial) -> None:
    """:func:`merge` of ``part`` into ``acc`` in place (``acc`` may be views of rows of larger
    accumulators; not for autograd)."""
    merged = merge(acc, part)
    acc.out.copy_(merged.out)
    acc.lse.copy_(merged.lse)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, k_start: int, scale: float | None = None
) -> Partial | None:
    """:func:`attention_block` of a query block at global positions ``[q_start, q_start + n)``
    over a key block at ``[k_start, k_start + m)`` with the causal mask their offsets imply; None
    for a block entirely in the future (skipped: nothing computed)."""
    n, m = q.shape[2], k.shape[2]
    kind = block_kind(q_start, n, k_start, m)
    if kind == "skip":
        return None
    scale = default_scale(q.shape[-1]) if scale is None else scale
    causal = {"full": False, "causal": True, "masked": q_start - k_start}[kind]
    return attention_block(q, k, v, causal=causal, scale=scale)


def empty_partial(q: torch.Tensor) -> Partial:
    """Accumulators of no keys yet: output 0, log-sum-exp -inf, in the compute dtype. The output
    ``[b, heads, n, d]`` is a permuted view of an ``[n, b, heads, d]`` tensor, the layout of the
    sequence-first activations: the model's ``[n, b, heads d]`` view of the attention output (the
    output projection's input) is then no copy."""
    cd = compute_dtype(q.dtype)
    b, heads, n, d = q.shape
    return Partial(
        torch.zeros((n, b, heads, d), dtype=cd, device=q.device).permute(1, 2, 0, 3),
        torch.full(q.shape[:3], float("-inf"), dtype=cd, device=q.device),
    )


class _BlockwiseCausal(torch.autograd.Function):
    """Causal self-attention of one sequence cut into blocks; backward block by block."""

    @staticmethod
    def forward(ctx, q, k, v, starts: tuple[int, ...], scale: float):
        acc = empty_partial(q)
        pairs = []
        for i, (q0, q1) in enumerate(zip(starts, starts[1:])):
            for j, (k0, k1) in enumerate(zip(starts, starts[1:])):
                part = block_attention(
                    q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], q_start=q0, k_start=k0, scale=scale
                )
                if part is not None:
                    merge_into(Partial(acc.out[:, :, q0:q1], acc.lse[:, :, q0:q1]), part)
                    pairs.append((i, j))
        ctx.save_for_backward(q, k, v, acc.out, acc.lse)
        ctx.starts, ctx.scale, ctx.pairs = starts, scale, pairs
        return acc.out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        starts, cd = ctx.starts, out.dtype
        dq, dk, dv = (torch.zeros(t.shape, dtype=cd, device=t.device) for t in (q, k, v))
        for i, j in ctx.pairs:
            rows, cols = slice(starts[i], starts[i + 1]), slice(starts[j], starts[j + 1])
            kind = block_kind(rows.start, rows.stop - rows.start, cols.start, cols.stop - cols.start)
            causal = {"full": False, "causal": True, "masked": rows.start - cols.start}[kind]
            gq, gk, gv = attention_block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal=causal,
                scale=ctx.scale,
            )
            dq[:, :, rows] += gq
            dk[:, :, cols] += gk
            dv[:, :, cols] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def blockwise_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_sizes: list[int], *, scale: float | None = None
) -> torch.Tensor:
    """Causal self-attention of a whole sequence computed as blocks of queries against blocks of
    keys (sizes ``block_sizes``, summing to ``s``), merged by log-sum-exp, with the explicit
    block-by-block backward: the single-process form of the context-parallel attention.
    q ``[b, heads, s, d]``, k and v ``[b, kv_heads, s, d]`` -> ``[b, heads, s, d]`` in q's dtype.
    Raises ValueError when the block sizes do not sum to ``s`` or one is not positive.
    """
    s = q.shape[2]
    if sum(block_sizes) != s or min(block_sizes) <= 0 or k.shape[2] != s:
        raise ValueError(
            f"block sizes {block_sizes} must be positive and sum to the sequence length {s} (keys: {k.shape[2]})"
        )
    starts = tuple(itertools.accumulate(block_sizes, initial=0))
    scale = default_scale(q.shape[-1]) if scale is None else scale
    return _BlockwiseCausal.apply(q, k, v, starts, scale)
