"""Random local Hugging Face Qwen3, Mixtral and Qwen3-MoE models (float64, transformers' eager
experts) and the logits of ptdp models, for the interop tests of those families."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers.hf_llama import SEQ, VOCAB

#: the shape every family's test model shares: 2 layers, h 64, 4 heads of 24 channels in 2 groups
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)
#: model_type -> (config class, model class, its own fields)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=96)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_local_experts=4)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    ),
}


def random_hf(path, kind: str, **fields):
    """A random ``kind`` model in float64 (non-trivial norms), saved by ``save_pretrained`` to
    ``path`` (per-expert tensors, as transformers writes them); ``fields`` change its config."""
    import transformers

    config_cls, model_cls, own = FAMILIES[kind]
    config = getattr(transformers, config_cls)(**SHAPE | own | fields)
    config._experts_implementation = "eager"  # transformers' grouped GEMM takes no float64
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model


def load_hf(path, kind: str):
    """The ``kind`` model of the folder ``path``, float64, eager experts."""
    import transformers

    model_cls = getattr(transformers, FAMILIES[kind][1])
    return model_cls.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()


def full_logits(model, x: torch.Tensor) -> torch.Tensor:
    """A single-process ptdp model's logits ``[b, s, V]`` (real vocabulary)."""
    with torch.no_grad():
        h = model.embed(x)
        for layer in model.layers.values():
            h = layer(h)
        out = model.output_layer if hasattr(model, "output_layer") else model.word_embeddings
        return F.linear(model.final_norm(h), out.real_weight()).transpose(0, 1)  # [s, b, V] -> [b, s, V]


#: Logit tolerance against transformers in float64: its RMSNorms, rotary angles and routing
#: softmax run in float32 whatever the model's dtype (differences near 1e-6 on logits of about 4)
HF_TOL = dict(rtol=1e-6, atol=4e-6)
