"""Causal self-attention of the GPT layers, split over tp by heads and, with context
parallelism, over cp by sequence chunks (:class:`Attention`; the model is :mod:`.gpt`).

Communication: the projections' tensor-parallel collectives; with cp > 1 the key/value exchange
of :func:`~ptdp.engine.context_parallel.cp_attention.context_parallel_attention`. For generation,
:class:`KVCache` holds the keys and values already read and :meth:`Attention.forward_cached` runs
only the new positions against them (not module state).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config.model import ModelConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.context_parallel.cp_attention import context_parallel_attention
from ptdp.engine.context_parallel.load_balance import local_positions
from ptdp.engine.model.norms import make_norm
from ptdp.engine.model.recompute import recomputed
from ptdp.engine.model.rotary import RotaryEmbedding
from ptdp.engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ptdp.engine.tensor_parallel.linear import FP8Settings, WgradQueue
from ptdp.engine.tensor_parallel.random import DropoutRNG
from ptdp.engine.tensor_parallel.sequence import mark_sequence_parallel


class Attention(nn.Module):
    """Causal self-attention split by heads: QKV column-parallel, output projection row-parallel.

    Heads have ``d`` channels (``cfg.head_dim``: ``kv_channels``, else ``h / a``); the output
    projection reads ``a d``. Multi-head: the fused projection is ``[q | k | v]`` (``a d`` rows
    each), each block split over tp, so a rank holds its ``a / tp`` heads' q, k, v. Grouped-query
    with G groups: laid out ``[q of the a/G heads of group 0, k_0, v_0, q of group 1, k_1, v_1,
    ...]`` (``d`` rows per head) and split contiguously, so a rank holds ``G / tp`` whole groups
    (query head i uses key/value head ``i // (a/G)``). With ``qk_layernorm`` each head's q and k are
    normalized over their ``d`` channels before rotary positions (``q_norm``, ``k_norm``: replicated
    weights; each rank's gradient covers its own heads, so it is summed over tp after backward, as
    the sequence-parallel ones are). Attention dropout uses stream ``layer.<i>/head<j>`` for global
    head ``j``. Input and output ``[s, b, h]`` (``[s/t, b, h]`` with ``sequence_parallel``). With cp
    of size C > 1: this rank's ``s/C`` rows (chunks ``r`` and ``2C - 1 - r``), the core being
    :func:`~ptdp.engine.context_parallel.cp_attention.context_parallel_attention` over ``cp``
    (its docstring gives the bytes); dropout masks are the whole attention's rows ``[b, a/t, s/C, s]``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp: AxisGroup,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        *,
        layer_id: int = 0,
        rng: DropoutRNG | None = None,
        cp: AxisGroup | None = None,
        cp_comm_type: str = "p2p",
        fp8: FP8Settings | None = None,
        wgrad_queue: WgradQueue | None = None,
    ) -> None:
        super().__init__()
        self.cp, self.cp_comm_type = cp if cp is not None else AxisGroup.single("cp"), cp_comm_type
        h, a, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.local_heads, self.head_dim = a // tp.size, d
        self.grouped = cfg.num_query_groups is not None
        self.local_groups = cfg.kv_heads // tp.size
        rows, fused = ((a + 2 * cfg.kv_heads) * d, 1) if self.grouped else (3 * a * d, 3)
        bias = cfg.add_bias_linear
        sp = sequence_parallel
        self.qkv = ColumnParallelLinear(
            h,
            rows,
            tp=tp,
            dtype=dtype,
            bias=bias,
            fused=fused,
            tag="attn_qkv",
            sequence_parallel=sp,
            fp8=fp8,
            wgrad_queue=wgrad_queue,
        )
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_layernorm:
            self.q_norm, self.k_norm = make_norm(cfg, dtype, width=d), make_norm(cfg, dtype, width=d)
            if tp.size > 1:  # each tp rank normalizes its own heads: the gradients are partial sums
                mark_sequence_parallel([*self.q_norm.parameters(), *self.k_norm.parameters()])
        self.proj = RowParallelLinear(
            a * d,
            h,
            tp=tp,
            dtype=dtype,
            bias=bias,
            tag="attn_proj",
            sequence_parallel=sp,
            fp8=fp8,
            wgrad_queue=wgrad_queue,
        )
        rope = cfg.position_embedding_type == "rope"
        self.rotary = RotaryEmbedding(self.head_dim, cfg.rotary_base) if rope else None
        self.recompute_core = cfg.recompute_granularity == "selective"
        self.dropout_p, self.dropout_key = cfg.attention_dropout, f"layer.{layer_id}"
        self.rng = rng if rng is not None else DropoutRNG(0, tp_rank=tp.rank)
        self.first_head = tp.rank * self.local_heads

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's fused projection ``[s, b, rows / tp]`` -> q ``[b, a/tp, s, d]`` and k, v
        ``[b, kv/tp, s, d]`` (kv = G, or a without groups): strided views of it (permuted, not
        copied; grouped q is reshaped, a copy)."""
        s, b, _ = qkv.shape
        if not self.grouped:
            q, k, v = qkv.view(s, b, 3, self.local_heads, self.head_dim).permute(2, 1, 3, 0, 4).unbind(0)
            return q, k, v
        per_group = self.local_heads // self.local_groups
        qkv = qkv.view(s, b, self.local_groups, per_group + 2, self.head_dim)
        q = qkv[:, :, :, :per_group].reshape(s, b, self.local_heads, self.head_dim)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[b, a/tp, n, d]``, k and v ``[b, kv/tp, n, d]`` of ``x`` ``[n, b, h]`` (:meth:`split_heads`
        of the QKV projection), q and k normalized per head with ``qk_layernorm``."""
        q, k, v = self.split_heads(self.qkv(x))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.rotary is not None:
            where = {"cp_rank": self.cp.rank, "cp_size": self.cp.size}
            q, k = self.rotary(q, **where), self.rotary(k, **where)
        rng = self.rng if self.dropout_p > 0 else None  # the recompute replays the masks
        out = recomputed(self.core, q, k, v, rng=rng) if self.recompute_core else self.core(q, k, v)
        return self.proj(out.permute(2, 0, 1, 3).flatten(2))  # [b, a/tp, s, d] -> [s, b, a/tp * d]

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: str, start: int) -> torch.Tensor:
        """Inference over a key/value cache: ``x`` ``[n, b, h]`` the hidden states of positions
        ``start .. start + n - 1`` -> ``[n, b, h]``, equal to the rows of :meth:`forward` over the
        whole sequence (no dropout, cp = 1, no sequence parallelism). The new keys and values are
        written into ``cache``'s ``[b, kv/tp, max_len, d]`` buffers at rows ``start ..`` and the
        queries attend to rows ``0 .. start + n - 1`` (:func:`cached_attention`). Communication: the
        projections' tp collectives, as in :meth:`forward`, on ``n`` positions."""
        q, k, v = self.project(x)
        if self.rotary is not None:
            q, k = self.rotary.forward_at(q, start, cache.max_len), self.rotary.forward_at(k, start, cache.max_len)
        keys, values = cache.write(layer, start, k, v)
        out = cached_attention(q, keys, values, start, grouped=self.grouped)
        return self.proj(out.permute(2, 0, 1, 3).flatten(2))  # [b, a/tp, n, d] -> [n, b, a/tp * d]

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core, causal ``softmax(q k^T / sqrt(d)) v`` (q ``[b, a/tp, s, d]``, k and v
        ``[b, kv/tp, s, d]``; ``s/C`` rows with context parallelism, attending to the keys of every
        cp rank): what selective recompute runs again in backward (``recompute_core``), its cp
        communication included."""
        if self.cp.size > 1:
            drop = self.cp_dropout_masks(q) if self.training and self.dropout_p > 0 else None
            return context_parallel_attention(q, k, v, self.cp, self.cp_comm_type, drop=drop, dropout_p=self.dropout_p)
        if self.training and self.dropout_p > 0:
            return self.core_with_dropout(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)

    def cp_dropout_masks(self, q: torch.Tensor) -> torch.Tensor:
        """Context parallelism: the attention-dropout masks of this rank's query rows, bool
        ``[b, a/t, s/C, s]`` (True: dropped), cut from each local head's ``[b, s, s]`` mask of the
        unsplit model (``layer.<i>/head<j>`` streams)."""
        b, n, size = q.shape[0], q.shape[2], self.cp.size
        rows = local_positions(n * size, self.cp.rank, size, device=q.device)
        return self.rng.head_masks(
            b,
            n * size,
            n * size,
            self.dropout_p,
            self.dropout_key,
            first_head=self.first_head,
            heads=self.local_heads,
            rows=rows,
        )

    def core_with_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The core written out, ``dropout(softmax(causal(q k^T / sqrt(d)))) v``: the fused
        kernel's own dropout would draw from torch's default generator, not from the per-head
        streams. Keeps the probabilities ``[b, a/tp, s, s]``, the 1-byte mask and the dropped
        probabilities for backward."""
        if self.grouped:  # query head i reads key/value head i // (a/G)
            per_group = self.local_heads // self.local_groups
            k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        s = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        probs = self.rng.head_dropout(probs, self.dropout_p, self.dropout_key, first_head=self.first_head)
        return probs @ v


class KVCache:
    """Keys and values of the positions a model has read, for generation: per layer one
    preallocated ``[b, kv/tp, max_len, d]`` buffer of keys and one of values (this tp rank's
    key/value heads), written in place. ``length``: positions held (a host integer). Memory:
    ``2 * l * b * (kv/tp) * max_len * d`` elements per rank. Built by
    :meth:`~ptdp.engine.model.gpt.GPTModel.kv_cache`, filled by
    :meth:`~ptdp.engine.model.gpt.GPTModel.decode`; ``length = 0`` starts it again.
    """

    def __init__(self, attention: dict[str, Attention], batch: int, max_len: int) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"a key/value cache needs batch >= 1 and max_len >= 1, got {batch} and {max_len}")
        self.max_len, self.length = max_len, 0
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        for name, attn in attention.items():
            heads = attn.local_groups if attn.grouped else attn.local_heads
            weight = attn.qkv.weight
            shape = (batch, heads, max_len, attn.head_dim)
            self.keys[name] = torch.empty(shape, dtype=weight.dtype, device=weight.device)
            self.values[name] = torch.empty(shape, dtype=weight.dtype, device=weight.device)

    def write(self, layer: str, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies ``k``, ``v`` ``[b, kv/tp, n, d]`` into ``layer``'s rows ``start .. start + n - 1``
        and returns the views of rows ``0 .. start + n - 1`` (no copy). Raises ValueError past
        ``max_len`` (checked on host integers)."""
        n = k.shape[-2]
        if start + n > self.max_len:
            raise ValueError(
                f"the key/value cache holds {self.max_len} positions; positions {start}..{start + n - 1} do not fit"
            )
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, start : start + n].copy_(k)
        values[:, :, start : start + n].copy_(v)
        return keys[:, :, : start + n], values[:, :, : start + n]


def cached_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, *, grouped: bool
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` of queries ``[b, a/tp, n, d]`` at positions ``start ..
    start + n - 1`` over the cached keys and values ``[b, kv/tp, start + n, d]``, causal in absolute
    positions: query ``i`` reads keys ``0 .. start + i``. A prefill (``start == 0``) is the causal
    kernel of training; one new position reads every cached key (no mask); several new positions
    after a prefix take a boolean mask ``[n, start + n]`` (SDPA's ``is_causal`` would align the
    diagonal to the top left). Returns ``[b, a/tp, n, d]``."""
    n, total = q.shape[-2], keys.shape[-2]
    if start == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=grouped)
    mask = None
    if n > 1:
        rows = torch.arange(start, start + n, device=q.device).unsqueeze(1)
        mask = torch.arange(total, device=q.device) <= rows
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=grouped)
