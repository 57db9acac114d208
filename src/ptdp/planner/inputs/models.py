"""Model shapes the planner knows by name, and the model description it plans for.

GPT models follow ptdp's GPT (pre-LayerNorm with biases, learned positions, GELU MLP of width
``ffn``, tied embeddings); Llama-style models use RMSNorm without biases, rotary positions (no
position table), a SwiGLU MLP (three ``h x ffn`` matrices) and grouped-query attention with
``num_query_groups`` key/value heads, untied embeddings, no dropout.

Two fields describe how a model was trained rather than its shape, because they change the
activation memory: ``dropout`` (masks kept for backward) and ``flash_attention`` (no score matrix
kept). The presets describe the published runs: the Megatron-paper GPT models with dropout and the
unfused attention of 2021 (scores kept); Llama 2/3 without dropout and with a flash kernel, as
trained and released. ``ptdp plan --use-flash-attn / --no-use-flash-attn`` overrides the kernel
(:mod:`ptdp.commands.plan` also makes flash the default on H100/H200-class GPUs);
:func:`spec_from_model_config` describes ptdp's own GPT.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: The linear layers of a transformer layer: fused QKV, attention output projection, fc1 (GELU's
#: input, or SwiGLU's gate and up), fc2.
LINEARS = ("qkv", "proj", "fc1", "fc2")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    Attributes:
        num_layers, hidden_size, num_attention_heads: l, h, a.
        ffn_hidden_size: MLP width (None: 4h).
        vocab_size: V before padding.
        seq_length: s.
        num_query_groups: key/value heads for grouped-query attention (None: a, multi-head).
        swiglu: gated MLP with three matrices (Llama) instead of two (GPT).
        tied: output layer shares the input embedding.
        llama_style: RMSNorm without biases, rotary positions (no learned position table).
        rmsnorm, linear_bias, learned_positions: the three parts of ``llama_style`` one by one, for
            models that mix them (ptdp's options are independent); None: as ``llama_style`` says.
        biased_linears: the linear layers with a bias, among :data:`LINEARS` (Qwen2: ``("qkv",)``);
            None: all four when :attr:`has_linear_bias`, else none.
        dropout: trained with dropout (hidden, attention and embedding dropout, Megatron's GPT
            defaults): each dropout keeps a 1-byte mask per value for backward. The GPT presets
            keep True (the published runs used dropout); Llama presets and ptdp's GPT without
            dropout set False.
        flash_attention: attention by a fused kernel (FlashAttention, or PyTorch's
            ``scaled_dot_product_attention`` as in ptdp's GPT) that keeps no ``a s x s`` score
            matrix for backward, only a log-sum-exp per head and token, and never writes the
            scores to memory; selective recompute then saves nothing in attention and costs
            nothing (Megatron checkpoints the attention core only with the unfused kernel).
            False: the softmax output (and dropout mask) of the scores is kept, as in the
            published Megatron runs.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    vocab_size: int = 51200
    seq_length: int = 2048
    num_query_groups: int | None = None
    swiglu: bool = False
    tied: bool = True
    llama_style: bool = False
    rmsnorm: bool | None = None
    linear_bias: bool | None = None
    learned_positions: bool | None = None
    biased_linears: tuple[str, ...] | None = None
    dropout: bool = True
    flash_attention: bool = False
    name: str = "custom"

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def uses_rmsnorm(self) -> bool:
        """Norms are RMSNorm (a weight of h) rather than LayerNorm (weight and bias, 2h)."""
        return self.llama_style if self.rmsnorm is None else self.rmsnorm

    @property
    def has_linear_bias(self) -> bool:
        """The linear layers (QKV, attention output, fc1, fc2) have biases."""
        return not self.llama_style if self.linear_bias is None else self.linear_bias

    @property
    def linears_with_bias(self) -> tuple[str, ...]:
        """The linear layers (names of :data:`LINEARS`) that have a bias."""
        if self.biased_linears is not None:
            return self.biased_linears
        return LINEARS if self.has_linear_bias else ()

    @property
    def has_position_table(self) -> bool:
        """A learned ``[s, h]`` position table on the first stage (not with rotary positions)."""
        return not self.llama_style if self.learned_positions is None else self.learned_positions


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers, hidden, heads, vocab_size=51200, seq_length=2048, name=name)


def _llama(name, layers, hidden, heads, groups, ffn, vocab, seq) -> ModelSpec:
    return ModelSpec(
        layers,
        hidden,
        heads,
        ffn,
        vocab,
        seq,
        num_query_groups=groups,
        swiglu=True,
        tied=False,
        llama_style=True,
        dropout=False,
        flash_attention=True,
        name=name,
    )


PRESETS: dict[str, ModelSpec] = {
    # Narayanan et al. SC21 (arXiv:2104.04473), Table 1: vocabulary 51,200, sequence 2,048.
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-3.6b": _gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-18.4b": _gpt("gpt-18.4b", 40, 6144, 48),
    "gpt-39.1b": _gpt("gpt-39.1b", 48, 8192, 64),
    "gpt-76.1b": _gpt("gpt-76.1b", 60, 10240, 80),
    "gpt-145.6b": _gpt("gpt-145.6b", 80, 12288, 96),
    "gpt-310.1b": _gpt("gpt-310.1b", 96, 16384, 128),
    "gpt-529.6b": _gpt("gpt-529.6b", 105, 20480, 128),
    "gpt-1008b": _gpt("gpt-1008b", 128, 25600, 160),
    # Brown et al. 2020 (arXiv:2005.14165) Table 2.1, as trained in Megatron (vocabulary 51,200).
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96),
    # Touvron et al. 2023, Llama 2 (arXiv:2307.09288) and its released configs.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # Llama 3 (Dubey et al. 2024, arXiv:2407.21783, Table 3) and its released configs.
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
}
# Nemotron-4 340B (NVIDIA 2024, arXiv:2406.11704, Table 1: 96 layers, hidden 18432, 96 heads, 8
# key/value heads, sequence 4096, vocabulary 256,000; the model_config.yaml of
# nvidia/Nemotron-4-340B: ffn_hidden_size 73728, squared-ReLU MLP of two matrices, LayerNorm
# (layernorm1p: weight and bias), rotary positions, no linear biases, untied output layer).
PRESETS["nemotron4-340b"] = ModelSpec(
    96,
    18432,
    96,
    73728,
    256000,
    4096,
    num_query_groups=8,
    swiglu=False,
    tied=False,
    rmsnorm=False,
    linear_bias=False,
    learned_positions=False,
    dropout=False,
    flash_attention=True,
    name="nemotron4-340b",
)
PRESETS["gpt-1t"] = PRESETS["gpt-1008b"]
# Llama 3.1 keeps Llama 3's shapes (Dubey et al. 2024, Table 3); its longer context is a later stage.
for _size in ("8b", "70b", "405b"):
    PRESETS[f"llama3.1-{_size}"] = PRESETS[f"llama3-{_size}"]


#: The global batch (sequences per step) each preset was published with, and where: ``ptdp
#: plan``'s default ``--global-batch-size`` for that preset. Llama 3 8B and 70B are absent: the
#: Llama 3 paper gives the batch of 405B only.
PUBLISHED_BATCH: dict[str, tuple[int, str]] = {
    # Narayanan et al. SC21 (arXiv:2104.04473), Table 1, column "Batch size".
    **{
        name: (batch, "Narayanan et al. SC21, Table 1")
        for name, batch in (
            ("gpt-1.7b", 512),
            ("gpt-3.6b", 512),
            ("gpt-7.5b", 512),
            ("gpt-18.4b", 1024),
            ("gpt-39.1b", 1536),
            ("gpt-76.1b", 1792),
            ("gpt-145.6b", 2304),
            ("gpt-310.1b", 2160),
            ("gpt-529.6b", 2520),
            ("gpt-1008b", 3072),
        )
    },
    # GPT-3 175B as Megatron trains it: Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh
    # (--global-batch-size 1536). Brown et al.'s Table 2.1 gives 3.2M tokens, 1,562.5 sequences of 2,048.
    "gpt3-175b": (1536, "Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh"),
    # Touvron et al. 2023 (arXiv:2307.09288), Table 1: "a global batch-size of 4M tokens" for every
    # size, 1,024 sequences of 4,096.
    **{f"llama2-{size}": (1024, "Touvron et al. 2023, Table 1: 4M tokens") for size in ("7b", "13b", "70b")},
    # Dubey et al. 2024 (arXiv:2407.21783), Table 4: 16M tokens per batch at 8,192 tokens (32 per
    # data-parallel rank x dp 64), 2,048 sequences.
    "llama3-405b": (2048, "Dubey et al. 2024, Table 4: 16M tokens"),
    # The model card of nvidia/Nemotron-4-340B-Base: "trained with a global batch-size of 2304, a
    # sequence length of 4096 tokens" (the last stage of the ramp in arXiv:2406.11704, Table 2).
    "nemotron4-340b": (2304, "the nvidia/Nemotron-4-340B-Base model card"),
}


#: Tokens per step of a preset without a published batch: the 4M tokens (4 x 2**20) Touvron et al.
#: 2023 (arXiv:2307.09288, Table 1) give for every Llama 2 size, and Dubey et al. 2024 (section
#: 3.4.1) for Llama 3 405B's first stage.
DEFAULT_TOKENS_PER_STEP = 4 * 2**20


def token_budget_batch(model: ModelSpec) -> tuple[int, str]:
    """(global batch, where it came from) of :data:`DEFAULT_TOKENS_PER_STEP` at ``model``'s sequence length."""
    batch = max(1, DEFAULT_TOKENS_PER_STEP // model.seq_length)
    return batch, (
        f"{model.name} has no published batch: {DEFAULT_TOKENS_PER_STEP // 2**20}M tokens per step in sequences of "
        f"{model.seq_length:,} "
        "(Llama 2's batch, Touvron et al. 2023, Table 1)"
    )


def published_batch(model: ModelSpec) -> tuple[int, str] | None:
    """(global batch, source) published for the preset ``model``, when its shape is the preset's
    (the attention kernel aside); None for a preset without one, a changed shape, other models."""
    preset = PRESETS.get(model.name)
    if preset is None or model.name not in PUBLISHED_BATCH:
        return None
    if replace(model, flash_attention=preset.flash_attention) != preset:
        return None
    return PUBLISHED_BATCH[model.name]


class UnknownModelError(ValueError):
    """A model preset name that does not exist; the message lists the known names."""


def get_model(name: str) -> ModelSpec:
    key = name.lower()
    if key not in PRESETS:
        raise UnknownModelError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]


def _ptdp_options(cfg) -> dict:
    """The Llama-like options of a :class:`ptdp.config.ModelConfig` as ModelSpec fields."""
    rms, rope, bias = cfg.normalization == "RMSNorm", cfg.position_embedding_type == "rope", cfg.add_bias_linear
    return {
        "num_query_groups": cfg.num_query_groups,
        "swiglu": cfg.swiglu,
        "llama_style": rms and rope and not bias,
        "rmsnorm": rms,
        "linear_bias": bias,
        "learned_positions": not rope,
    }


def spec_from_model_config(cfg) -> ModelSpec:
    """The planner's description of ptdp's own GPT for a :class:`ptdp.config.ModelConfig`.

    Dropout is on when ``hidden_dropout`` or ``attention_dropout`` is non-zero (one flag: with
    attention dropout alone the planner still counts the hidden-state masks, ``2 s b h`` bytes per
    layer and microbatch and ``s b h`` for the embedding, which ptdp does not keep then). Without
    attention dropout ptdp's attention is ``torch.nn.functional.scaled_dot_product_attention``, a
    fused kernel that keeps no score matrix (``flash_attention=True``); with it, attention is
    computed explicitly and keeps the probabilities, the mask and the dropped probabilities, as
    an unfused kernel does. With the fused kernel, ptdp's selective recompute still runs it again
    in backward and frees its log-sum-exp, while the planner plans selective recompute with a
    flash kernel as none: it still counts the log-sum-exp (``4 a`` bytes per token and layer)
    and leaves out the repeated attention forward.
    """
    attention_dropout = getattr(cfg, "attention_dropout", 0.0)
    dropout = bool(getattr(cfg, "hidden_dropout", 0.0) or attention_dropout)
    return ModelSpec(
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.ffn,
        cfg.vocab_size,
        cfg.seq_length,
        tied=not cfg.untie_embeddings_and_output_weights,
        dropout=dropout,
        flash_attention=not attention_dropout,
        name="ptdp-gpt",
        **_ptdp_options(cfg),
    )
