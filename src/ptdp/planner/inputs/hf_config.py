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

Mixtures of experts, as a :class:`~ptdp.planner.inputs.moe_model.MoEModel` (the decoder as above,
``intermediate_size`` the dense layers' MLP):

- ``mixtral``: every layer MoE, ``num_local_experts`` -> E, ``num_experts_per_tok`` -> k, experts
  ``intermediate_size`` wide.
- ``qwen2_moe``, ``qwen3_moe``: layer i MoE when ``(i + 1) % decoder_sparse_step == 0`` and i is
  not in ``mlp_only_layers``; ``num_experts`` (``num_local_experts``) -> E, ``moe_intermediate_size``
  -> F; ``norm_topk_prob`` false -> ``moe_router_pre_softmax``. Qwen2-MoE: q, k, v biases
  (``qkv_bias``), ``shared_expert_intermediate_size`` -> S. Qwen3-MoE: query/key norms, ``head_dim``.
- ``deepseek_v3``: layers from ``first_k_dense_replace`` on MoE (every ``moe_layer_freq``-th, as
  DeepSeek's code); ``n_routed_experts`` -> E, ``moe_intermediate_size`` -> F, S = ``n_shared_experts``
  F, sigmoid scores (``scoring_func``), ``routed_scaling_factor``, group-limited routing (``n_group``,
  ``topk_group``), the expert bias (``topk_method`` noaux_tc); multi-head latent attention
  (:class:`~ptdp.planner.inputs.moe_model.MLA`: ``q_lora_rank``, ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``) with ``dn + dr`` channels and a key/value
  head per query head for the kernel; ``num_nextn_predict_layers`` -> multi-token prediction (which
  transformers does not build).
- ``gpt_oss``: every layer MoE, ``num_local_experts`` -> E, experts ``intermediate_size`` wide with
  biases, q, k, v and o biases (``attention_bias``), ``head_dim``; its clamped SwiGLU is planned as
  SwiGLU.

Missing fields take transformers' defaults (:mod:`ptdp.planner.inputs.hf_defaults`); planned with a
flash kernel. Shape changes the planner does not model (experts in a dense family, cross attention)
and routing that breaks ptdp's MoE rules raise :class:`~ptdp.errors.ConfigError`; weights it leaves
out (Qwen2-MoE's shared-expert gates, gpt-oss's router biases and attention sinks, MLA biases) and
cost-only changes (sliding windows, rotary scaling, Mixtral's router noise) become notes.
"""

from __future__ import annotations

import json
from pathlib import Path

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.rules.moe import moe_violations
from ptdp.errors import ConfigError
from ptdp.planner.inputs.hf_defaults import ALIASES, DEFAULTS
from ptdp.planner.inputs.moe_model import MLA, with_moe, with_mtp

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
SUPPORTED = DENSE + MOE

#: Fields of mixture-of-experts configs: a dense model_type with one of them is refused.
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
    """The planner's model for a Hugging Face ``config.json`` (a file or a folder holding it; a
    :class:`~ptdp.planner.inputs.moe_model.MoEModel` for the MoE families), and notes about what the
    planner does not model. ``seq_length`` replaces the config's maximum position count as s. Raises
    ConfigError for a file that is not a JSON object, an unknown ``model_type`` (naming the supported
    ones), a field of the wrong type, experts in a dense family, routing that breaks ptdp's MoE
    rules (naming the config's fields) and the unsupported fields that change the shape."""
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
    aliases = ALIASES.get(kind, {})
    cfg = {**DEFAULTS[kind], **{aliases.get(k, k): v for k, v in raw.items()}}
    experts = [f"{k}={json.dumps(cfg[k])}" for k in MOE_FIELDS if kind in DENSE and cfg.get(k) not in (None, 0, 1)]
    if experts:
        raise ConfigError(
            f"--model {path}: mixture-of-experts fields {', '.join(experts)} are not read for the dense "
            f"model_type {json.dumps(kind)} (mixtures of experts: {', '.join(MOE)})"
        )
    if kind == "gpt2":
        return _gpt2(cfg, path, seq_length), []
    if kind == "deepseek_v3":
        return _deepseek_v3(cfg, path, seq_length)
    model, notes = _llama_like(kind, cfg, path, seq_length)
    if kind not in MOE:
        return model, notes
    moe, moe_notes = _experts(kind, cfg, model, path)
    return with_moe(model, moe), notes + moe_notes


def _int(cfg: dict, key: str, path, minimum: int = 1) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"--model {path}: {key}={json.dumps(value)} must be {kind}")
    return value


def _llama_like(kind: str, cfg: dict, path, seq_length: int | None) -> tuple[ModelConfig, list[str]]:
    """The decoder of Llama, Mistral, Qwen2, Qwen3 and the MoE families but DeepSeek: RMSNorm,
    rotary positions, SwiGLU, grouped-query attention (Qwen3: query/key norms)."""
    h, a = _int(cfg, "hidden_size", path), _int(cfg, "num_attention_heads", path)
    kv = a if cfg.get("num_key_value_heads") is None else _int(cfg, "num_key_value_heads", path)
    head_dim = None if cfg.get("head_dim") is None else _int(cfg, "head_dim", path)
    s = seq_length if seq_length is not None else _int(cfg, "max_position_embeddings", path)
    biases: tuple[str, ...] = ()
    if kind == "qwen2" or (kind == "qwen2_moe" and cfg.get("qkv_bias")):
        biases = ("qkv",)
    elif kind in ("llama", "qwen3", "qwen3_moe"):  # Qwen3's attention_bias: q, k, v and o, as Llama's
        biases = (("qkv", "proj") if cfg.get("attention_bias") else ()) + (
            ("fc1", "fc2") if cfg.get("mlp_bias") else ()
        )
    elif kind == "gpt_oss":  # add_bias_linear (below): every linear and expert biased, q, k, v, o if attention_bias
        biases = () if cfg.get("attention_bias") else ("fc1", "fc2")
    notes = _cost_notes(kind, cfg, s, path)
    model = _decoder(
        cfg,
        path,
        h,
        a,
        s,
        num_query_groups=kv,
        add_bias_linear=kind == "gpt_oss",
        linear_biases=biases or None,
        kv_channels=None if head_dim is None or head_dim * a == h else head_dim,
        qk_layernorm=kind in ("qwen3", "qwen3_moe"),
    )
    return model, notes


def _decoder(cfg: dict, path, h: int, a: int, s: int, **fields) -> ModelConfig:
    """The Llama-style decoder every family but GPT-2 shares (RMSNorm, rotary positions, SwiGLU, a
    flash kernel; layers, MLP width, vocabulary and tied embeddings from ``cfg``), ``fields`` added."""
    return ModelConfig(
        num_layers=_int(cfg, "num_hidden_layers", path),
        hidden_size=h,
        num_attention_heads=a,
        ffn_hidden_size=_int(cfg, "intermediate_size", path),
        vocab_size=_int(cfg, "vocab_size", path),
        seq_length=s,
        swiglu=True,
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings"),
        normalization="RMSNorm",
        position_embedding_type="rope",
        use_flash_attn=True,
        **fields,
    )


def _experts(kind: str, cfg: dict, model: ModelConfig, path) -> tuple[MoEConfig | None, list[str]]:
    """The MoE options of Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss (module docstring), None when
    no layer is MoE, and notes on the weights left out."""
    n = model.num_layers
    if kind in ("mixtral", "gpt_oss"):
        count, width, layers = "num_local_experts", None, [True] * n
    else:
        count, width = "num_experts", _int(cfg, "moe_intermediate_size", path)
        step, dense = _int(cfg, "decoder_sparse_step", path), _layer_ids(cfg, "mlp_only_layers", path)
        layers = [i not in dense and (i + 1) % step == 0 for i in range(n)]
    e = _int(cfg, count, path, minimum=0)
    if not e or not any(layers):
        return None, [_dense_note(path, count, e)]
    shared = _int(cfg, "shared_expert_intermediate_size", path, minimum=0) if kind == "qwen2_moe" else 0
    moe = MoEConfig(
        num_experts=e,
        moe_router_topk=_int(cfg, "num_experts_per_tok", path),
        moe_ffn_hidden_size=width,
        moe_shared_expert_intermediate_size=shared or None,
        moe_layer_freq=_layer_freq(layers),
        moe_router_pre_softmax=kind in ("qwen2_moe", "qwen3_moe") and not cfg.get("norm_topk_prob"),
    )
    _check_routing(moe, model, path, {"num_experts": count})
    moe_layers, h = sum(layers), model.hidden_size
    notes = []
    if kind == "mixtral" and cfg.get("router_jitter_noise"):
        notes.append(
            f"note: {path}: router_jitter_noise={cfg['router_jitter_noise']} ignored (noise on the router's "
            "input changes neither shapes nor cost)"
        )
    if kind == "qwen2_moe":
        notes.append(
            f"note: {path}: the shared experts' gates ([1, h] per MoE layer, {moe_layers * h:,} parameters) are "
            "left out: the planner counts the shared expert as an ungated MLP"
        )
    if kind == "gpt_oss":
        left_out = moe_layers * e + n * model.num_attention_heads
        notes.append(
            f"note: {path}: the routers' biases ([E] per MoE layer) and the attention sinks ([a] per layer), "
            f"{left_out:,} parameters, are left out; the clamped SwiGLU is planned as SwiGLU"
        )
    return moe, notes


def _deepseek_v3(cfg: dict, path, seq_length: int | None) -> tuple[ModelConfig, list[str]]:
    """DeepSeek-V3 (module docstring): the dense stand-in of ``models.DEEPSEEK_V3`` (``dn + dr``
    channels, one key/value head per query head) with MLA, the experts and multi-token prediction."""
    h, a = _int(cfg, "hidden_size", path), _int(cfg, "num_attention_heads", path)
    q_lora = None if cfg.get("q_lora_rank") is None else _int(cfg, "q_lora_rank", path)
    mla = MLA(
        kv_lora_rank=_int(cfg, "kv_lora_rank", path),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", path),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", path),
        v_head_dim=_int(cfg, "v_head_dim", path),
        q_lora_rank=q_lora,
    )
    d, s = mla.qk_head_dim, seq_length if seq_length is not None else _int(cfg, "max_position_embeddings", path)
    model = _decoder(
        cfg, path, h, a, s, num_query_groups=a, add_bias_linear=False, kv_channels=None if d * a == h else d
    )
    notes = _cost_notes("deepseek_v3", cfg, s, path)
    if cfg.get("attention_bias"):
        per_layer = (q_lora or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim + h
        notes.append(
            f"note: {path}: attention_bias=true: MLA's biases ({model.num_layers * per_layer:,} parameters) are "
            "left out"
        )
    first, every = _int(cfg, "first_k_dense_replace", path, minimum=0), _int(cfg, "moe_layer_freq", path)
    if every != 1:
        notes.append(
            f"note: {path}: moe_layer_freq={every}: MoE layers placed as DeepSeek's own code places them (every "
            f"{every}-th from layer {first}); transformers' DeepseekV3 ignores the field (every layer from {first})"
        )
    layers = [i >= first and i % every == 0 for i in range(model.num_layers)]
    e, mtp = _int(cfg, "n_routed_experts", path, minimum=0), _int(cfg, "num_nextn_predict_layers", path, minimum=0)
    if not e or not any(layers):
        planned = with_moe(model, None, mla=mla, mtp_layers=0)
        return with_mtp(planned, mtp), [*notes, _dense_note(path, "n_routed_experts", e)]  # type: ignore[arg-type]
    score = cfg.get("scoring_func")
    if score not in ("softmax", "sigmoid"):
        raise ConfigError(f"--model {path}: scoring_func={json.dumps(score)} must be softmax or sigmoid")
    scale = cfg.get("routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise ConfigError(f"--model {path}: routed_scaling_factor={json.dumps(scale)} must be a number")
    grouped = cfg.get("n_group") not in (None, 1) and cfg.get("topk_group") is not None
    width = _int(cfg, "moe_intermediate_size", path)
    moe = MoEConfig(
        num_experts=e,
        moe_router_topk=_int(cfg, "num_experts_per_tok", path),
        moe_ffn_hidden_size=width,
        moe_shared_expert_intermediate_size=_int(cfg, "n_shared_experts", path, minimum=0) * width or None,
        moe_layer_freq=_layer_freq(layers),
        moe_router_score_function=score,
        moe_router_pre_softmax=score == "softmax" and not cfg.get("norm_topk_prob"),
        moe_router_topk_scaling_factor=None if scale == 1 else float(scale),
        moe_router_num_groups=_int(cfg, "n_group", path) if grouped else None,
        moe_router_group_topk=_int(cfg, "topk_group", path) if grouped else None,
        moe_router_enable_expert_bias=cfg.get("topk_method") == "noaux_tc",
    )
    names = {
        "num_experts": "n_routed_experts",
        "moe_router_num_groups": "n_group",
        "moe_router_group_topk": "topk_group",
        "moe_router_topk_scaling_factor": "routed_scaling_factor",
    }
    _check_routing(moe, model, path, names)
    return with_mtp(with_moe(model, moe, mla=mla), mtp), notes  # type: ignore[arg-type]


def _layer_ids(cfg: dict, key: str, path) -> set[int]:
    """A list of layer indices (None: none)."""
    value = cfg.get(key) or []
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
        raise ConfigError(f"--model {path}: {key}={json.dumps(value)} must be a list of layer indices")
    return set(value)


def _layer_freq(layers: list[bool]) -> tuple[int, ...]:
    """``moe_layer_freq`` for these MoE (True) and dense layers: ``(1,)`` when all are MoE."""
    return (1,) if all(layers) else tuple(int(on) for on in layers)


def _dense_note(path, count: str, experts: int) -> str:
    return f"note: {path}: {count}={experts} and no MoE layer: planned as a dense model"


def _check_routing(moe: MoEConfig, model: ModelConfig, path, names: dict[str, str]) -> None:
    """ConfigError for MoE options that break ptdp's MoE rules, ptdp's field names replaced by the
    config's (``names``; ``moe_router_topk`` is ``num_experts_per_tok``)."""
    broken = moe_violations(
        moe, num_layers=model.num_layers, ffn=model.ffn, tp=1, pp=1, ep=1, etp=1, world_size=1, sequence_parallel=True
    )
    if broken:
        message = "; ".join(v.message for v in broken)
        for ours, theirs in {**names, "moe_router_topk": "num_experts_per_tok"}.items():
            message = message.replace(f"{ours}=", f"{theirs}=")
        raise ConfigError(f"--model {path}: {message}")


def _window_layers(kind: str, cfg: dict) -> str:
    """The layers a sliding window applies to, in words ("" when none): ``layer_types``'
    ``sliding_attention`` layers, else the family's."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        n = types.count("sliding_attention")
        return "" if not n else "every layer" if n == len(types) else f"{n} of {len(types)} layers (layer_types)"
    if kind in ("qwen2", "qwen3"):
        return f"layers from {cfg.get('max_window_layers')} on"
    if kind == "qwen2_moe":
        return f"the even layers below max_window_layers={cfg.get('max_window_layers')}"
    return "every other layer" if kind == "gpt_oss" else "every layer"


def _cost_notes(kind: str, cfg: dict, s: int, path) -> list[str]:
    """Sliding windows shorter than the sequence (the planner counts full causal attention) and
    rotary scaling (changes neither shape nor cost)."""
    notes = []
    window = cfg.get("sliding_window")
    if kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None
    layers = _window_layers(kind, cfg)
    if isinstance(window, int) and window < s and layers:
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
