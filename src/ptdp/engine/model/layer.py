"""One pre-norm transformer layer and its parts: the MLP (GELU, or SwiGLU for Llama-like models)
and :class:`TransformerLayer` (norm, attention, residual add, norm, MLP, residual add; the norms
are :mod:`ptdp.engine.model.norms`), split over the tensor-parallel group as
:mod:`ptdp.engine.model.gpt` describes (per-rank shapes ``[s, b, h]``, or ``[s/t, b, h]`` with
sequence parallelism; 2 all-reduces per layer and microbatch in forward and 2 in backward, Shoeybi
et al. 2019, §3). :class:`GPTModel` (:mod:`ptdp.engine.model.gpt`) stacks them into a pipeline stage.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.groups import ExpertGroups
from ptdp.engine.model.attention import Attention, KVCache
from ptdp.engine.model.norms import make_norm
from ptdp.engine.moe.layer import MoELayer
from ptdp.engine.swiglu import swiglu
from ptdp.engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ptdp.engine.tensor_parallel.linear import FP8Settings, WgradQueue
from ptdp.engine.tensor_parallel.random import Dropout, DropoutRNG
from ptdp.engine.tensor_parallel.sequence import mark_sequence_parallel


class MLP(nn.Module):
    """fc1 column-parallel -> activation -> fc2 row-parallel; no communication in between.

    GELU: fc1 is ``[ffn, h]``. SwiGLU (``swiglu``): fc1 is ``[gate | up]``, ``[2 ffn, h]``, each
    half split over tp separately (like the blocks of a fused QKV), so rank r's shard holds the
    gate and up rows of the same ``ffn / tp`` channels and ``silu(gate) * up`` is local.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp: AxisGroup,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        *,
        fp8: FP8Settings | None = None,
        wgrad_queue: WgradQueue | None = None,
    ) -> None:
        super().__init__()
        h, ffn, bias, sp = cfg.hidden_size, cfg.ffn, cfg.add_bias_linear, sequence_parallel
        self.swiglu = cfg.swiglu
        halves = 2 if cfg.swiglu else 1
        self.fc1 = ColumnParallelLinear(
            h,
            halves * ffn,
            tp=tp,
            dtype=dtype,
            bias=bias,
            fused=halves,
            tag="mlp_fc1",
            sequence_parallel=sp,
            fp8=fp8,
            wgrad_queue=wgrad_queue,
        )
        self.fc2 = RowParallelLinear(
            ffn, h, tp=tp, dtype=dtype, bias=bias, tag="mlp_fc2", sequence_parallel=sp, fp8=fp8, wgrad_queue=wgrad_queue
        )
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.swiglu:
            return self.fc2(swiglu(y))
        return self.fc2(F.gelu(y, approximate=self.approximate))


class TransformerLayer(nn.Module):
    """``x + dropout(attn(ln1(x)))`` then ``x + dropout(mlp(ln2(x)))``; ``layer_id``, the global
    layer index, names the layer's dropout streams in ``rng``; with ``moe`` and an MoE layer there
    (``moe.moe_layers``) the MLP is an :class:`~ptdp.engine.moe.layer.MoELayer`."""

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
        moe: MoEConfig | None = None,
        experts: ExpertGroups | None = None,
        fp8: FP8Settings | None = None,
        wgrad_queue: WgradQueue | None = None,
    ) -> None:
        super().__init__()
        rng = rng if rng is not None else DropoutRNG(0, tp_rank=tp.rank)
        sp = sequence_parallel
        self.ln1 = make_norm(cfg, dtype, sp)
        self.attention = Attention(
            cfg,
            tp,
            dtype,
            sp,
            layer_id=layer_id,
            rng=rng,
            cp=cp,
            cp_comm_type=cp_comm_type,
            fp8=fp8,
            wgrad_queue=wgrad_queue,
        )
        self.ln2 = make_norm(cfg, dtype, sp)
        self.mlp: nn.Module
        if moe is not None and moe.moe_layers(cfg.num_layers)[layer_id]:
            shared = None
            if moe.shared_ffn:
                shared_cfg = dataclasses.replace(cfg, ffn_hidden_size=moe.shared_ffn)
                shared = MLP(shared_cfg, tp, dtype, sp, fp8=fp8, wgrad_queue=wgrad_queue)
            self.mlp = MoELayer(
                cfg,
                moe,
                dtype,
                shared=shared,
                layer_id=layer_id,
                tp=tp,
                cp=cp,
                sequence_parallel=sp,
                experts=experts,
                fp8=fp8,
                wgrad_queue=wgrad_queue,
            )
            if sp:  # each tp rank routes its own tokens: the router's gradient, and at ep = etp = 1
                # the replicated experts', sum over tp (else the experts' sum over edp)
                distributed = experts is not None and experts.ep_etp.size > 1
                mark_sequence_parallel(
                    [
                        p
                        for name, p in self.mlp.named_parameters()
                        if name == "router" or not (distributed or name.startswith("shared."))
                    ]
                )
        else:
            self.mlp = MLP(cfg, tp, dtype, sp, fp8=fp8, wgrad_queue=wgrad_queue)
        self.hidden_dropout = Dropout(cfg.hidden_dropout, rng, f"layer.{layer_id}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.hidden_dropout(self.attention(self.ln1(x)))
        return x + self.hidden_dropout(self.mlp(self.ln2(x)))

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: str, start: int) -> torch.Tensor:
        """:meth:`forward` of positions ``start .. start + n - 1`` (``x`` ``[n, b, h]``) over the keys and
        values of ``cache`` (:meth:`Attention.forward_cached`); for inference, in eval mode."""
        x = x + self.hidden_dropout(self.attention.forward_cached(self.ln1(x), cache, layer, start))
        return x + self.hidden_dropout(self.mlp(self.ln2(x)))
