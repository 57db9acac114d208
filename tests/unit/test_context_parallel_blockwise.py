"""Context parallelism without processes: the load-balanced sequence layout, and causal attention
computed block by block with log-sum-exp merging against plain causal attention (float64,
forward and backward, multi-head and grouped-query)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ptdp.engine.context_parallel.blockwise import (
    Partial,
    attention_block,
    attention_block_backward,
    block_attention,
    block_kind,
    blockwise_causal_attention,
    merge,
)
from ptdp.engine.context_parallel.load_balance import (
    check_sequence,
    chunk_ids,
    local_positions,
    shard_sequence,
    unshard_sequence,
)

TOL = dict(rtol=1e-12, atol=1e-12)


# ---- layout ---------------------------------------------------------------------------------------


def test_layout_example_in_docstring():
    assert local_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert chunk_ids(1, 4) == (1, 6)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_partitions_the_sequence_and_balances_causal_work(cp):
    s = 2 * cp * 3
    positions = [local_positions(s, r, cp) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(s))
    work = set()
    for pos in positions:
        assert pos.shape == (s // cp,)
        assert bool((pos[1:] > pos[:-1]).all())  # increasing: local causal == global causal
        work.add(int((pos + 1).sum()))  # keys seen by the rank's queries under a causal mask
    assert len(work) == 1


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_and_unshard(cp):
    s, b = 16, 3
    tokens = torch.arange(b * s).view(b, s)
    seq_first = torch.randn(s, b, 5)
    parts = [shard_sequence(tokens, r, cp, dim=1) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part, tokens[:, local_positions(s, r, cp)])
        assert torch.equal(shard_sequence(seq_first, r, cp, dim=0), seq_first[local_positions(s, r, cp)])
    assert torch.equal(unshard_sequence(parts, dim=1), tokens)
    assert torch.equal(unshard_sequence([shard_sequence(seq_first, r, cp, dim=0) for r in range(cp)], dim=0), seq_first)


def test_one_rank_takes_any_length():
    """As the configuration rule (seq_length % (2 * cp) == 0 only when cp > 1)."""
    x = torch.arange(7)
    assert shard_sequence(x, 0, 1, dim=0) is x and local_positions(7, 0, 1).tolist() == list(range(7))


def test_layout_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"sequence length 12 .* 2 \* cp_size = 2 \* 4 = 8"):
        check_sequence(12, 4)
    with pytest.raises(ValueError, match="sequence length 10"):
        shard_sequence(torch.zeros(2, 10), 0, 4, dim=1)
    with pytest.raises(ValueError, match="cp_size=0"):
        local_positions(8, 0, 0)
    with pytest.raises(ValueError, match="cp_rank 2"):
        chunk_ids(2, 2)


# ---- blockwise attention -----------------------------------------------------------------------------


def _inputs(heads: int, kv_heads: int, s: int = 24, b: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _reference(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _check_against_reference(fn, q, k, v, dout):
    want = _reference(q, k, v, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out.detach(), *(t.grad for t in leaves)), want):
        torch.testing.assert_close(got, ref, **TOL, msg=lambda m, name=name: f"{name}: {m}")


HEADS = pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2)], ids=["mha", "gqa2", "gqa3"])


@HEADS
@pytest.mark.parametrize("blocks", [2, 3, 4, 8])
def test_blockwise_explicit_backward_equals_plain_attention(heads, kv_heads, blocks):
    q, k, v, dout = _inputs(heads, kv_heads)
    sizes = [24 // blocks] * blocks
    _check_against_reference(lambda q, k, v: blockwise_causal_attention(q, k, v, sizes), q, k, v, dout)


@HEADS
@pytest.mark.parametrize("sizes", [[5, 9, 3, 7], [1, 23], [10, 2, 12]])
def test_blockwise_uneven_blocks_use_offset_masks(heads, kv_heads, sizes):
    q, k, v, dout = _inputs(heads, kv_heads)
    _check_against_reference(lambda q, k, v: blockwise_causal_attention(q, k, v, sizes), q, k, v, dout)


@HEADS
@pytest.mark.parametrize("blocks", [2, 3, 4, 8])
def test_blocks_merged_by_autograd_equal_plain_attention(heads, kv_heads, blocks):
    """The partial results and their merge are differentiable torch operations: autograd through
    them gives the same gradients (an independent check of the forward's formulas)."""
    q, k, v, dout = _inputs(heads, kv_heads, seed=1)
    c = 24 // blocks

    def fn(q, k, v):
        rows = []
        for i in range(blocks):
            acc = None
            for j in range(blocks):
                part = block_attention(
                    q[:, :, i * c : (i + 1) * c],
                    k[:, :, j * c : (j + 1) * c],
                    v[:, :, j * c : (j + 1) * c],
                    q_start=i * c,
                    k_start=j * c,
                )
                acc = part if acc is None else acc if part is None else merge(acc, part)
            rows.append(acc.out)
        return torch.cat(rows, dim=2)

    _check_against_reference(fn, q, k, v, dout)


def test_block_kinds():
    assert block_kind(0, 4, 4, 4) == "skip"
    assert block_kind(4, 4, 0, 4) == "full"
    assert block_kind(4, 4, 4, 4) == "causal"
    assert block_kind(4, 4, 0, 8) == "causal"  # bottom-right aligned
    assert block_kind(3, 4, 4, 4) == "masked"
    assert block_kind(4, 4, 1, 4) == "full"  # last key at the first query
    assert block_kind(4, 4, 2, 4) == "masked"


def test_bottom_right_causal_block_and_backward_with_final_statistics():
    """A query chunk over every key up to its own end (what the all-gather variant computes), in
    one block: equal to the rows of plain causal attention, and the explicit backward given the
    final output and log-sum-exp equals autograd's."""
    q, k, v, dout = _inputs(4, 2, s=12)
    rows = slice(8, 12)
    want = _reference(q, k, v, dout)
    part = attention_block(q[:, :, rows], k, v, causal=True, scale=8**-0.5)
    torch.testing.assert_close(part.out, want[0][:, :, rows], **TOL)
    dq, dk, dv = attention_block_backward(
        dout[:, :, rows], q[:, :, rows], k, v, part.out, part.lse, causal=True, scale=8**-0.5
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(
        leaves[0][:, :, rows],
        leaves[1],
        leaves[2],
        attn_mask=torch.ones(4, 12, dtype=torch.bool).tril(8),
        enable_gqa=True,
    ).backward(dout[:, :, rows])
    for got, ref in zip((dq, dk, dv), (leaves[0].grad[:, :, rows], leaves[1].grad, leaves[2].grad)):
        torch.testing.assert_close(got, ref, **TOL)


def test_sixteen_bit_inputs_accumulate_in_float32():
    q, k, v, _ = _inputs(4, 2)
    part = attention_block(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, scale=0.3)
    assert isinstance(part, Partial) and part.out.dtype == part.lse.dtype == torch.float32
    ref = attention_block(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), causal=True, scale=0.3)
    torch.testing.assert_close(part.out.double(), ref.out, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    q, k, v, _ = _inputs(4, 3)
    with pytest.raises(ValueError, match="query heads 4 are not a multiple of key/value heads 3"):
        attention_block(q, k, v, causal=True, scale=1.0)
    q, k, v, _ = _inputs(4, 4)
    with pytest.raises(ValueError, match="block sizes"):
        blockwise_causal_attention(q, k, v, [5, 5])
    with pytest.raises(ValueError, match="no more queries than keys"):
        attention_block(q, k[:, :, :3], v[:, :, :3], causal=True, scale=1.0)


@HEADS
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
@pytest.mark.parametrize("kernel", ["math", "fused"])
def test_cp_attention_on_one_rank_is_plain_causal_attention(heads, kv_heads, comm, kernel):
    from ptdp.engine.comm import AxisGroup
    from ptdp.engine.context_parallel.cp_attention import context_parallel_attention, cp_attention_comm

    axis = AxisGroup.single("cp")
    q, k, v, dout = _inputs(heads, kv_heads, seed=2)
    _check_against_reference(
        lambda q, k, v: context_parallel_attention(q, k, v, axis, comm, kernel=kernel), q, k, v, dout
    )
    assert (
        axis.stats.as_dict()
        == {}
        == cp_attention_comm(comm, batch=2, kv_heads=kv_heads, local_seq=24, head_dim=8, cp_size=1, dtype=torch.float64)
    )


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cp_attention_keeps_its_output_once_in_the_input_dtype(comm, dtype):
    """What the attention core and the output projection keep for backward, as the model calls them
    (q, k, v strided views of one ``[s, b, 3, a, d]`` QKV output; the output permuted to
    ``[s, b, a d]`` for the projection): the QKV output, the attention output once, in the input's
    dtype (the projection's input is a view of it, not a copy) and one log-sum-exp per row in the
    compute dtype; not a float32 accumulator beside a 16-bit copy. Flash attention's accounting,
    which the planner's activation memory uses."""
    from ptdp.engine.activation_meter import SavedActivationMeter
    from ptdp.engine.comm import AxisGroup
    from ptdp.engine.context_parallel.cp_attention import context_parallel_attention

    s, b, a, d = 12, 2, 4, 8
    qkv = torch.randn(s, b, 3, a, d, dtype=dtype, requires_grad=True)
    weight = torch.randn(a * d, a * d, dtype=dtype, requires_grad=True)
    meter = SavedActivationMeter({weight.untyped_storage().data_ptr()})
    with meter.hooks():
        q, k, v = (qkv * 1).permute(2, 1, 3, 0, 4).unbind(0)  # [b, a, s, d] views of the QKV output
        out = context_parallel_attention(q, k, v, AxisGroup.single("cp"), comm, kernel="math")
        y = out.permute(2, 0, 1, 3).flatten(2) @ weight.T  # [s, b, a d], as Attention.forward projects
    e = torch.tensor([], dtype=dtype).element_size()
    lse = b * a * s * 4  # float32 log-sum-exp per row and head
    assert out.dtype == dtype
    assert meter.live == 3 * s * b * a * d * e + s * b * a * d * e + lse, (meter.live, dtype)
    y.sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


def test_cp_attention_bad_input_is_named():
    from ptdp.engine.comm import AxisGroup
    from ptdp.engine.context_parallel.cp_attention import context_parallel_attention

    q, k, v, _ = _inputs(4, 2, s=10)
    with pytest.raises(ValueError, match="'ring' is not one of"):
        context_parallel_attention(q, k, v, AxisGroup.single("cp"), "ring")
    with pytest.raises(ValueError, match="local sequence length 9 must be even"):
        context_parallel_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], AxisGroup.single("cp"))


@HEADS
@pytest.mark.parametrize("causal,n", [(True, 12), (False, 12), (False, 5)])
def test_fused_kernel_equals_math_kernel(heads, kv_heads, causal, n):
    """The fused flash-attention operators as this package calls them (on CPU, float64: the same
    interface as CUDA's) give the math kernel's partial result, and its backward given the final
    statistics of the rows (here two blocks merged) the same gradient terms."""
    from ptdp.engine.context_parallel.kernels import block_backward, block_forward

    q, k, v, dout = _inputs(heads, kv_heads, s=24, seed=3)
    q, dout = q[:, :, 12 : 12 + n], dout[:, :, 12 : 12 + n]
    scale = 0.3
    blocks = [(k[:, :, 12:24], v[:, :, 12:24], causal), (k[:, :, :12], v[:, :, :12], False)]
    final = None
    for kernel in ("math", "fused"):
        parts = [block_forward(q, kb, vb, causal=c, scale=scale, kernel=kernel) for kb, vb, c in blocks]
        if final is None:
            math_parts, final = parts, merge(*parts)
        else:
            for got, want in zip(parts, math_parts):
                torch.testing.assert_close(got.out, want.out, **TOL)
                torch.testing.assert_close(got.lse, want.lse, **TOL)
    for kb, vb, c in blocks:
        got, want = (
            block_backward(dout, q, kb, vb, final.out, final.lse, causal=c, scale=scale, kernel=kernel)
            for kernel in ("fused", "math")
        )
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)


def test_kernel_choice():
    from ptdp.engine.context_parallel.kernels import block_forward, choose

    q = torch.zeros(1, 2, 4, 8)
    assert choose("auto", q) == "math" and choose("fused", q) == "fused"
    with pytest.raises(ValueError, match="'flash' is not one of"):
        choose("flash", q)
    with pytest.raises(ValueError, match="causal blocks only when square, got 4 queries and 8 keys"):
        block_forward(q, torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), causal=True, scale=1.0, kernel="fused")
