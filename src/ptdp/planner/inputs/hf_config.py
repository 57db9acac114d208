"""Models from Hugging Face ``config.json`` files: ``ptdp plan --model PATH`` (a file or a folder
holding one; anything else is a preset name, :func:`ptdp.planner.inputs.models.get_model`).

- ``llama``, ``mistral``, ``qwen2``, ``qwen3``: ``num_hidden_layers`` -> l, ``hidden_size`` -> h,
  ``num_attention_heads`` -> a, ``num_key_value_heads``, ``intermediate_size`` -> ffn,
  ``vocab_size`` -> V, ``max_position_embeddings`` -> s (unless given), ``tie_word_embeddings``,
  ``head_dim`` -> d (``kv_channels``, when not h / a); RMSNorm, rotary, SwiGLU; biases from
  ``attention_bias`` / ``mlp_bias`` (Llama), q, k, v (Qwen2); Qwen3's per-head query/key norms
  (``qk_layernorm``).
- ``gpt2``: ``n_layer``, ``n_embd``, ``n_head``, ``n_inner`` (None: 4h), ``vocab_size``,
  ``n_positions`` -> s, ``tie_word_embeddings``; LayerNorm, learned positions, GELU, biases;
  dropout when ``resid_pdrop`` or ``embd_pdrop`` is non-zero.

Missing fields take transformers' defaults (:mod:`ptdp.planner.inputs.hf_defaults`); planned with a flash kernel. Shape
changes the planner does not model (experts, cross attention) raise
:class:`~ptdp.config.ConfigError`; cost-only ones (sliding window, rotary scaling) become notes.
"""

from __future__ import annotations

import json
from pathlib import Path

from ptdp.config.model import ModelConfig
from ptdp.errors import ConfigError
from ptdp.planner.inputs.hf_defaults import DEFAULTS

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

#: Fields of mixture-of-experts configs (Mixtral, Qwen2-MoE, DeepSeek): the planner models dense MLPs.
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def is_config_path(model: str) -> bool:
    """``--model`` names a file or a folder (a Hugging Face config), not a preset."""
    return Path(model).exists()


def config_file(path: str | Path) -> Path:
    """``path`` itself, or ``path/config.json`` for a folder; ConfigError when there is none."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"--model {path}: the folder has no config.json")
    return p


def hf_model_name(path: str | Path) -> str:
    """The name a model from a (readable) Hugging Face config is reported under: ``hf:`` and its
    folder, or its ``model_type``."""
    file = config_file(path)
    if file.parent.name:
        return f"hf:{file.parent.name}"
    return f"hf:{json.loads(file.read_text(encoding='utf-8')).get('model_type')}"


def load_hf_config(path: str | Path, *, seq_length: int | None = None) -> tuple[ModelConfig, list[str]]:
    """The planner's model for a Hugging Face ``config.json`` (a file or a folder holding it), and
    notes about what the planner does not model. ``seq_length`` replaces the config's maximum
    position count as s. Raises ConfigError for a file that is not a JSON object, an unknown
    ``model_type`` (naming the supported ones), a field of the wrong type and the unsupported
    fields that change the shape."""
    file = config_file(path)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--model {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--model {path}: {file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--model {path}: {file} holds a JSON {type(raw).__name__}, expected an object")
    kind = raw.get("model_type")
    if kind not in SUPPORTED:
        raise ConfigError(
            f"--model {path}: model_type={json.dumps(kind)} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    cfg = {**DEFAULTS[kind], **raw}
    experts = [f"{k}={json.dumps(cfg[k])}" for k in MOE_FIELDS if cfg.get(k) not in (None, 0, 1)]
    if experts:
        raise ConfigError(
            f"--model {path}: mixture-of-experts fields {', '.join(experts)} are not supported "
            f"(the planner models dense MLPs)"
        )
    if kind == "gpt2":
        return _gpt2(cfg, path, seq_length), []
    return _llama_like(kind, cfg, path, seq_length)


def _int(cfg: dict, key: str, path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"--model {path}: {key}={json.dumps(value)} must be a positive integer")
    return value


def _llama_like(kind: str, cfg: dict, path, seq_length: int | None) -> tuple[ModelConfig, list[str]]:
    """Llama, Mistral, Qwen2 and Qwen3: RMSNorm, rotary positions, SwiGLU, grouped-query attention
    (Qwen3: query/key norms)."""
    h, a = _int(cfg, "hidden_size", path), _int(cfg, "num_attention_heads", path)
    kv = a if cfg.get("num_key_value_heads") is None else _int(cfg, "num_key_value_heads", path)
    head_dim = None if cfg.get("head_dim") is None else _int(cfg, "head_dim", path)
    s = seq_length if seq_length is not None else _int(cfg, "max_position_embeddings", path)
    biases: tuple[str, ...] = ()
    if kind == "qwen2":
        biases = ("qkv",)
    elif kind in ("llama", "qwen3"):  # Qwen3's attention_bias: q, k, v and o, as Llama's
        biases = (("qkv", "proj") if cfg.get("attention_bias") else ()) + (
            ("fc1", "fc2") if cfg.get("mlp_bias") else ()
        )
    notes = _cost_notes(kind, cfg, s, path)
    model = ModelConfig(
        num_layers=_int(cfg, "num_hidden_layers", path),
        hidden_size=h,
        num_attention_heads=a,
        ffn_hidden_size=_int(cfg, "intermediate_size", path),
        vocab_size=_int(cfg, "vocab_size", path),
        seq_length=s,
        num_query_groups=kv,
        swiglu=True,
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings"),
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        linear_biases=biases or None,
        use_flash_attn=True,
        kv_channels=None if head_dim is None or head_dim * a == h else head_dim,
        qk_layernorm=kind == "qwen3",
    )
    return model, notes


def _cost_notes(kind: str, cfg: dict, s: int, path) -> list[str]:
    """Sliding windows shorter than the sequence (the planner counts full causal attention) and
    rotary scaling (changes neither shape nor cost)."""
    notes = []
    window = cfg.get("sliding_window")
    if kind in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None
    if isinstance(window, int) and window < s:
        layers = "every layer" if kind == "mistral" else f"layers from {cfg.get('max_window_layers')} on"
        notes.append(
            f"note: {path}: sliding_window={window} < seq_length={s} on {layers}; planned as full causal "
            f"attention (attention time over-estimated, memory unchanged with a flash kernel)"
        )
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind_of_rope = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind_of_rope not in (None, "default"):
        notes.append(
            f"note: {path}: rotary scaling {json.dumps(kind_of_rope)} ignored (it changes neither shapes nor cost)"
        )
    return notes


def _gpt2(cfg: dict, path, seq_length: int | None) -> ModelConfig:
    """GPT-2: LayerNorm, learned positions, GELU MLP, biases; dropout masks when trained with them."""
    if cfg.get("add_cross_attention"):
        raise ConfigError(f"--model {path}: add_cross_attention=true is not supported (decoder-only models)")
    h = _int(cfg, "n_embd", path)
    ffn = 4 * h if cfg.get("n_inner") is None else _int(cfg, "n_inner", path)
    s = seq_length if seq_length is not None else _int(cfg, "n_positions", path)
    return ModelConfig(
        num_layers=_int(cfg, "n_layer", path),
        hidden_size=h,
        num_attention_heads=_int(cfg, "n_head", path),
        ffn_hidden_size=ffn,
        vocab_size=_int(cfg, "vocab_size", path),
        seq_length=s,
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings"),
        hidden_dropout=float(cfg.get("resid_pdrop") or cfg.get("embd_pdrop") or 0.0),
        use_flash_attn=True,
    )
