"""Tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

Shoeybi et al., "Megatron-LM", arXiv:1909.08053, §3. With a tp axis of size 1 each layer is an
ordinary single-process layer and communicates nothing. ``sequence_parallel=True``: the
activations outside the layers are split along the sequence over tp (Korthikanti et al. 2022,
§4.2.2; :mod:`ptdp.engine.tensor_parallel.sequence`), so the layers gather their input along the
sequence and reduce-scatter their output instead of the all-reduces.
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.engine.comm import AxisGroup
from ptdp.engine.fp8_layout import split_dim, whole
from ptdp.engine.tensor_parallel.linear import Comm, FP8Settings, LinearPlan, WgradQueue, linear
from ptdp.engine.tensor_parallel.mappings import reduce_from_tp
from ptdp.engine.tensor_parallel.sequence import mark_sequence_parallel, reduce_scatter_sequence
from ptdp.engine.tensor_parallel.sharding import GlobalParam, make_parameter, shard_ranges
from ptdp.engine.tensor_parallel.wgrad import embedding


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by output rows (columns of ``X A^T``) over tp.

    Per rank: input ``[..., in_features]`` (replicated), output ``[..., out_features / tp]``.
    Forward: none; backward: all-reduce of the input gradient (f) on tp, overlapping the
    weight-gradient GEMM. ``fused=3``: q | k | v split separately, so each rank keeps the same
    heads' q, k, v (``fused=2``: SwiGLU's gate | up). ``sequence_parallel``: input
    ``[s/t, b, in_features]``; forward all-gathers it along the sequence, backward all-gathers again
    and reduce-scatters the input gradient. The GEMMs: :mod:`ptdp.engine.tensor_parallel.linear`
    (``fp8``: in FP8; ``wgrad_queue``: where backward may defer the weight gradient).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: AxisGroup,
        dtype: torch.dtype,
        bias: bool = True,
        fused: int = 1,
        init: str = "normal",
        tag: str = "column",
        sequence_parallel: bool = False,
        fp8: FP8Settings | None = None,
        wgrad_queue: WgradQueue | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.tag, self.sequence_parallel = tp, tag, sequence_parallel
        spec = GlobalParam((out_features, in_features), tp_dim=0, tp_groups=fused, init=init)
        self.weight = make_parameter(spec, tp.size, dtype)
        self.bias = (
            make_parameter(GlobalParam((out_features,), tp_dim=0, tp_groups=fused, init="zeros"), tp.size, dtype)
            if bias
            else None
        )
        out_dim = split_dim(out_features, shard_ranges(spec, tp.rank, tp.size), tp)
        self.fp8 = fp8.gemms(out_dim, whole(in_features), tag) if fp8 is not None else None
        comm: Comm = "sequence" if sequence_parallel and tp.size > 1 else "all_reduce" if tp.size > 1 else "local"
        self.plan = LinearPlan(comm, tp, tag, fp8=self.fp8, queue=wgrad_queue)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.plan)


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by input columns over tp; partial outputs summed (g).

    Per rank: input ``[..., in_features / tp]``, output ``[..., out_features]`` (replicated).
    Forward: one all-reduce of the output on tp; backward: none. The bias is added after the sum.
    ``sequence_parallel``: input ``[s, b, in_features / tp]``, output ``[s/t, b, out_features]``;
    forward reduce-scatters along the sequence, backward all-gathers the output gradient; the
    bias gradient is then marked to be summed over tp.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: AxisGroup,
        dtype: torch.dtype,
        bias: bool = True,
        init: str = "scaled_normal",
        tag: str = "row",
        sequence_parallel: bool = False,
        fp8: FP8Settings | None = None,
        wgrad_queue: WgradQueue | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.tag, self.sequence_parallel = tp, tag, sequence_parallel
        spec = GlobalParam((out_features, in_features), tp_dim=1, init=init)
        self.weight = make_parameter(spec, tp.size, dtype)
        self.bias = make_parameter(GlobalParam((out_features,), init="zeros"), tp.size, dtype) if bias else None
        if sequence_parallel and self.bias is not None:
            mark_sequence_parallel([self.bias])
        in_dim = split_dim(in_features, shard_ranges(spec, tp.rank, tp.size), tp)
        self.fp8 = fp8.gemms(whole(out_features), in_dim, tag) if fp8 is not None else None
        self.plan = LinearPlan("local", tp, tag, fp8=self.fp8, queue=wgrad_queue)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # nothing to sum: one fused matmul + bias, as nn.Linear
            return linear(x, self.weight, self.bias, self.plan)
        y = linear(x, self.weight, None, self.plan)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.tp, self.tag)
        else:
            y = reduce_from_tp(y, self.tp, self.tag)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose (padded) vocabulary rows are split over tp.

    Rank r holds rows ``[r * V_pad / tp, (r + 1) * V_pad / tp)`` of the ``[V_pad, h]`` table; rows
    at or past ``vocab_size`` are zero padding. Per rank: ids ``[s, b]`` (replicated), output
    ``[s, b, h]`` (replicated); forward one all-reduce on tp (g), backward none. Also the output
    layer; :meth:`real_weight` gives the real rows. ``sequence_parallel``: output ``[s/t, b, h]``,
    the sum a reduce-scatter along dim 0 (ḡ). A float32 ``weight.main_grad`` receives the weight
    gradient row by row (:class:`~ptdp.engine.tensor_parallel.wgrad.EmbeddingFunction`).
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        hidden_size: int,
        *,
        tp: AxisGroup,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        if padded_vocab_size % tp.size != 0 or padded_vocab_size < vocab_size:
            raise ValueError(f"padded vocab {padded_vocab_size} must be >= {vocab_size} and divisible by tp={tp.size}")
        self.tp, self.vocab_size, self.sequence_parallel = tp, vocab_size, sequence_parallel
        per_rank = padded_vocab_size // tp.size
        self.vocab_start = tp.rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        spec = GlobalParam((padded_vocab_size, hidden_size), tp_dim=0, real_rows=vocab_size)
        self.weight = make_parameter(spec, tp.size, dtype)

    @property
    def num_real_rows(self) -> int:
        """Rows of this rank's shard that are real vocabulary entries (the rest is padding)."""
        return max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)

    def real_weight(self) -> torch.Tensor:
        """This rank's real rows, ``[num_real_rows, h]`` (a view; padding rows get no gradient)."""
        return self.weight[: self.num_real_rows]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = embedding(local, self.weight, outside)
        if self.sequence_parallel:
            return reduce_scatter_sequence(out, self.tp, "embedding")
        return reduce_from_tp(out, self.tp, "embedding")
