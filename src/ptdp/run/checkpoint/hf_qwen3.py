"""Hugging Face Qwen3 interop: the ``config.json`` of ``Qwen3ForCausalLM`` (dense) and
``Qwen3MoeForCausalLM`` against ptdp's model and MoE options. Qwen3 is the Llama decoder
(:mod:`ptdp.run.checkpoint.hf_llama`) with ``head_dim`` (ptdp's ``--kv-channels``) and a
per-head RMSNorm of the queries and keys (``q_norm``, ``k_norm``: ``--qk-layernorm``), no biases;
Qwen3-MoE's MoE layers are :mod:`ptdp.run.checkpoint.hf_moe`'s.

- MoE layers: layer i when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) %
  decoder_sparse_step == 0`` (``--moe-layer-freq``, as one 0/1 per layer unless all are MoE);
  ``num_experts`` (transformers 5 writes ``num_local_experts``), ``num_experts_per_tok`` (k),
  ``moe_intermediate_size`` (the experts' width; ``intermediate_size`` is the dense layers').
- ``norm_topk_prob``: true renormalises the top-k probabilities (ptdp's default), false keeps the
  softmax over all experts (``--moe-router-pre-softmax``).
- Refused: ``attention_bias`` (q, k, v and o biases without MLP biases), sliding windows shorter
  than ``max_position_embeddings`` (``use_sliding_window``, ``layer_types``), and the
  :mod:`~ptdp.run.checkpoint.hf_llama` refusals.
"""

from __future__ import annotations

import torch

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.run.checkpoint.folders import CheckpointError
from ptdp.run.checkpoint.hf_llama import check_options, decoder_config, decoder_fields, window_problem
from ptdp.run.checkpoint.hf_moe import moe_layer_freq, routing_problems

#: Qwen3Config's and Qwen3MoeConfig's defaults of the shared fields a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
#: transformers' ``Qwen3Config`` / ``Qwen3MoeConfig`` head shape where a config.json leaves it out
HEADS = {"Qwen3": {"num_key_value_heads": 32, "head_dim": 128}, "Qwen3-MoE": {"num_key_value_heads": 4}}


def qwen3_config(m: dict, moe: MoEConfig, dtype: torch.dtype) -> dict:
    """``config.json`` of ``Qwen3ForCausalLM``, or with ``moe`` enabled ``Qwen3MoeForCausalLM``, for
    the checkpoint metadata's ``model`` (CheckpointError naming what Qwen3 lacks)."""
    family = "Qwen3-MoE" if moe.enabled else "Qwen3"
    check_options(m, family, qk_layernorm=True)
    problems = ["add_bias_linear=True (Qwen3 has no MLP biases)"] if m.get("add_bias_linear", True) else []
    problems += routing_problems(moe, renormalised_only=False) if moe.enabled else []
    if problems:
        raise CheckpointError(f"the model has {', '.join(problems)}: {family} cannot express it")
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if moe.enabled else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe.enabled else "qwen3",
        **decoder_config(m, dtype),
        "intermediate_size": m["ffn"],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if not moe.enabled:
        config["max_window_layers"] = m["num_layers"]
    else:
        layers = moe.moe_layers(m["num_layers"])
        config |= {
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.moe_router_topk,
            "moe_intermediate_size": moe.expert_ffn(m["ffn"]),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, on in enumerate(layers) if not on],
            "norm_topk_prob": not moe.moe_router_pre_softmax,
            "output_router_logits": False,
            "router_aux_loss_coef": moe.moe_aux_loss_coeff,
        }
    return config


def _sliding_problems(config: dict) -> list[str]:
    """Sliding windows: with ``use_sliding_window``, Qwen3-MoE's every layer and Qwen3's layers that
    ``layer_types`` names ``sliding_attention`` (without it: from ``max_window_layers`` on) attend
    to the last ``sliding_window`` positions only."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if window is not None and config.get("model_type") == "qwen3":
        first = config.get("max_window_layers", 28)
        types = config.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(config["num_hidden_layers"])
        ]
        window = window if "sliding_attention" in types else None
    return window_problem(config, window, f"use_sliding_window=True with sliding_window={window}")


def configs_from_qwen3(config: dict) -> tuple[ModelConfig, MoEConfig]:
    """ptdp's model and MoE options for a ``qwen3`` or ``qwen3_moe`` ``config.json`` (raises
    CheckpointError naming what ptdp lacks)."""
    family = "Qwen3-MoE" if config.get("model_type") == "qwen3_moe" else "Qwen3"
    problems: list[str] = []
    fields = decoder_fields(config, family, DEFAULTS | HEADS[family], problems)
    if config.get("attention_bias"):
        problems.append("attention_bias=True (biases on q, k, v and o but not the MLP)")
    problems += _sliding_problems(config)
    moe = MoEConfig()
    if family == "Qwen3-MoE":
        experts = config.get("num_experts", config.get("num_local_experts", 128))  # transformers 4 / 5 spelling
        step = config.get("decoder_sparse_step", 1)
        dense = set(config.get("mlp_only_layers") or ())
        layers = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(fields["num_layers"])]
        if any(layers):
            moe = MoEConfig(
                num_experts=experts,
                moe_router_topk=config.get("num_experts_per_tok", 8),
                moe_ffn_hidden_size=config.get("moe_intermediate_size", 768),
                moe_layer_freq=moe_layer_freq(layers),
                moe_router_pre_softmax=not config.get("norm_topk_prob", False),
            )
    if problems:
        raise CheckpointError(f"this {family} cannot be expressed in ptdp: " + "; ".join(problems))
    model = ModelConfig(**fields, ffn_hidden_size=config["intermediate_size"], add_bias_linear=False, qk_layernorm=True)
    return model, moe
