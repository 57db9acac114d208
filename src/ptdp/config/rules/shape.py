"""Rules of the model: its shape against tp and pp, the Llama-like options, recompute and the
model settings ``ptdp train`` refuses (Shoeybi et al., arXiv:1909.08053; Korthikanti et al. 2022,
arXiv:2205.05198)."""

from __future__ import annotations

from ptdp.config.fields import (
    ACTIVATIONS,
    DTYPES,
    MIN_VOCAB_SIZE,
    NORMALIZATIONS,
    POSITION_EMBEDDINGS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
)
from ptdp.config.model import AUTO_DTYPE, ModelConfig
from ptdp.errors import ConfigError, V, Violation
from ptdp.layout.pipeline.partition import layer_split, stage_layer_counts


def model_violations(
    m: ModelConfig,
    tp: int,
    pp: int,
    split: tuple[int, ...] | None,
    *,
    first: int | None = None,
    last: int | None = None,
    embedding: bool = False,
    loss: bool = False,
) -> list[Violation]:
    """Rules tying the model to tp and pp (heads, hidden, ffn, layers per stage, vocabulary, dtype;
    the Llama-like options are :func:`llama_option_violations`);
    ``first``/``last``: the first/last stage's layers, ``embedding``/``loss``: counted as layers of the
    split (:func:`~ptdp.layout.pipeline.partition.layer_split`)."""
    out = heads_violations(m.num_attention_heads, tp)
    a, h = m.num_attention_heads, m.hidden_size
    if h % a != 0 and m.kv_channels is None:
        out.append(
            V(
                "hidden % heads",
                f"hidden_size={h} is not divisible by num_attention_heads={a} (rule: h % a == 0 without --kv-channels)",
                hidden=h,
                heads=a,
            )
        )
    if m.ffn % tp != 0:
        out.append(
            V(
                "ffn % tp",
                f"ffn_hidden_size={m.ffn} is not divisible by tensor_model_parallel_size={tp} (rule: ffn % tp == 0)",
                ffn=m.ffn,
                tp=tp,
            )
        )
    try:
        stage_layer_counts(
            m.num_layers, pp, layer_split(m.num_layers, pp, split, first, last, embedding=embedding, loss=loss)
        )
    except ConfigError as e:
        out.append(V("layers % pp", str(e), num_layers=m.num_layers, pp=pp, split=split, first=first, last=last))
    if m.vocab_size < MIN_VOCAB_SIZE:
        out.append(
            V(
                "vocab size",
                f"vocab_size={m.vocab_size} must be >= {MIN_VOCAB_SIZE} (256 bytes + end token + merges)",
                vocab_size=m.vocab_size,
            )
        )
    if m.params_dtype not in (AUTO_DTYPE, *DTYPES):  # auto: made concrete by resolve()
        out.append(V("option", f"params_dtype={m.params_dtype!r} must be one of {(AUTO_DTYPE, *DTYPES)}"))
    if m.init_method_std <= 0:
        out.append(V("option", f"init_method_std={m.init_method_std} must be > 0"))
    return out


def heads_violations(heads: int, tp: int) -> list[Violation]:
    """Attention is split by heads: ``heads % tp == 0``."""
    if heads % tp != 0:
        return [
            V(
                "heads % tp",
                f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp} "
                f"(rule: heads % tp == 0; attention is split by heads)",
                heads=heads,
                tp=tp,
            )
        ]
    return []


def llama_option_violations(m: ModelConfig, tp: int) -> list[Violation]:
    """Normalization, positions, the head size (``kv_channels > 0``, even with rotary positions) and
    grouped-query attention (the options of Llama-like models)."""
    out = []
    a, g = m.num_attention_heads, m.num_query_groups
    if m.normalization not in NORMALIZATIONS:
        out.append(V("option", f"normalization={m.normalization!r} must be one of {NORMALIZATIONS}"))
    if m.position_embedding_type not in POSITION_EMBEDDINGS:
        out.append(
            V("option", f"position_embedding_type={m.position_embedding_type!r} must be one of {POSITION_EMBEDDINGS}")
        )
    d = m.kv_channels
    if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
        out.append(V("option", f"kv_channels={d!r} must be a positive integer (the channels of a head)"))
    elif m.position_embedding_type == "rope" and (d is not None or (a > 0 and m.hidden_size % a == 0)):
        if m.head_dim % 2:
            where = (
                f"kv_channels={d}"
                if d is not None
                else f"head dim hidden_size / num_attention_heads = {m.hidden_size}/{a} = {m.head_dim}"
            )
            out.append(
                V(
                    "rope head dim",
                    f"{where} is odd (rule: rotary embeddings turn pairs of channels, the head dim must be even)",
                )
            )
    if not m.rotary_base > 0:
        out.append(V("option", f"rotary_base={m.rotary_base} must be > 0"))
    if g is None:
        return out
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        return out + [V("option", f"num_query_groups={g!r} must be a positive integer")]
    if a % g:
        out.append(
            V(
                "heads % groups",
                f"num_attention_heads={a} is not divisible by num_query_groups={g} "
                f"(rule: heads % groups == 0; each key/value head serves a / G query heads)",
            )
        )
    if g % tp:
        out.append(
            V(
                "kv heads % tp",
                f"num_query_groups={g} is not divisible by tensor_model_parallel_size={tp} "
                f"(rule: query groups must divide by tp; each tp rank holds whole key/value heads)",
                groups=g,
                tp=tp,
            )
        )
    return out


def recompute_violations(m: ModelConfig, chunk_layers: list[int] | None) -> list[Violation]:
    """Rules of activation recomputation; ``chunk_layers``: the layers of every model chunk (None
    when the layout is invalid: the range of recompute_num_layers is then not checked)."""
    granularity, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    if granularity is not None and granularity not in RECOMPUTE_GRANULARITIES:
        return [
            V(
                "option",
                f"recompute_granularity={granularity!r} must be one of {RECOMPUTE_GRANULARITIES} (or "
                f"unset: no recompute)",
            )
        ]
    out = []
    if method is not None and method not in RECOMPUTE_METHODS:
        out.append(V("option", f"recompute_method={method!r} must be one of {RECOMPUTE_METHODS}"))
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        out.append(V("option", f"recompute_num_layers={n!r} must be a positive integer"))
        n = None
    if granularity != "full":
        return out + [
            V("recompute", f"{name}={value!r} needs recompute_granularity=full, not {granularity!r}")
            for name, value in (("recompute_method", method), ("recompute_num_layers", m.recompute_num_layers))
            if value is not None
        ]
    if method == "block" and m.recompute_num_layers is None:
        out.append(
            V("recompute", "recompute_method=block needs recompute_num_layers (the layers recomputed per model chunk)")
        )
    smallest = min((c for c in chunk_layers or () if c), default=None)  # a chunk of only the embedding / loss: none
    if n is not None and smallest is not None and n > smallest:
        out.append(
            V(
                "recompute",
                f"recompute_num_layers={n} is more than the {smallest} layers of the "
                f"smallest model chunk (layers per chunk: {chunk_layers}; rule: 1 <= recompute_num_layers <= "
                f"layers per model chunk)",
            )
        )
    return out


def model_option_violations(m: ModelConfig) -> list[Violation]:
    """Dropout probabilities, the activation, and the model settings only ``ptdp plan`` takes."""
    out = [
        V("option", f"{name}={value} must be in [0, 1) (a dropout probability; 0 disables)")
        for name, value in (("hidden_dropout", m.hidden_dropout), ("attention_dropout", m.attention_dropout))
        if not 0 <= value < 1
    ]
    if m.activation not in ACTIVATIONS:
        out.append(V("option", f"activation={m.activation!r} must be one of {ACTIVATIONS}"))
    elif m.swiglu and m.activation != "gelu":
        out.append(V("option", f"activation={m.activation!r} has no effect with swiglu (the gate uses silu)"))
    if m.use_flash_attn is not None:
        out.append(
            V(
                "option",
                f"use_flash_attn={m.use_flash_attn} is a ptdp plan setting: ptdp train runs the fused "
                "kernel, or the explicit attention with attention_dropout > 0",
            )
        )
    if m.kv_repeated is not None:
        out.append(
            V(
                "option",
                f"kv_repeated={m.kv_repeated} is a ptdp plan setting: ptdp train passes the grouped "
                "key/value heads to the attention kernel",
            )
        )
    if m.linear_biases is not None:
        out.append(
            V(
                "option",
                f"linear_biases={m.linear_biases}: ptdp train builds biases on all four linear layers "
                "or none (--disable-bias-linear)",
            )
        )
    return out
