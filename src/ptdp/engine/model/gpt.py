"""A pre-norm GPT: by default LayerNorm, learned positions, a GELU MLP, biases and a tied
input/output embedding; Llama-like options: RMSNorm, a SwiGLU MLP, rotary positions,
grouped-query attention, no linear biases, an untied output layer (:class:`ptdp.config.ModelConfig`).

:class:`GPTModel` is one pipeline stage: it holds the layers ``layer_ids`` and, on the first stage,
the embeddings, and on the last stage the final LayerNorm, the output layer and the loss. With
tp = pp = 1 it is an ordinary single-process GPT: the tensor-parallel layers then communicate
nothing. Parameter names use global layer indices (``layers.5.mlp.fc1.weight``) so they do not
depend on the layout.

Per-rank shapes: tokens and labels ``[b, s]``; hidden states sequence-first, ``[s, b, h]``, as in
Megatron-LM (replicated over tp): the embedding looks up the transposed token ids, so its output
is already ``[s, b, h]``, and every layer (norms, attention, MLP, residual adds, dropout) and the
pipeline transfers keep that layout; attention permutes its heads to the ``[b, heads, s, d]``
that ``scaled_dot_product_attention`` takes and back; the loss gives per-token losses in the
labels' ``[b, s]`` order. Attention runs on the ``a / tp`` local query heads (and ``G / tp``
key/value heads with grouped-query attention), the MLP on ``ffn / tp`` local channels.
Communication per layer and microbatch (Shoeybi et al. 2019, §3): forward 2 all-reduces of
``s*b*h`` elements on tp (after attention and after the MLP), backward 2 (before QKV and fc1).

Dropout (``hidden_dropout``, ``attention_dropout``; off by default) draws its masks from the
:class:`~ptdp.engine.tensor_parallel.random.DropoutRNG` passed in: the hidden states after the
embeddings, after the attention projection and after fc2 (before the residual adds) from the
layer's hidden-state stream, the attention probabilities from per-head streams. It acts only in
training mode; evaluation runs ``model.eval()``.

Sequence parallelism (``sequence_parallel``; Korthikanti et al. 2022, §4.2.2,
:mod:`ptdp.engine.tensor_parallel.sequence`): hidden states outside attention and MLP are
``[s/t, b, h]``, this tp rank's positions (a contiguous block of dim 0: the gathers and scatters
along the sequence copy nothing), and so are the stage's input and output. Per layer and
microbatch: forward 2 all-gathers along the sequence (into QKV and fc1) and 2 reduce-scatters (out
of the attention projection and fc2); backward 2 reduce-scatters, 2 all-gathers and 2 all-gathers
again of the QKV and fc1 inputs (kept as shards). Norm weights and biases, the biases of the
attention projection and fc2 and the learned positions are marked ``ptdp_sequence_parallel``: their
gradients are summed over tp after backward.

Context parallelism (``cp`` of size C > 1; :mod:`ptdp.engine.context_parallel`): the first stage
takes the whole ``[b, s]`` tokens and the last stage the whole labels, each keeping this cp rank's
chunks ``r`` and ``2C - 1 - r`` of the sequence; hidden states, the stage's input and output are
``[s/C, b, h]`` (``[s/(C t), b, h]`` with sequence parallelism, which then gathers and scatters a
cp rank's ``s/C`` rows over tp); learned and rotary positions are each row's global position;
attention exchanges keys and values over cp (:mod:`.attention`); the loss is the rank's share of
the microbatch's mean (:meth:`GPTModel.forward`). Dropout masks are those of the unsplit model
(:mod:`ptdp.engine.tensor_parallel.random`). Parameters are replicated over cp; their gradients
are summed over cp by the data-parallel reduction over dp x cp.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ptdp.config.model import ModelConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.context_parallel.load_balance import rank_positions, shard_sequence
from ptdp.engine.model.attention import KVCache
from ptdp.engine.model.layer import TransformerLayer, make_norm
from ptdp.engine.model.recompute import run_layers
from ptdp.engine.tensor_parallel.cross_entropy import IGNORE_INDEX
from ptdp.engine.tensor_parallel.layers import VocabParallelEmbedding
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

    Args:
        cfg: model shape; ``vocab_size`` here is the real (tokenizer) vocabulary.
        tp: tensor-parallel axis.
        layer_ids: global indices of the transformer layers on this stage.
        pre_process: this is the first stage (token embeddings, and learned positions unless
            they are rotary).
        post_process: this is the last stage (final norm, output layer, loss).
        rng: this rank's dropout streams, shared by its model chunks (None: streams of seed 0, for
            a model used outside a training run).
        sequence_parallel: split the hidden states outside attention and MLP along the sequence
            over tp (needs ``s % tp == 0``); the stage's input and output are then ``[s/t, b, h]``.
        cp: the context-parallel axis (None: size 1). With C > 1 this rank computes its two
            chunks of every sequence (:mod:`ptdp.engine.context_parallel.load_balance`): the first stage
            takes the whole ``[b, s]`` tokens and keeps its ``s/C``; hidden states, the stage's
            input and output are ``[s/C, b, h]`` (``[s/(C t), b, h]`` with sequence parallelism,
            needing ``s % (C t) == 0``); positions are global.
        cp_comm_type: how attention exchanges keys and values over ``cp`` (``"p2p"`` or
            ``"all_gather"``).

    On the last stage of a pipeline with pp > 1 and tied embeddings, ``word_embeddings`` is a copy
    of the first stage's; its gradient must be summed with the first stage's after backward
    (``ptdp.engine.data_parallel.grads.finalize_grads``) so both copies stay bitwise equal.
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
    ) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.cp = cp if cp is not None else AxisGroup.single("cp")
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
                    cfg, tp, dtype, sp, layer_id=i, rng=self.rng, cp=self.cp, cp_comm_type=cp_comm_type
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

    def tied_embedding(self) -> nn.Parameter | None:
        """The word-embedding weight whose gradient is summed over the embedding group, if any."""
        if self.cfg.untie_embeddings_and_output_weights or not hasattr(self, "word_embeddings"):
            return None
        return self.word_embeddings.weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: ``x`` is token ids ``[b, s]``; later stages: hidden states ``[s, b, h]``
        (``[s/t, b, h]`` with sequence parallelism).

        Returns hidden states ``[s, b, h]`` (``[s/t, b, h]``), or on the last stage the mean loss
        over the microbatch's ``b*s`` tokens (a scalar, nats) given ``labels [b, s]``; tokens
        labelled -100 (``IGNORE_INDEX``) count neither in the sum nor in the number of tokens.
        Raises ValueError for any other label outside the vocabulary.

        With context parallelism (C > 1) the hidden states are ``[s/C, b, h]`` (``[s/(C t), b, h]``),
        ``labels`` are still the whole ``[b, s]``, and the loss is this rank's share: the sum of
        the losses of its ``s/C`` tokens divided by the valid tokens of the whole microbatch
        (counted locally from ``labels``, no communication), so the C ranks' losses sum to the
        microbatch's mean and their gradients, summed over cp, to its gradient.
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
        transposed ids (only the ``s b`` ids are copied, sequence-first; the lookup then writes
        ``[s, b, h]`` rows directly, no transpose of its output) plus the learned positions
        ``[s, 1, h]`` (none with rotary positions, which act inside attention). With sequence
        parallelism ``[s/t, b, h]``: the embedding's sum over tp is a reduce-scatter along the
        sequence (dim 0), and each rank adds the positions it holds. With context parallelism the
        rank keeps the ids of its two chunks first (``[s/C, b, h]``, or ``[s/(C t), b, h]``) and
        adds the learned rows of their global positions. ``start`` (generation with a key/value
        cache; cp = 1, no sequence parallelism): the tokens are positions ``start .. start + s - 1``."""
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
        rows of :meth:`hidden_states` over the whole sequence read so far. Each layer writes the new
        keys and values into ``cache`` in place; ``cache.length`` grows by ``n``. A prefill is
        ``n`` = the prompt on an empty cache, a generation step ``n = 1``. Communication: the
        layers' tp collectives on ``n`` positions. No host synchronisation (positions are host
        integers). Raises ValueError past the cache's ``max_len``, or in training mode with dropout
        (the cached path never drops)."""
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

        The output layer and the cross entropy run as one chunked operation on this rank's padded
        vocabulary shard, the padding columns masked to ``-inf``
        (:func:`~ptdp.engine.tensor_parallel.linear_cross_entropy.linear_cross_entropy`): at most
        ``loss_chunk_tokens`` tokens' logits are turned into float32 at a time; the logits in the
        compute dtype are kept for backward when they take at most 256 MiB, else recomputed
        chunk by chunk (``loss_keep_logits``). Communication: backward all-reduce of ``s*b*h`` (f before the output layer,
        tag ``output``); forward 3 all-reduces of ``s*b`` (max, target logit, sum of
        exponentials); all on tp. With sequence parallelism ``x`` is ``[s/t, b, h]``, gathered
        along the sequence into the output layer (forward all-gather; backward all-gather again
        and reduce-scatter, tag ``output``).
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
