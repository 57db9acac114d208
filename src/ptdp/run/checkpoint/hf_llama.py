"""Hugging Face interop of the Llama family: the decoder tensors and ``config.json`` fields that
``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` share
with ptdp's Llama-like GPT (RMSNorm, SwiGLU, rotary positions, query groups), and Llama's own
config. Per layer i (ptdp's stored form on the left; all ``nn.Linear`` ``[out, in]`` on both sides,
nothing transposed):

- ``layers.i.ln1`` / ``ln2`` = ``input_layernorm`` / ``post_attention_layernorm``; ``final_norm``
  = ``model.norm``; ``word_embeddings`` = ``embed_tokens``; ``output_layer`` = ``lm_head`` (absent
  when tied); real vocabulary rows only.
- ``layers.i.attention.qkv``: with G groups the rows are ``[q of the a/G heads of group g, k_g,
  v_g]`` for g = 0 .. G-1 (``d`` rows per head, ``head_dim``); ``q_proj`` / ``k_proj`` /
  ``v_proj`` concatenate the groups' blocks (query head j uses kv head ``j // (a/G)``, as in
  Llama). No groups: ``[3, a d, h]``.
- ``attention.q_norm`` / ``k_norm`` (``--qk-layernorm``) = ``self_attn.q_norm`` / ``k_norm`` (Qwen3).
- ``proj`` = ``o_proj``; ``mlp.fc1`` ``[2, ffn, h]`` = ``[gate_proj, up_proj]``; ``mlp.fc2`` =
  ``down_proj``; biases (``attention_bias`` and ``mlp_bias``) follow their weights' rows. MoE
  layers: :mod:`ptdp.run.checkpoint.hf_moe`.
- rotary: both pair channel i with ``i + d/2`` ("rotate half") at angle ``pos * theta^(-2i/d)``,
  so q and k rows are not permuted.

Qwen3's and Mixtral's own config fields: :mod:`ptdp.run.checkpoint.hf_qwen3`,
:mod:`ptdp.run.checkpoint.hf_mixtral`.
"""

from __future__ import annotations

import torch

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.run.checkpoint.folders import MODEL_DEFAULTS, CheckpointError
from ptdp.run.checkpoint.hf_moe import ExpertNames, experts_from_hf, experts_to_hf

#: what ptdp needs for an export to the Llama family, besides any query groups, biases and tying
LLAMA_OPTIONS = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope"}
#: fields a Llama-family ``config.json`` must have (the others have the family's defaults)
REQUIRED = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


def is_gpt2_like(m: dict) -> bool:
    """No Llama-like option is set (the checkpoint metadata's ``model``): export as GPT-2."""
    return not _gpt2_lacks(m) and all(m.get(f, MODEL_DEFAULTS[f]) == MODEL_DEFAULTS[f] for f in LLAMA_OPTIONS)


def _gpt2_lacks(m: dict) -> list[str]:
    """The non-default options of the checkpoint metadata's ``model`` that GPT-2 cannot express
    besides the Llama ones (a head size other than hidden / heads, query/key norms, grouped
    query attention, no biases, another rotary base)."""
    out = []
    for f, d in MODEL_DEFAULTS.items():
        if f in LLAMA_OPTIONS or f in ("activation", "layernorm_epsilon"):
            continue
        value = m.get(f, d)
        if f == "kv_channels" and value is not None and value * m["num_attention_heads"] == m["hidden_size"]:
            continue  # hidden / heads: GPT-2's own
        if value != d:
            out.append(f"{f}={value!r}")
    return out


def check_options(m: dict, family: str, *, qk_layernorm: bool) -> None:
    """Raises CheckpointError, naming the fields, unless the checkpoint metadata's ``model`` has
    RMSNorm, ``--swiglu`` and rope, and query/key norms exactly when ``family`` has them."""
    other = [
        f"{f}={m.get(f, MODEL_DEFAULTS[f])!r}"
        for f, need in LLAMA_OPTIONS.items()
        if m.get(f, MODEL_DEFAULTS[f]) != need
    ]
    if other:
        lacks = _gpt2_lacks(m)
        why = f"{', '.join(lacks)}, which GPT-2 cannot express, and " if lacks else ""
        raise CheckpointError(
            f"the model has {why}{', '.join(other)}: neither GPT-2 (LayerNorm, learned positions, GELU "
            f"MLP, biases, multi-head attention) nor {family} (RMSNorm, --swiglu, rope) can express it"
        )
    if bool(m.get("qk_layernorm")) != qk_layernorm:
        has = "has no" if not qk_layernorm else "normalizes each head's query and key (--qk-layernorm)"
        raise CheckpointError(f"the model has qk_layernorm={bool(m.get('qk_layernorm'))}: {family} {has}")


def decoder_config(m: dict, dtype: torch.dtype) -> dict:
    """The ``config.json`` fields the Llama family shares, for the checkpoint metadata's ``model``."""
    a, h = m["num_attention_heads"], m["hidden_size"]
    theta = float(m.get("rotary_base", 10000.0))
    return {
        "vocab_size": m["vocab_size"],
        "hidden_size": h,
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": a,
        "num_key_value_heads": m.get("num_query_groups") or a,
        "head_dim": m.get("kv_channels") or h // a,
        "hidden_act": "silu",
        "max_position_embeddings": m["seq_length"],
        "rms_norm_eps": m["layernorm_epsilon"],
        "rope_theta": theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_dropout": 0.0,
        "tie_word_embeddings": not m["untie_embeddings_and_output_weights"],
        "initializer_range": m.get("init_method_std", 0.02),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def llama_config(m: dict, dtype: torch.dtype) -> dict:
    """``config.json`` of ``LlamaForCausalLM`` for the checkpoint metadata's ``model``."""
    check_options(m, "Llama", qk_layernorm=False)
    bias = bool(m.get("add_bias_linear", True))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config(m, dtype),
        "intermediate_size": m["ffn"],
        "attention_bias": bias,
        "mlp_bias": bias,
    }


def _split_qkv(t: torch.Tensor, a: int, groups: int | None, d: int) -> tuple[torch.Tensor, ...]:
    """ptdp's stored QKV weight or bias -> Llama's q, k, v (weights ``[rows, h]``, biases ``[rows]``)."""
    if groups is None:  # [3, a d, ...]
        return t[0], t[1], t[2]
    tail, per = t.shape[1:], a // groups
    g = t.reshape(groups, per + 2, d, *tail)  # [q of the group's heads, k, v] per group
    kv_rows = groups * d
    return g[:, :per].reshape(a * d, *tail), g[:, per].reshape(kv_rows, *tail), g[:, per + 1].reshape(kv_rows, *tail)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: int, groups: int | None, d: int) -> torch.Tensor:
    """The inverse of :func:`_split_qkv`."""
    if groups is None:
        return torch.stack((q, k, v))
    tail, per = q.shape[1:], a // groups
    fused = torch.cat(
        (q.reshape(groups, per, d, *tail), k.reshape(groups, 1, d, *tail), v.reshape(groups, 1, d, *tail)), dim=1
    )
    return fused.reshape((a + 2 * groups) * d, *tail)


def _layer_names(i: int, qk_layernorm: bool, dense_mlp: bool) -> dict[str, str]:
    """ptdp's stored names of layer ``i``'s norms and projections -> the family's (no QKV, fc1)."""
    pre = f"model.layers.{i}."
    names = {
        "ln1": pre + "input_layernorm",
        "ln2": pre + "post_attention_layernorm",
        "attention.proj": pre + "self_attn.o_proj",
    }
    if qk_layernorm:
        names |= {"attention.q_norm": pre + "self_attn.q_norm", "attention.k_norm": pre + "self_attn.k_norm"}
    if dense_mlp:
        names["mlp.fc2"] = pre + "mlp.down_proj"
    return names


def to_llama(
    m: dict, tensors: dict[str, torch.Tensor], *, moe: MoEConfig | None = None, experts: ExpertNames | None = None
) -> dict[str, torch.Tensor]:
    """ptdp's stored model tensors -> the family's state dict; the MoE layers of ``moe`` as
    ``experts`` names them (:func:`~ptdp.run.checkpoint.hf_moe.experts_to_hf`)."""
    a, groups, bias = m["num_attention_heads"], m.get("num_query_groups"), m.get("add_bias_linear", True)
    d = m.get("kv_channels") or m["hidden_size"] // a
    routed = moe.moe_layers(m["num_layers"]) if moe is not None else (False,) * m["num_layers"]
    hf = {
        "model.embed_tokens.weight": tensors["word_embeddings.weight"],
        "model.norm.weight": tensors["final_norm.weight"],
    }
    if m["untie_embeddings_and_output_weights"]:
        hf["lm_head.weight"] = tensors["output_layer.weight"]
    for i in range(m["num_layers"]):
        pre = f"model.layers.{i}."
        for mine, theirs in _layer_names(i, bool(m.get("qk_layernorm")), not routed[i]).items():
            linear = mine in ("attention.proj", "mlp.fc2")  # the norms have no bias
            for kind in ("weight", "bias") if bias and linear else ("weight",):
                hf[f"{theirs}.{kind}"] = tensors[f"layers.{i}.{mine}.{kind}"]
        for kind in ("weight", "bias") if bias else ("weight",):
            q, k, v = _split_qkv(tensors[f"layers.{i}.attention.qkv.{kind}"], a, groups, d)
            hf |= {f"{pre}self_attn.q_proj.{kind}": q, f"{pre}self_attn.k_proj.{kind}": k}
            hf[f"{pre}self_attn.v_proj.{kind}"] = v
            if not routed[i]:
                gate, up = tensors[f"layers.{i}.mlp.fc1.{kind}"].unbind(0)
                hf |= {f"{pre}mlp.gate_proj.{kind}": gate, f"{pre}mlp.up_proj.{kind}": up}
        if routed[i]:
            if experts is None:
                raise ValueError(f"layer {i} is an MoE layer: the family's expert names are needed")
            hf |= experts_to_hf(experts, i, tensors)
    return hf


def decoder_fields(config: dict, family: str, defaults: dict, problems: list[str]) -> dict:
    """:class:`ModelConfig` keyword arguments of the fields the Llama family shares (not the MLP
    width and biases); appends what ptdp cannot express to ``problems``. ``defaults``: the family's
    ``rms_norm_eps``, ``rope_theta`` and ``tie_word_embeddings`` (and its ``num_key_value_heads`` and
    ``head_dim`` where transformers' has them) for a config that leaves them out.
    Raises CheckpointError for a missing :data:`REQUIRED` field."""
    missing = [f for f in REQUIRED if f not in config]
    if missing:
        raise CheckpointError(f"the {family} config.json has no {', '.join(missing)}")
    h, a = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads", defaults.get("num_key_value_heads")) or a
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r} (ptdp's SwiGLU uses silu)")
    head_dim = config.get("head_dim", defaults.get("head_dim"))
    if h % a and head_dim is None:
        problems.append(f"hidden_size={h} is not a multiple of num_attention_heads={a} and head_dim is not given")
    if a % kv:
        problems.append(f"num_attention_heads={a} is not a multiple of num_key_value_heads={kv}")
    for field in ("rope_scaling", "rope_parameters"):  # transformers 4 / 5 spelling
        if (config.get(field) or {}).get("rope_type", (config.get(field) or {}).get("type", "default")) != "default":
            problems.append(f"{field}={config[field]!r} (ptdp has plain rotary positions, rope_type 'default')")
    rope = config.get("rope_parameters") or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']!r}")
    return dict(
        num_layers=config["num_hidden_layers"],
        hidden_size=h,
        num_attention_heads=a,
        seq_length=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        layernorm_epsilon=config.get("rms_norm_eps", defaults["rms_norm_eps"]),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", defaults["tie_word_embeddings"]),
        init_method_std=config.get("initializer_range", 0.02),
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=float(rope.get("rope_theta", config.get("rope_theta", defaults["rope_theta"]))),
        num_query_groups=None if kv == a else kv,
        kv_channels=None if head_dim is None or head_dim * a == h else head_dim,
    )


def window_problem(config: dict, window: int | None, where: str) -> list[str]:
    """A sliding ``window`` shorter than ``max_position_embeddings`` (ptdp attends to every earlier
    position), named as ``where`` (the config's fields)."""
    if window is not None and window < config.get("max_position_embeddings", 0):
        return [f"{where} (a sliding attention window of {window} < max_position_embeddings; ptdp attends to all)"]
    return []


def model_config_from_llama(config: dict) -> ModelConfig:
    """ptdp's model for a Llama ``config.json`` (raises CheckpointError naming what ptdp lacks)."""
    problems: list[str] = []
    defaults = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    fields = decoder_fields(config, "Llama", defaults, problems)
    attention_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        problems.append(
            f"attention_bias={attention_bias} with mlp_bias={mlp_bias} (ptdp's --disable-bias-linear sets both)"
        )
    if problems:
        raise CheckpointError("this Llama cannot be expressed in ptdp: " + "; ".join(problems))
    return ModelConfig(**fields, ffn_hidden_size=config["intermediate_size"], add_bias_linear=attention_bias)


def _inputs(kind: str, width: int) -> tuple[int, ...]:
    """The trailing shape of a linear layer's weight (its input width) or bias (none)."""
    return (width,) if kind == "weight" else ()


def from_llama(
    m: ModelConfig,
    hf: dict[str, torch.Tensor],
    *,
    family: str = "Llama",
    moe: MoEConfig | None = None,
    experts: ExpertNames | None = None,
) -> dict[str, torch.Tensor]:
    """The family's state dict -> ptdp's stored model tensors, the MoE layers of ``moe`` read as
    ``experts`` names them (:func:`~ptdp.run.checkpoint.hf_moe.experts_from_hf`); every tensor must
    be there with its shape and nothing else (but rotary buffers) may be (CheckpointError naming
    ``family`` otherwise)."""
    h, a, ffn, v = m.hidden_size, m.num_attention_heads, m.ffn, m.vocab_size
    groups, d = m.num_query_groups, m.head_dim
    kv_rows = m.kv_heads * d
    routed = moe.moe_layers(m.num_layers) if moe is not None else (False,) * m.num_layers
    unused = {name for name in hf if not name.endswith("rotary_emb.inv_freq")}

    def take(name: str, *shape: int) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"the {family} model has no tensor {name}")
        if tuple(hf[name].shape) != shape:
            raise CheckpointError(f"{name} has shape {tuple(hf[name].shape)}, the config needs {shape}")
        unused.discard(name)
        return hf[name]

    sd = {
        "word_embeddings.weight": take("model.embed_tokens.weight", v, h),
        "final_norm.weight": take("model.norm.weight", h),
    }
    if m.untie_embeddings_and_output_weights:
        sd["output_layer.weight"] = take("lm_head.weight", v, h)
    else:
        unused.discard("lm_head.weight")  # a tied copy, if saved
    for i in range(m.num_layers):
        pre, names = f"model.layers.{i}.", _layer_names(i, m.qk_layernorm, not routed[i])
        sd[f"layers.{i}.ln1.weight"] = take(names["ln1"] + ".weight", h)
        sd[f"layers.{i}.ln2.weight"] = take(names["ln2"] + ".weight", h)
        if m.qk_layernorm:
            for x in ("q_norm", "k_norm"):
                sd[f"layers.{i}.attention.{x}.weight"] = take(names[f"attention.{x}"] + ".weight", d)
        for kind in ("weight", "bias") if m.add_bias_linear else ("weight",):
            q = take(f"{pre}self_attn.q_proj.{kind}", a * d, *_inputs(kind, h))
            k, v_ = (take(f"{pre}self_attn.{x}_proj.{kind}", kv_rows, *_inputs(kind, h)) for x in "kv")
            sd[f"layers.{i}.attention.qkv.{kind}"] = _fuse_qkv(q, k, v_, a, groups, d).contiguous()
            proj = f"{names['attention.proj']}.{kind}"
            sd[f"layers.{i}.attention.proj.{kind}"] = take(proj, h, *_inputs(kind, a * d))
            if not routed[i]:
                gate, up = (take(f"{pre}mlp.{x}_proj.{kind}", ffn, *_inputs(kind, h)) for x in ("gate", "up"))
                sd[f"layers.{i}.mlp.fc1.{kind}"] = torch.stack((gate, up))
                sd[f"layers.{i}.mlp.fc2.{kind}"] = take(f"{names['mlp.fc2']}.{kind}", h, *_inputs(kind, ffn))
        if routed[i]:
            if moe is None or moe.num_experts is None or experts is None:
                raise ValueError(f"layer {i} is an MoE layer: its options and the family's expert names are needed")
            sd |= experts_from_hf(
                experts, i, take, hf.__contains__, experts=moe.num_experts, ffn=moe.expert_ffn(ffn), hidden=h
            )
    if unused:
        listed = ", ".join(sorted(unused)[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise CheckpointError(f"the {family} model has tensors its config does not explain: {listed}")
    return sd
