"""What transformers assumes for the fields :mod:`ptdp.planner.inputs.hf_config` reads when a
``config.json`` leaves one out, by ``model_type``."""

from __future__ import annotations

#: transformers' defaults (its ``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``,
#: ``GPT2Config``)
#: for the fields hf_config reads, used when a config.json leaves one out.
DEFAULTS: dict[str, dict] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": None,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "tie_word_embeddings": False,
        "head_dim": None,
        "sliding_window": 4096,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "gpt2": {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "tie_word_embeddings": True,
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "add_cross_attention": False,
    },
}
