"""Hugging Face Mixtral interop: the ``config.json`` of ``MixtralForCausalLM`` against ptdp's model
and MoE options. Mixtral is the Llama decoder (:mod:`ptdp.run.checkpoint.hf_llama`, no biases, no
query/key norms) whose every MLP is an MoE layer (:mod:`ptdp.run.checkpoint.hf_moe`):
``num_local_experts`` experts of width ``intermediate_size``, ``num_experts_per_tok`` (k) per
token, their top-k probabilities always renormalised (ptdp's default routing), no shared expert.

Refused: a ``sliding_window`` shorter than ``max_position_embeddings``, ``router_jitter_noise``
(multiplicative noise on the router's input while training, which ptdp does not apply), and the
:mod:`~ptdp.run.checkpoint.hf_llama` refusals.
"""

from __future__ import annotations

import torch

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.run.checkpoint.folders import CheckpointError
from ptdp.run.checkpoint.hf_llama import check_options, decoder_config, decoder_fields, window_problem
from ptdp.run.checkpoint.hf_moe import routing_problems

#: MixtralConfig's defaults of the shared fields a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "num_key_value_heads": 8}


def mixtral_config(m: dict, moe: MoEConfig, dtype: torch.dtype) -> dict:
    """``config.json`` of ``MixtralForCausalLM`` for the checkpoint metadata's ``model`` and its MoE
    options (CheckpointError naming what Mixtral lacks)."""
    check_options(m, "Mixtral", qk_layernorm=False)
    problems = ["add_bias_linear=True (Mixtral has no biases)"] if m.get("add_bias_linear", True) else []
    dense = [i for i, on in enumerate(moe.moe_layers(m["num_layers"])) if not on]
    if dense:
        problems.append(f"dense layers {dense} (every Mixtral layer is an MoE layer; Qwen3-MoE has dense ones)")
    problems += routing_problems(moe, renormalised_only=True)
    if problems:
        raise CheckpointError(f"the model has {', '.join(problems)}: Mixtral cannot express it")
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **decoder_config(m, dtype),
        "intermediate_size": moe.expert_ffn(m["ffn"]),
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.moe_router_topk,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "router_aux_loss_coef": moe.moe_aux_loss_coeff,
    }


def configs_from_mixtral(config: dict) -> tuple[ModelConfig, MoEConfig]:
    """ptdp's model and MoE options for a Mixtral ``config.json`` (raises CheckpointError naming
    what ptdp lacks)."""
    problems: list[str] = []
    fields = decoder_fields(config, "Mixtral", DEFAULTS, problems)
    window = config.get("sliding_window")
    problems += window_problem(config, window, f"sliding_window={window}")
    if config.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={config['router_jitter_noise']} (ptdp adds no noise to the router)")
    if problems:
        raise CheckpointError("this Mixtral cannot be expressed in ptdp: " + "; ".join(problems))
    model = ModelConfig(**fields, ffn_hidden_size=config["intermediate_size"], add_bias_linear=False)
    moe = MoEConfig(
        num_experts=config.get("num_local_experts", 8), moe_router_topk=config.get("num_experts_per_tok", 2)
    )
    return model, moe
