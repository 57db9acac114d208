"""Hugging Face Llama interop at (2,2,1): a random local LlamaForCausalLM -> ptdp checkpoint -> logits
at tp=2 pp=2 equal transformers' -> export -> identical tensors."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.dist_helpers import run_in_pool
from helpers.hf_helpers import tp2_pp2_logits_worker
from helpers.hf_llama import HIDDEN, SEQ, VOCAB, assert_same_state, random_llama, tokens
from ptdp.run.checkpoint.hf import configs_from_hf, export_hf, import_hf

transformers = pytest.importorskip("transformers")


def test_llama_import_logits_at_tp2_pp2_and_export_round_trip(tmp_path):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "exported"
    reference = random_llama(hf_dir)
    import_hf(hf_dir, ckpt)
    config = json.loads((hf_dir / "config.json").read_text())
    m, _ = configs_from_hf(config)
    assert (m.num_query_groups, m.rotary_base, m.add_bias_linear, m.untie_embeddings_and_output_weights) == (
        2,
        5000.0,
        False,
        True,
    )
    results = run_in_pool(tp2_pp2_logits_worker, 4, str(ckpt), config, tokens(), VOCAB)
    with torch.no_grad():
        expected = reference(tokens()).logits
    for logits in results[2:]:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    export_hf(ckpt, out)
    written = json.loads((out / "config.json").read_text())
    assert {
        k: written[k]
        for k in (
            "architectures",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "num_hidden_layers",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
            "vocab_size",
            "tie_word_embeddings",
            "attention_bias",
            "mlp_bias",
            "torch_dtype",
        )
    } == {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0,
        "max_position_embeddings": SEQ,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    assert_same_state(reference.state_dict(), transformers.LlamaForCausalLM.from_pretrained(out).state_dict())
