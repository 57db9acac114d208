"""A pre-LayerNorm GPT (learned positions, GELU MLP, tied input/output embedding by default).

:class:`GPTModel` is one pipeline stage: it holds the layers ``layer_ids`` and, on the first stage,
the embeddings, and on the last stage the final LayerNorm, the output layer and the loss. With
tp = pp = 1 it is an ordinary single-process GPT: the tensor-parallel layers then communicate
nothing. Parameter names use global layer indices (``layers.5.mlp.fc1.weight``) so they do not
depend on the layout.

Per-rank shapes: tokens and labels ``[b, s]``; hidden states ``[b, s, h]`` (replicated over tp);
attention runs on the ``a / tp`` local heads, the MLP on ``ffn / tp`` local channels.
Communication per layer and microbatch (Shoeybi et al. 2019, §3): forward 2 all-reduces of
``b*s*h`` elements on tp (after attention and after the MLP), backward 2 (before QKV and fc1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.comm import AxisGroup
from ptdp.config import ModelConfig, padded_vocab_size
from ptdp.tensor_parallel import (
    ColumnParallelLinear,
    ParamSpec,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    vocab_parallel_cross_entropy,
)
from ptdp.tensor_parallel.sharding import make_parameter

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LayerNorm(nn.Module):
    """LayerNorm with parameters replicated on every tp rank."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_parameter(ParamSpec((hidden_size,), init="ones"), 1, dtype)
        self.bias = make_parameter(ParamSpec((hidden_size,), init="zeros"), 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Attention(nn.Module):
    """Causal self-attention split by heads: QKV column-parallel, output projection row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: AxisGroup, dtype: torch.dtype) -> None:
        super().__init__()
        h, a = cfg.hidden_size, cfg.num_attention_heads
        self.local_heads, self.head_dim = a // tp.size, h // a
        self.qkv = ColumnParallelLinear(h, 3 * h, tp=tp, dtype=dtype, fused=3, tag="attn_qkv")
        self.proj = RowParallelLinear(h, h, tp=tp, dtype=dtype, tag="attn_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.local_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, a/tp, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    """fc1 column-parallel -> GELU -> fc2 row-parallel; no communication before the GELU."""

    def __init__(self, cfg: ModelConfig, tp: AxisGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn, tp=tp, dtype=dtype, tag="mlp_fc1")
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden_size, tp=tp, dtype=dtype, tag="mlp_fc2")
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class TransformerLayer(nn.Module):
    """``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: ModelConfig, tp: AxisGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln1 = LayerNorm(cfg.hidden_size, cfg.layernorm_epsilon, dtype)
        self.attention = Attention(cfg, tp, dtype)
        self.ln2 = LayerNorm(cfg.hidden_size, cfg.layernorm_epsilon, dtype)
        self.mlp = MLP(cfg, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTModel(nn.Module):
    """One pipeline stage of GPT (the whole model when ``pre_process`` and ``post_process``).

    Args:
        cfg: model shape; ``vocab_size`` here is the real (tokenizer) vocabulary.
        tp: tensor-parallel axis.
        layer_ids: global indices of the transformer layers on this stage.
        pre_process: this is the first stage (token and position embeddings).
        post_process: this is the last stage (final LayerNorm, output layer, loss).

    On the last stage of a pipeline with pp > 1 and tied embeddings, ``word_embeddings`` is a copy
    of the first stage's; its gradient must be summed with the first stage's after backward
    (``ptdp.data_parallel.grads.finalize_grads``) so both copies stay bitwise equal.
    """

    def __init__(
        self, cfg: ModelConfig, tp: AxisGroup, *, layer_ids: range, pre_process: bool, post_process: bool
    ) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.pre_process, self.post_process = pre_process, post_process
        dtype = DTYPES[cfg.params_dtype]
        v_pad = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp.size)
        tied = not cfg.untie_embeddings_and_output_weights
        if pre_process or (post_process and tied):
            self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, v_pad, cfg.hidden_size, tp=tp, dtype=dtype)
            if not pre_process:
                self.word_embeddings.weight.ptdp_tied_copy = True
        if pre_process:
            spec = ParamSpec((cfg.seq_length, cfg.hidden_size))
            self.position_embeddings = make_parameter(spec, 1, dtype)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, tp, dtype) for i in layer_ids})
        if post_process:
            self.final_norm = LayerNorm(cfg.hidden_size, cfg.layernorm_epsilon, dtype)
            if not tied:
                self.output_layer = VocabParallelEmbedding(cfg.vocab_size, v_pad, cfg.hidden_size, tp=tp, dtype=dtype)

    def tied_embedding(self) -> nn.Parameter | None:
        """The word-embedding weight whose gradient is summed over the embedding group, if any."""
        if self.cfg.untie_embeddings_and_output_weights or not hasattr(self, "word_embeddings"):
            return None
        return self.word_embeddings.weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: ``x`` is token ids ``[b, s]``; later stages: hidden states ``[b, s, h]``.

        Returns hidden states ``[b, s, h]``, or on the last stage the mean loss over the ``b*s``
        tokens (a scalar, nats) given ``labels [b, s]``.
        """
        if self.pre_process:
            x = self.word_embeddings(x) + self.position_embeddings[: x.shape[1]]
        for layer in self.layers.values():
            x = layer(x)
        if not self.post_process:
            return x
        if labels is None:
            raise ValueError("the last pipeline stage needs labels to compute the loss")
        return self.token_losses(self.final_norm(x), labels).mean()

    def token_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]`` from final hidden states ``[b, s, h]``; logits stay sharded.

        Communication: backward all-reduce of ``b*s*h`` (f before the output layer); forward 3
        all-reduces of ``b*s`` in the vocab-parallel cross entropy; all on tp.
        """
        out = self.output_layer if hasattr(self, "output_layer") else self.word_embeddings
        logits = F.linear(copy_to_tp(x, self.tp, "output"), out.real_weight())
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return vocab_parallel_cross_entropy(logits, labels, vocab_start=out.vocab_start, axis=self.tp)
