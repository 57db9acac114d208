"""A pre-norm GPT: by default LayerNorm, learned positions, a GELU MLP, biases and a tied
input/output embedding; Llama-like options: RMSNorm, a SwiGLU MLP, rotary positions,
grouped-query attention, no linear biases, an untied output layer (:class:`ptdp.config.ModelConfig`).

:class:`GPTModel` is one pipeline stage; parameter names use global layer indices. Per rank:
tokens and labels ``[b, s]``, hidden states ``[s, b, h]`` (sequence-first, as Megatron-LM). Per
layer and microbatch on tp (Shoeybi et al. 2019, §3): forward 2 all-reduces of ``s*b*h``, backward
2. Sequence parallelism (Korthikanti et al. 2022, §4.2.2): hidden states ``[s/t, b, h]``; forward 2
all-gathers and 2 reduce-scatters, backward 2 reduce-scatters and 4 all-gathers. Context
parallelism (size C): hidden states ``[s/C, b, h]``, keys and values exchanged over cp
(:mod:`.attention`), gradients summed over cp by the dp x cp reduction.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.context_parallel.load_balance import rank_positions, shard_sequence
from ptdp.engine.groups import ExpertGroups
from ptdp.engine.model.attention import KVCache
from ptdp.engine.model.layer import TransformerLayer
from ptdp.engine.model.norms import make_norm
from ptdp.engine.model.recompute import run_layers
from ptdp.engine.tensor_parallel.cross_entropy import IGNORE_INDEX
from ptdp.engine.tensor_parallel.layers import VocabParallelEmbedding
from ptdp.engine.tensor_parallel.linear import FP8GEMMs, FP8Settings, WgradQueue
from ptdp.engine.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from ptdp.engine.tensor_parallel.random import Dropout, DropoutRNG
from ptdp.engine.tensor_parallel.sequence import mark_sequence_parallel, sequence_shard
from ptdp.engine.tensor_parallel.sharding import GlobalParam, make_parameter
from ptdp.layout.vocab import padded_vocab_size

__all__ = ["DTYPES", "GPTModel", "masked_mean"]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": torch.float32,
}
"""``params_dtype`` -> torch dtype. ``auto`` is made concrete by ``ptdp.config.resolve`` (bfloat16 on
CUDA); a model built from a config that never went through it is a CPU model: float32."""


class GPTModel(nn.Module):
    """One pipeline stage of GPT (the whole model when ``pre_process`` and ``post_process``).

    ``cfg.vocab_size`` is the real vocabulary; ``layer_ids``: global indices of this stage's
    layers; ``pre_process`` / ``post_process``: first stage (embeddings) / last stage (final norm,
    output layer, loss); ``rng``: dropout streams (None: seed 0); ``sequence_parallel``: stage
    input and output ``[s/t, b, h]`` (``s % tp == 0``); ``cp``: the context-parallel axis (None:
    size 1; :mod:`ptdp.engine.context_parallel.load_balance`), with ``cp_comm_type`` ``"p2p"`` or
    ``"all_gather"``; ``moe``: the mixture-of-experts options (None: dense), ``experts``
    their groups (None: every expert on every rank); ``fp8``: the layers' linear GEMMs in FP8
    (:mod:`ptdp.engine.tensor_parallel.linear`; None: in ``cfg.params_dtype``). With pp > 1 and tied embeddings the last stage's ``word_embeddings`` is a
    copy whose gradient ``ptdp.engine.data_parallel.grads.finalize_grads`` sums with the first stage's.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp: AxisGroup,
        *,
        layer_ids: range,
        pre_process: bool,
        post_process: bool,
        sequence_parallel: bool = False,
        rng: DropoutRNG | None = None,
        cp: AxisGroup | None = None,
        cp_comm_type: str = "p2p",
        moe: MoEConfig | None = None,
        experts: ExpertGroups | None = None,
        fp8: FP8Settings | None = None,
        defer_wgrad: bool = False,
    ) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.cp = cp if cp is not None else AxisGroup.single("cp")
        self.wgrad_queue = WgradQueue(enabled=defer_wgrad)
        """Where this chunk's linear layers defer their weight gradients while it defers (only
        with ``defer_wgrad``: the zero-bubble schedules' B and W)."""
        fp8 = dataclasses.replace(fp8, cp=self.cp) if fp8 is not None else None
        self.sequence_parallel = sp = sequence_parallel and tp.size > 1
        self.pre_process, self.post_process = pre_process, post_process
        dtype = DTYPES[cfg.params_dtype]
        v_pad = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp.size)
        tied = not cfg.untie_embeddings_and_output_weights
        if pre_process or (post_process and tied):
            self.word_embeddings = VocabParallelEmbedding(
                cfg.vocab_size, v_pad, cfg.hidden_size, tp=tp, dtype=dtype, sequence_parallel=sp
            )
            if not pre_process:
                self.word_embeddings.weight.ptdp_tied_copy = True  # type: ignore[attr-defined]
        if pre_process and cfg.position_embedding_type == "learned_absolute":
            spec = GlobalParam((cfg.seq_length, cfg.hidden_size))
            self.position_embeddings = make_parameter(spec, 1, dtype)
            if sp:  # each rank adds the rows of its own positions
                mark_sequence_parallel([self.position_embeddings])
        self.rng = rng if rng is not None else DropoutRNG(0, tp_rank=tp.rank)
        if pre_process:
            self.embedding_dropout = Dropout(cfg.hidden_dropout, self.rng, "embedding")
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    cfg,
                    tp,
                    dtype,
                    sp,
                    layer_id=i,
                    rng=self.rng,
                    cp=self.cp,
                    cp_comm_type=cp_comm_type,
                    moe=moe,
                    experts=experts,
                    fp8=fp8,
                    wgrad_queue=self.wgrad_queue,
                )
                for i in layer_ids
            }
        )
        self.loss_chunk_tokens: int | None = None
        """Tokens per chunk of the output layer + loss (None: a chunk's float32 logits <= 256 MiB)."""
        self.loss_keep_logits: bool | None = None
        """Keep the logits for backward (None: when they take at most 256 MiB, ``keeps_logits``)."""
        if post_process:
            self.final_norm = make_norm(cfg, dtype, sp)
            if not tied:
                self.output_layer = VocabParallelEmbedding(cfg.vocab_size, v_pad, cfg.hidden_size, tp=tp, dtype=dtype)

    def fp8_gemms(self) -> list[FP8GEMMs]:
        """The FP8 state of this chunk's linear layers and experts, in module order (empty without FP8)."""
        found = (getattr(m, name, None) for m in self.modules() for name in ("fp8", "fp8_fc1", "fp8_fc2"))
        return [gemms for gemms in found if isinstance(gemms, FP8GEMMs)]

    def tied_embedding(self) -> nn.Parameter | None:
        """The word-embedding weight whose gradient is summed over the embedding group, if any."""
        if self.cfg.untie_embeddings_and_output_weights or not hasattr(self, "word_embeddings"):
            return None
        return self.word_embeddings.weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: ``x`` is token ids ``[b, s]``; later stages: hidden states ``[s, b, h]``
        (``[s/t, b, h]`` with sequence parallelism).

        Returns hidden states, or on the last stage the mean loss (nats) over the microbatch's
        tokens given ``labels [b, s]`` (``IGNORE_INDEX`` tokens not counted; ValueError for any
        other label outside the vocabulary). With cp (C > 1) hidden states are ``[s/C, b, h]``,
        ``labels`` the whole ``[b, s]``, and the loss this rank's share: its tokens' losses over the
        microbatch's valid token count, so the C ranks' losses sum to the mean (no communication).
        """
        if not self.post_process:
            return self.hidden_states(x)
        if labels is None:
            raise ValueError("the last pipeline stage needs labels to compute the loss")
        mine = shard_sequence(labels, self.cp.rank, self.cp.size, dim=1)
        return masked_mean(self.token_losses(self.hidden_states(x), mine), labels)

    def hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        """The stage without its loss: the embedding (first stage), the layers, and the final norm
        (last stage); what ``--compile`` compiles as one graph where the stage has no collectives
        (:mod:`ptdp.engine.model.compile`)."""
        if self.pre_process:
            x = self.embedding_dropout(self.embed(x))
        cfg = self.cfg  # full recompute runs groups of layers again in backward (ptdp.engine.model.recompute)
        rng = self.rng if cfg.hidden_dropout > 0 or cfg.attention_dropout > 0 else None
        x = run_layers(
            list(self.layers.values()),
            x,
            granularity=cfg.recompute_granularity,
            method=cfg.recompute_method,
            num_layers=cfg.recompute_num_layers,
            rng=rng,
        )
        return self.final_norm(x) if self.post_process else x

    def embed(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """First stage: token ids ``[b, s]`` -> ``[s, b, h]``, the word embeddings of the
        transposed ids plus the learned positions ``[s, 1, h]`` (none with rotary). With sequence
        parallelism ``[s/t, b, h]`` (the sum over tp a reduce-scatter along dim 0); with cp the
        rank's two chunks, ``[s/C, b, h]``, with their global positions. ``start`` (generation,
        cp = 1, no sequence parallelism): the tokens are positions ``start .. start + s - 1``."""
        s, cp = tokens.shape[1], self.cp
        x = self.word_embeddings(shard_sequence(tokens.t(), cp.rank, cp.size, dim=0).contiguous())
        if hasattr(self, "position_embeddings"):
            if cp.size > 1:
                split = self.tp if self.sequence_parallel else AxisGroup.single("tp")
                rows = rank_positions(s, cp.rank, cp.size, tp_rank=split.rank, tp_size=split.size, device=x.device)
                return x + self.position_embeddings.index_select(0, rows).unsqueeze(1)
            held = sequence_shard(s, self.tp) if self.sequence_parallel else slice(start, start + s)
            x = x + self.position_embeddings[held].unsqueeze(1)
        return x

    def transformer_layers(self) -> list[tuple[str, TransformerLayer]]:
        """``(global layer index as a string, layer)`` of this stage, in order."""
        return [(name, cast(TransformerLayer, layer)) for name, layer in self.layers.items()]

    def kv_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty key/value cache for :meth:`decode` of ``batch`` sequences of up to ``max_len``
        positions (``[b, kv/tp, max_len, d]`` per layer, :class:`~.attention.KVCache`). Raises
        ValueError unless this stage is the whole model (pp = 1) with cp = 1, no sequence
        parallelism and ``max_len <= seq_length`` (the positions the model was built for)."""
        if not (self.pre_process and self.post_process) or self.cp.size > 1 or self.sequence_parallel:
            raise ValueError(
                f"a key/value cache needs the whole model (pp = 1), cp = 1 and no sequence parallelism; "
                f"this stage has pre_process={self.pre_process}, post_process={self.post_process}, "
                f"cp={self.cp.size}, sequence_parallel={self.sequence_parallel}"
            )
        if max_len > self.cfg.seq_length:
            raise ValueError(f"max_len={max_len} exceeds the model's seq_length={self.cfg.seq_length}")
        return KVCache({name: layer.attention for name, layer in self.transformer_layers()}, batch, max_len)

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Inference with a key/value cache: token ids ``[b, n]`` at positions ``cache.length ..
        cache.length + n - 1`` -> final-normed hidden states ``[n, b, h]``, equal to the last ``n``
        rows of :meth:`hidden_states` over the whole sequence read so far; ``cache.length`` grows
        by ``n``. Communication: the layers' tp collectives on ``n`` positions. Raises ValueError
        past the cache's ``max_len``, or in training mode with dropout."""
        cfg = self.cfg
        if self.training and (cfg.hidden_dropout > 0 or cfg.attention_dropout > 0):
            raise ValueError("decode runs without dropout: call model.eval() first")
        start, n = cache.length, tokens.shape[1]
        if start + n > cache.max_len:
            raise ValueError(f"the key/value cache holds {cache.max_len} positions; {start} + {n} do not fit")
        x = self.embed(tokens, start)
        for name, layer in self.transformer_layers():
            x = layer.forward_cached(x, cache, name, start)
        cache.length = start + n
        return self.final_norm(x)

    def token_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]`` (a transposed view of the ``[s, b]`` losses) from final hidden
        states ``[s, b, h]`` and ``labels [b, s]``; logits stay sharded.

        One chunked operation on this rank's padded vocabulary shard
        (:func:`~ptdp.engine.tensor_parallel.linear_cross_entropy.linear_cross_entropy`, with
        ``loss_chunk_tokens`` and ``loss_keep_logits``). Communication on tp: forward 3 all-reduces
        of ``s*b``, backward an all-reduce of ``s*b*h`` (tag ``output``); with sequence parallelism
        ``x`` is ``[s/t, b, h]``: forward all-gather, backward all-gather and reduce-scatter.
        """
        out = self.output_layer if hasattr(self, "output_layer") else self.word_embeddings
        losses = linear_cross_entropy(
            x,
            out.weight,
            labels.t(),
            vocab_start=out.vocab_start,
            vocab_size=out.vocab_size,
            axis=self.tp,
            sequence_parallel=self.sequence_parallel,
            chunk_tokens=self.loss_chunk_tokens,
            compiled=self.cfg.compile,
            keep_logits=self.loss_keep_logits,
        )
        return losses.t()


def masked_mean(losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean of the per-token ``losses [b, s]`` over the tokens whose label is not
    :data:`~ptdp.engine.tensor_parallel.cross_entropy.IGNORE_INDEX` (as ``F.cross_entropy``'s mean);
    0 when every label is ignored. No host synchronisation. With context parallelism ``losses``
    are a cp rank's ``[b, s/C]`` (ignored tokens' losses are 0) and ``labels`` the whole
    microbatch's ``[b, s]``: the sum of the rank's losses over the whole microbatch's count."""
    counted = labels != IGNORE_INDEX
    return losses.sum() / counted.sum().clamp(min=1).to(losses.dtype)
