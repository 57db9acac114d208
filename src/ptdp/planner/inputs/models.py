"""The models the planner knows by name, as :class:`~ptdp.config.model.ModelConfig` (the model
``ptdp train`` builds), and the global batch each was published with.

The presets describe the published runs: the Megatron-paper GPT models (:func:`gpt`: LayerNorm with
biases, learned positions, GELU, tied embeddings, dropout 0.1, the unfused attention of 2021);
Llama 2/3 (:func:`llama`: RMSNorm, rotary, SwiGLU, grouped-query attention, no biases, untied, no
dropout, a flash kernel). ``ptdp plan --use-flash-attn / --no-use-flash-attn`` overrides the kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.planner.inputs.moe_model import MLA, MoEModel, moe_model

#: Megatron's GPT of 2021 (Narayanan et al. SC21): vocabulary 51,200, sequence 2,048, dropout 0.1
#: on hidden states and attention, the unfused attention kernel
GPT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=51200, seq_length=2048, hidden_dropout=0.1, attention_dropout=0.1, use_flash_attn=False
)


def gpt(num_layers: int, hidden_size: int, num_attention_heads: int, **fields: Any) -> ModelConfig:
    """A GPT as Megatron trained it in 2021 (:data:`GPT_DEFAULTS`), ``fields`` of
    :class:`~ptdp.config.model.ModelConfig` changed."""
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        **{**GPT_DEFAULTS, **fields},
    )


def llama(
    num_layers: int, hidden_size: int, heads: int, groups: int, ffn: int, vocab: int, seq: int, **fields: Any
) -> ModelConfig:
    """A Llama-style model: RMSNorm, rotary positions, SwiGLU, ``groups`` key/value heads, no
    biases, untied, no dropout, a flash kernel."""
    llama_fields: dict[str, Any] = dict(
        num_query_groups=groups,
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        use_flash_attn=True,
    )
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        seq_length=seq,
        **{**llama_fields, **fields},
    )


PRESETS: dict[str, ModelConfig] = {
    # Narayanan et al. SC21 (arXiv:2104.04473), Table 1: vocabulary 51,200, sequence 2,048.
    "gpt-1.7b": gpt(24, 2304, 24),
    "gpt-3.6b": gpt(30, 3072, 32),
    "gpt-7.5b": gpt(36, 4096, 32),
    "gpt-18.4b": gpt(40, 6144, 48),
    "gpt-39.1b": gpt(48, 8192, 64),
    "gpt-76.1b": gpt(60, 10240, 80),
    "gpt-145.6b": gpt(80, 12288, 96),
    "gpt-310.1b": gpt(96, 16384, 128),
    "gpt-529.6b": gpt(105, 20480, 128),
    "gpt-1008b": gpt(128, 25600, 160),
    # Brown et al. 2020 (arXiv:2005.14165) Table 2.1, as trained in Megatron (vocabulary 51,200).
    "gpt3-175b": gpt(96, 12288, 96),
    # Touvron et al. 2023, Llama 2 (arXiv:2307.09288) and its released configs.
    "llama2-7b": llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": llama(40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": llama(80, 8192, 64, 8, 28672, 32000, 4096),
    # Llama 3 (Dubey et al. 2024, arXiv:2407.21783, Table 3) and its released configs.
    "llama3-8b": llama(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": llama(80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": llama(126, 16384, 128, 8, 53248, 128256, 8192),
}
# Nemotron-4 340B (NVIDIA 2024, arXiv:2406.11704, Table 1: 96 layers, hidden 18432, 96 heads, 8
# key/value heads, sequence 4096, vocabulary 256,000; the model_config.yaml of
# nvidia/Nemotron-4-340B: ffn_hidden_size 73728, squared-ReLU MLP of two matrices, LayerNorm
# (layernorm1p: weight and bias), rotary positions, no linear biases, untied output layer).
PRESETS["nemotron4-340b"] = ModelConfig(
    num_layers=96,
    hidden_size=18432,
    num_attention_heads=96,
    ffn_hidden_size=73728,
    vocab_size=256000,
    seq_length=4096,
    num_query_groups=8,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    use_flash_attn=True,
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


def token_budget_batch(name: str, model: ModelConfig) -> tuple[int, str]:
    """(global batch, where it came from) of :data:`DEFAULT_TOKENS_PER_STEP` at ``model``'s sequence
    length (``name``: the preset's)."""
    batch = max(1, DEFAULT_TOKENS_PER_STEP // model.seq_length)
    return batch, (
        f"{name} has no published batch: {DEFAULT_TOKENS_PER_STEP // 2**20}M tokens per step in sequences of "
        f"{model.seq_length:,} "
        "(Llama 2's batch, Touvron et al. 2023, Table 1)"
    )


def published_batch(name: str, model: ModelConfig) -> tuple[int, str] | None:
    """(global batch, source) published for the preset ``name``, when ``model`` is its shape (the
    attention kernel aside); None for a preset without one, a changed shape, other models."""
    preset = PRESETS.get(name)
    if preset is None or name not in PUBLISHED_BATCH:
        return None
    if replace(model, use_flash_attn=preset.use_flash_attn) != preset:
        return None
    return PUBLISHED_BATCH[name]


#: DeepSeek-V3 (arXiv:2412.19437 §2 and §4.2; deepseek-ai/DeepSeek-V3 config.json): 61 layers, the
#: first 3 dense (MLP 18,432), 58 MoE of 256 routed experts (2,048 wide, top 8, sigmoid scores, 8
#: groups of which 4 per token, scale 2.5) and one shared expert; MLA of 128 heads (q rank 1,536,
#: kv rank 512, 128 + 64 query/key channels, 128 value channels); one multi-token-prediction module
#: (the 62nd layer, :attr:`~ptdp.planner.inputs.moe_model.MoEModel.mtp_layers`); vocabulary 129,280,
#: untied. ``kv_channels`` 192 and 128 key/value heads give the attention kernel's shape; the
#: projections are MLA's.
DEEPSEEK_V3 = moe_model(
    llama(62, 7168, 128, 128, 18432, 129280, 4096, kv_channels=192),
    MoEConfig(
        num_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048,
        moe_layer_freq=(0,) * 3 + (1,) * 59,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.5,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_router_enable_expert_bias=True,
    ),
    mla=MLA(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536),
    mtp_layers=1,
)

#: Mixture-of-experts models by name, from the released Hugging Face configs (mistralai/Mixtral-8x7B-v0.1,
#: Mixtral-8x22B-v0.1; Qwen/Qwen2-57B-A14B, Qwen3-30B-A3B, Qwen3-235B-A22B; openai/gpt-oss-120b,
#: gpt-oss-20b; deepseek-ai/DeepSeek-V3; moonshotai/Kimi-K2-Base: DeepSeek-V3's shape with 64 heads,
#: 384 experts and one dense layer), with the totals their model cards give: 46.7B parameters of
#: which 12.9B active per token, 141B / 39B, 57B / 14B, 30.5B / 3.3B, 235B / 22B, 117B / 5.1B, 21B /
#: 3.6B (gpt-oss's active counts leave the embedding out), 671B / 37B (and DeepSeek-V3's 14B MTP
#: module), 1.04T / 32B. Not modelled: Qwen2-MoE's shared-expert gate (h weights per layer),
#: gpt-oss's router bias, attention sinks and the sliding window of every other layer (planned as
#: full attention).
MOE_PRESETS: dict[str, MoEModel] = {
    "mixtral-8x7b": moe_model(llama(32, 4096, 32, 8, 14336, 32000, 4096), MoEConfig(num_experts=8, moe_router_topk=2)),
    "mixtral-8x22b": moe_model(llama(56, 6144, 48, 8, 16384, 32768, 4096), MoEConfig(num_experts=8, moe_router_topk=2)),
    "qwen2-57b-a14b": moe_model(
        llama(28, 3584, 28, 4, 18944, 151936, 4096, linear_biases=("qkv",)),
        MoEConfig(
            num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=2560, moe_shared_expert_intermediate_size=20480
        ),
    ),
    "qwen3-30b-a3b": moe_model(
        llama(48, 2048, 32, 4, 6144, 151936, 4096, kv_channels=128, qk_layernorm=True),
        MoEConfig(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768),
    ),
    "qwen3-235b-a22b": moe_model(
        llama(94, 4096, 64, 4, 12288, 151936, 4096, kv_channels=128, qk_layernorm=True),
        MoEConfig(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536),
    ),
    "gpt-oss-120b": moe_model(
        llama(36, 2880, 64, 8, 2880, 201088, 4096, kv_channels=64, add_bias_linear=True),  # experts' biases too
        MoEConfig(num_experts=128, moe_router_topk=4),
    ),
    "gpt-oss-20b": moe_model(
        llama(24, 2880, 64, 8, 2880, 201088, 4096, kv_channels=64, add_bias_linear=True),  # experts' biases too
        MoEConfig(num_experts=32, moe_router_topk=4),
    ),
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2": moe_model(
        llama(61, 7168, 64, 64, 18432, 163840, 4096, kv_channels=192),
        dataclasses.replace(
            DEEPSEEK_V3.moe,
            num_experts=384,
            moe_layer_freq=(0,) + (1,) * 60,
            moe_router_num_groups=1,
            moe_router_group_topk=1,
            moe_router_topk_scaling_factor=2.827,
        ),
        mla=DEEPSEEK_V3.mla,
    ),
}


class UnknownModelError(ValueError):
    """A model preset name that does not exist (or not yet planned); the message lists the known names."""


def get_model(name: str) -> ModelConfig:
    """The preset ``name`` (any case); :class:`UnknownModelError` naming the known ones, or saying
    that a mixture of experts (:data:`MOE_PRESETS`) is not planned yet."""
    key = name.lower()
    if key in MOE_PRESETS:
        return MOE_PRESETS[key]
    if key not in PRESETS:
        known = sorted([*PRESETS, *MOE_PRESETS])
        raise UnknownModelError(f"unknown model {name!r}; known: {', '.join(known)}")
    return PRESETS[key]


def preset_name(name: str) -> str:
    """The name a preset is reported under: its first name (``gpt-1t`` is ``gpt-1008b``,
    ``llama3.1-8b`` is ``llama3-8b``)."""
    model = get_model(name)
    return next(key for key, preset in {**PRESETS, **MOE_PRESETS}.items() if preset is model)
