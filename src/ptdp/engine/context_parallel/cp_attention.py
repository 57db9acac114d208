"""Causal self-attention across the ranks of the cp axis, each holding 2 chunks of the sequence.

:func:`context_parallel_attention` is the entry; ``comm_type`` (Megatron-Core's ``--cp-comm-type``):

* ``"all_gather"`` (:class:`AllGatherAttention`; Dubey et al. 2024, "The Llama 3 Herd of Models",
  arXiv:2407.21783, §3.3.2): keys and values all-gathered over cp in forward and again in backward
  (only the rank's own are saved), key/value gradients reduce-scattered to their owners.
* ``"p2p"`` (:class:`~ptdp.engine.context_parallel.ring.RingAttention`; Liu et al. 2023, "Ring
  Attention with Blockwise Transformers", arXiv:2310.01889): blocks passed ``C - 1`` times around
  the ring, overlapping the attention; backward passes them again with the gradient accumulators.

The ring cannot deadlock under NCCL's rules: at every step each rank posts one group (sends to the
next rank, receives from the previous, in the same order) and waits for it before the next.
"""

from __future__ import annotations

import torch

from ptdp.engine.comm import AxisGroup, all_gather_along, reduce_scatter_along
from ptdp.engine.context_parallel.blockwise import compute_dtype, default_scale, empty_partial, merge
from ptdp.engine.context_parallel.kernels import block_backward, block_forward, choose
from ptdp.engine.context_parallel.load_balance import chunk_ids
from ptdp.engine.context_parallel.ring import BACKWARD, FORWARD, RingAttention
from ptdp.engine.eager import outside_compile

COMM_TYPES = ("p2p", "all_gather")


def _natural_order(gathered: torch.Tensor, c: int) -> torch.Tensor:
    """Every rank's ``[2, b, kv_heads, 2c, d]`` block (``gathered`` ``[C, 2, ...]``, rank order) as
    the whole sequence in position order ``[2, b, kv_heads, 2C c, d]``."""
    halves = gathered.unflatten(4, (2, c))  # [C, 2, b, kv_heads, 2, c, d]
    chunks = torch.cat([halves[:, :, :, :, 0], halves[:, :, :, :, 1].flip(0)])  # chunk order
    return chunks.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)


def _rank_order(whole: torch.Tensor, size: int, c: int) -> torch.Tensor:
    """The inverse of :func:`_natural_order`: ``[2, b, kv_heads, 2C c, d]`` -> ``[C, 2, b, kv_heads, 2c, d]``."""
    chunks = whole.unflatten(3, (2 * size, c)).permute(3, 0, 1, 2, 4, 5)  # [2C, 2, b, kv_heads, c, d]
    return torch.stack([chunks[:size], chunks[size:].flip(0)], dim=4).flatten(4, 5)


def _key_blocks(chunk: int, c: int) -> list[tuple[slice, bool]]:
    """The key rows (of the whole sequence) a query chunk attends to, as (rows, causal) blocks:
    its own chunk, causal (square, so every kernel takes it), and the chunks before it, full."""
    diagonal = [(slice(chunk * c, (chunk + 1) * c), True)]
    return diagonal + [(slice(0, chunk * c), False)] if chunk else diagonal


def _gather_kv(k: torch.Tensor, v: torch.Tensor, axis: AxisGroup, tag: str) -> torch.Tensor:
    local = torch.stack([k, v]).unsqueeze(0)  # [1, 2, b, kv_heads, 2c, d]: one all-gather
    return _natural_order(all_gather_along(local, axis, dim=0, tag=tag), k.shape[2] // 2)


def _block_drop(drop: torch.Tensor | None, rows: slice, cols: slice) -> torch.Tensor | None:
    """The dropout mask of query rows ``rows`` (local) against key positions ``cols`` (global)."""
    return None if drop is None else drop[:, :, rows, cols]


class AllGatherAttention(torch.autograd.Function):
    """``forward(q, k, v, axis, scale, kernel, drop, dropout_p)``: this rank's attention output
    (``kernel`` "math" or "fused", :mod:`.kernels`); see :func:`context_parallel_attention` for
    shapes and communication."""

    @staticmethod
    def forward(ctx, q, k, v, axis: AxisGroup, scale: float, kernel: str, drop=None, dropout_p: float = 0.0):
        c = q.shape[2] // 2
        whole = _gather_kv(k, v, axis, FORWARD)
        acc = empty_partial(q)
        for half, chunk in enumerate(chunk_ids(axis.rank, axis.size)):
            rows, part = slice(half * c, (half + 1) * c), None
            for cols, causal in _key_blocks(chunk, c):
                block = block_forward(
                    q[:, :, rows],
                    whole[0][:, :, cols],
                    whole[1][:, :, cols],
                    causal=causal,
                    scale=scale,
                    kernel=kernel,
                    drop=_block_drop(drop, rows, cols),
                    dropout_p=dropout_p,
                )
                part = block if part is None else merge(part, block)
            if part is None:  # every chunk sees at least its own (diagonal) key block
                raise ValueError(f"query chunk {chunk} of cp={axis.size} has no key block")
            acc.out[:, :, rows], acc.lse[:, :, rows] = part
        out = acc.out.to(q.dtype)  # the accumulator itself unless 16-bit (strides kept)
        ctx.save_for_backward(q, k, v, out, acc.lse, drop)  # the output kept once, as returned
        ctx.axis, ctx.scale, ctx.kernel, ctx.dropout_p = axis, scale, kernel, dropout_p
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, drop = ctx.saved_tensors
        axis, c, cd = ctx.axis, q.shape[2] // 2, compute_dtype(q.dtype)
        whole = _gather_kv(k, v, axis, BACKWARD)
        dq = torch.zeros(q.shape, dtype=cd, device=q.device)
        dwhole = torch.zeros(whole.shape, dtype=cd, device=q.device)
        for half, chunk in enumerate(chunk_ids(axis.rank, axis.size)):
            rows = slice(half * c, (half + 1) * c)
            for cols, causal in _key_blocks(chunk, c):
                gq, gk, gv = block_backward(
                    dout[:, :, rows],
                    q[:, :, rows],
                    whole[0][:, :, cols],
                    whole[1][:, :, cols],
                    out[:, :, rows],
                    lse[:, :, rows],
                    causal=causal,
                    scale=ctx.scale,
                    kernel=ctx.kernel,
                    drop=_block_drop(drop, rows, cols),
                    dropout_p=ctx.dropout_p,
                )
                dq[:, :, rows] += gq
                dwhole[0][:, :, cols] += gk
                dwhole[1][:, :, cols] += gv
        own = reduce_scatter_along(_rank_order(dwhole, axis.size, c), axis, dim=0, tag=BACKWARD)[0]
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None


@outside_compile
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: AxisGroup,
    comm_type: str = "p2p",
    *,
    scale: float | None = None,
    kernel: str = "auto",
    drop: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal self-attention of a sequence split over the cp ranks of ``axis`` (``C = axis.size``).

    Rank ``r`` holds chunks ``r`` and ``2C - 1 - r`` (:mod:`.load_balance`): ``q [b, heads, s/C, d]``,
    ``k``, ``v [b, kv_heads, s/C, d]`` -> ``[b, heads, s/C, d]`` in q's dtype, the rows of plain causal
    attention at those positions (float32 math, float64 for float64). ``kernel``: ``"auto"``,
    ``"math"`` or ``"fused"`` (:mod:`.kernels`); ``drop``: the rank's rows of the whole mask, bool
    ``[b, heads, s/C, s]``, or None. Communication on ``cp`` (tags ``cp_attention_forward`` and
    ``_backward``; :func:`cp_attention_comm`), with ``E = 2 b kv_heads (s/C) d``, ``e``/``g`` the
    input's/compute dtype's bytes: all_gather: forward all-gather of ``E`` (``E e`` bytes),
    backward all-gather of ``E`` and reduce-scatter of ``C E`` (``C E g``); p2p: forward ``C - 1``
    sends and receives of ``E``, backward ``C - 1`` of ``E`` (``e``) plus ``C`` of ``E`` gradients
    (``g``); none when ``C == 1``. Raises ValueError for an unknown ``comm_type``/``kernel``, bad
    shapes, an odd local length, or a fused kernel on inputs it does not take.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp comm type {comm_type!r} is not one of {COMM_TYPES}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"expected q [b, heads, s/C, d], k and v [b, kv_heads, s/C, d]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % 2 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"the local sequence length {q.shape[2]} must be even (2 chunks) and the query heads "
            f"{q.shape[1]} a multiple of the key/value heads {k.shape[1]}"
        )
    if drop is not None:
        want = (q.shape[0], q.shape[1], q.shape[2], q.shape[2] * axis.size)
        if tuple(drop.shape) != want or drop.dtype != torch.bool:
            raise ValueError(
                f"the dropout mask must be bool [b, heads, s/C, s] = {list(want)}, got {drop.dtype} {list(drop.shape)}"
            )
        if kernel == "fused":
            raise ValueError("attention dropout runs only on the math kernel, not 'fused'")
        kernel = "math"
    scale = default_scale(q.shape[-1]) if scale is None else scale
    fn = RingAttention if comm_type == "p2p" else AllGatherAttention
    return fn.apply(q, k, v, axis, scale, choose(kernel, q), drop, dropout_p)


def cp_attention_comm(
    comm_type: str, *, batch: int, kv_heads: int, local_seq: int, head_dim: int, cp_size: int, dtype: torch.dtype
) -> dict[str, dict[str, int]]:
    """What one forward and backward of :func:`context_parallel_attention` communicates on one
    rank, as :meth:`~ptdp.engine.comm.CommStats.as_dict` gives it (``"cp/op/tag"`` -> calls,
    numel, bytes); empty when ``cp_size == 1``. ``local_seq`` is ``s / C``."""
    if cp_size == 1:
        return {}
    size = cp_size
    elems = 2 * batch * kv_heads * local_seq * head_dim
    e = torch.empty((), dtype=dtype).element_size()
    g = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    fwd, bwd = f"cp/{{}}/{FORWARD}", f"cp/{{}}/{BACKWARD}"

    def count(calls: int, numel: int, nbytes: int) -> dict[str, int]:
        return {"calls": calls, "numel": numel, "bytes": nbytes}

    if comm_type == "all_gather":
        return {
            fwd.format("all_gather"): count(1, elems, elems * e),
            bwd.format("all_gather"): count(1, elems, elems * e),
            bwd.format("reduce_scatter"): count(1, size * elems, size * elems * g),
        }
    if comm_type != "p2p":
        raise ValueError(f"cp comm type {comm_type!r} is not one of {COMM_TYPES}")
    out = {}
    for op in ("send", "recv"):
        out[fwd.format(op)] = count(size - 1, (size - 1) * elems, (size - 1) * elems * e)
        out[bwd.format(op)] = count(2 * size - 1, (2 * size - 1) * elems, (size - 1) * elems * e + size * elems * g)
    return out
