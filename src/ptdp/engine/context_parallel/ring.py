"""Ring attention over the cp axis: key/value blocks passed around the ring of cp ranks
(Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
arXiv:2310.01889), with the 2C-chunk load balancing of :mod:`.load_balance` (Megatron-Core's
``--cp-comm-type p2p``).

Rank ``r`` holds chunks ``r`` and ``2C - 1 - r`` (``2c`` rows, ``c = s / (2C)``). At step ``i``
(0 to C - 1) it holds the key/value block of rank ``src = (r - i) mod C`` and computes:

* ``src == r``: all queries against all keys, causal on local indices;
* ``src < r``: all queries against the block's first chunk, full (its second is in the future);
* ``src > r``: the second query chunk (``2C - 1 - r``) against the whole block, full.

Every step after the first costs every rank ``2c x c`` scores, so the ring stays balanced.
Partial results are merged by log-sum-exp (:mod:`.blockwise`).
"""

from __future__ import annotations

import torch

from ptdp.engine.comm import P2P, AxisGroup, post
from ptdp.engine.context_parallel.blockwise import Partial, compute_dtype, empty_partial, merge_into
from ptdp.engine.context_parallel.kernels import block_backward, block_forward

#: gloo tags of the two kinds of message between ring neighbours (NCCL matches by order)
KV_TAG, DKV_TAG = 1, 2
FORWARD, BACKWARD = "cp_attention_forward", "cp_attention_backward"


def ring_block(rank: int, src: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) that ``rank`` computes against ``src``'s key/value block."""
    everything = slice(0, 2 * c)
    if src == rank:
        return everything, everything, True
    if src < rank:
        return everything, slice(0, c), False
    return slice(c, 2 * c), everything, False


def ring_groups(rank: int, size: int, phase: str) -> list[list[tuple[str, int, str]]]:
    """The batches ``rank`` posts in one ``phase`` (``"forward"`` or ``"backward"``), in order,
    each a list of ``(kind, peer, label)`` as :attr:`~ptdp.engine.comm.CommStats.p2p_log`
    records them (pure: the NCCL model of :mod:`ptdp.layout.pipeline.nccl_model` checks them).
    ``"kv{x}"`` is rank x's key/value block, ``"dkv{x}"`` the accumulator of its gradients."""
    if size == 1:
        return []
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    groups = []
    for step in range(size if phase == "backward" else size - 1):
        sends, recvs = [], []
        if step < size - 1:  # the block in hand goes on; the previous rank's block comes in
            sends.append(f"kv{(rank - step) % size}")
            recvs.append(f"kv{(rank - step - 1) % size}")
        if phase == "backward" and step > 0:  # accumulators travel one step behind their blocks
            sends.append(f"dkv{(rank - step + 1) % size}")
            recvs.append(f"dkv{(rank - step) % size}")
        groups.append([("send", nxt, label) for label in sends] + [("recv", prev, label) for label in recvs])
    if phase == "backward":  # the last accumulator reaches its owner, the next rank
        groups.append([("send", nxt, f"dkv{nxt}"), ("recv", prev, f"dkv{rank}")])
    return groups


def _post(
    axis: AxisGroup, sends: list[tuple[torch.Tensor, int, str]], recvs: list[tuple[torch.Tensor, int, str]], tag: str
) -> list:
    """One batch: each ``(tensor, message tag, label)`` of ``sends`` to the next rank, each of
    ``recvs`` from the previous one; the handles to wait for (nothing on an axis of size 1)."""
    if axis.size == 1 or not sends:
        return []
    nxt, prev = (axis.rank + 1) % axis.size, (axis.rank - 1) % axis.size
    transfers = [P2P("send", t, nxt, msg, label) for t, msg, label in sends] + [
        P2P("recv", t, prev, msg, label) for t, msg, label in recvs
    ]
    return post(transfers, axis, tag=tag, defer=True) or []


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def ring_drop(drop: torch.Tensor | None, rows: slice, cols: slice, src: int, size: int, c: int) -> torch.Tensor | None:
    """The dropout mask (``drop``: this rank's rows, columns in global positions) of query rows
    ``rows`` against rows ``cols`` of ``src``'s key/value block (its chunks ``src`` and
    ``2C - 1 - src``: all of them, or the first, as :func:`ring_block` gives them)."""
    if drop is None:
        return None
    first = drop[:, :, rows, src * c : (src + 1) * c]
    if cols.stop - cols.start == c:
        return first
    second = (2 * size - 1 - src) * c
    return torch.cat([first, drop[:, :, rows, second : second + c]], dim=3)


class RingAttention(torch.autograd.Function):
    """``forward(q, k, v, axis, scale, kernel, drop, dropout_p)``: this rank's attention output
    (``kernel`` "math" or "fused", :mod:`.kernels`); shapes, dropout and communication as
    :func:`~ptdp.engine.context_parallel.cp_attention.context_parallel_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, axis: AxisGroup, scale: float, kernel: str, drop=None, dropout_p: float = 0.0):
        size, rank, c = axis.size, axis.rank, q.shape[2] // 2
        acc = empty_partial(q)
        kv = torch.stack([k, v])  # [2, b, kv_heads, 2c, d]: one message per step
        spare = torch.empty_like(kv)
        for step in range(size):
            # post the next block's transfer before this block's attention: they overlap
            src = (rank - step) % size
            works = (
                _post(axis, [(kv, KV_TAG, f"kv{src}")], [(spare, KV_TAG, f"kv{(src - 1) % size}")], FORWARD)
                if step < size - 1
                else []
            )
            rows, cols, causal = ring_block(rank, src, c)
            part = block_forward(
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                causal=causal,
                scale=scale,
                kernel=kernel,
                drop=ring_drop(drop, rows, cols, src, size, c),
                dropout_p=dropout_p,
            )
            merge_into(Partial(acc.out[:, :, rows], acc.lse[:, :, rows]), part)
            _wait(works)
            kv, spare = spare, kv
        out = acc.out.to(q.dtype)  # the accumulator itself unless 16-bit (strides kept)
        ctx.save_for_backward(q, k, v, out, acc.lse, drop)  # the output kept once, as returned
        ctx.axis, ctx.scale, ctx.kernel, ctx.dropout_p = axis, scale, kernel, dropout_p
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, drop = ctx.saved_tensors
        axis, scale = ctx.axis, ctx.scale
        size, rank, c, cd = axis.size, axis.rank, q.shape[2] // 2, compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=cd, device=q.device)
        kv = torch.stack([k, v])
        spare = torch.empty_like(kv)
        arrived = torch.empty(kv.shape, dtype=cd, device=kv.device)  # the accumulator of this step's block
        done = arrived  # the previous step's block's accumulator, with this rank's share added (from step 1)
        for step in range(size):
            src, sends, recvs = (rank - step) % size, [], []
            if step < size - 1:
                sends.append((kv, KV_TAG, f"kv{src}"))
                recvs.append((spare, KV_TAG, f"kv{(src - 1) % size}"))
            if step > 0:  # the accumulator travels one step behind its block
                sends.append((done, DKV_TAG, f"dkv{(src + 1) % size}"))
                recvs.append((arrived, DKV_TAG, f"dkv{src}"))
            works = _post(axis, sends, recvs, BACKWARD)
            rows, cols, causal = ring_block(rank, src, c)
            gq, gk, gv = block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal=causal,
                scale=scale,
                kernel=ctx.kernel,
                drop=ring_drop(drop, rows, cols, src, size, c),
                dropout_p=ctx.dropout_p,
            )
            dq[:, :, rows] += gq
            share = torch.zeros(kv.shape, dtype=cd, device=kv.device)
            share[0][:, :, cols] = gk
            share[1][:, :, cols] = gv
            _wait(works)
            done = share.add_(arrived) if step > 0 else share
            kv, spare = spare, kv
        if size > 1:  # the last accumulator goes to its owner, the next rank; ours comes from the previous
            own = torch.empty_like(done)
            _wait(_post(axis, [(done, DKV_TAG, f"dkv{(rank + 1) % size}")], [(own, DKV_TAG, f"dkv{rank}")], BACKWARD))
            done = own
        return dq.to(q.dtype), done[0].to(k.dtype), done[1].to(v.dtype), None, None, None, None, None
