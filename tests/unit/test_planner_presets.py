"""The Llama and Nemotron presets' parameter counts: exact against transformers' models of the
same shape (built on the meta device, so no memory), and equal to the published checkpoint sizes."""

from __future__ import annotations

import dataclasses

import pytest

from ptdp.planner.inputs.models import PRESETS
from ptdp.planner.memory.params import stage_param_counts

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

#: Bytes of the published bf16 checkpoints (2 per parameter): ``total_size`` of the
#: ``model.safetensors.index.json`` of meta-llama/Llama-3.1-8B (16,060,522,496) and
#: meta-llama/Llama-3.1-70B (141,107,412,992), and the weight bytes of Meta-Llama-3.1-405B
#: (811,706,777,600); Llama 3 and 3.1 share these shapes (Dubey et al. 2024, arXiv:2407.21783,
#: Table 3, name them 8B, 70B and 405B).
CHECKPOINT_BYTES = {"llama3-8b": 16_060_522_496, "llama3-70b": 141_107_412_992, "llama3-405b": 811_706_777_600}


def _count(model) -> int:
    return sum(stage_param_counts(model, 1, 1, make_vocab_size_divisible_by=1))


@pytest.mark.parametrize("name", [n for n in sorted(PRESETS) if n.startswith("llama")])
def test_llama_presets_equal_transformers(name):
    """Two layers of the preset's width (the count is linear in the layers) against transformers."""
    m = dataclasses.replace(PRESETS[name], num_layers=2)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.kv_heads,
        intermediate_size=m.ffn,
        vocab_size=m.vocab_size,
        tie_word_embeddings=m.tied,
    )
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    assert _count(m) == sum(p.numel() for p in hf.parameters())


def test_nemotron4_340b_equals_transformers():
    """Two layers of Nemotron-4 340B's width against transformers' NemotronForCausalLM (LayerNorm
    with biases, a two-matrix squared-ReLU MLP, no linear biases, untied), and its 341.0B total
    next to the published "340B"."""
    m = dataclasses.replace(PRESETS["nemotron4-340b"], num_layers=2)
    config = transformers.NemotronConfig(
        num_hidden_layers=2,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.kv_heads,
        intermediate_size=m.ffn,
        vocab_size=m.vocab_size,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        hf = transformers.NemotronForCausalLM(config)
    assert _count(m) == sum(p.numel() for p in hf.parameters())
    assert _count(PRESETS["nemotron4-340b"]) / 340e9 - 1 == pytest.approx(0, abs=0.005)


@pytest.mark.parametrize("name", sorted(CHECKPOINT_BYTES))
def test_llama3_presets_equal_published_checkpoints(name):
    assert 2 * _count(PRESETS[name]) == CHECKPOINT_BYTES[name]
