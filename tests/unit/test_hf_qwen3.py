"""Hugging Face Qwen3 (dense) interop in one process: a random ``Qwen3ForCausalLM`` (heads of 24
channels, h / a = 16, query/key norms, 2 key/value groups) imported gives transformers' logits and
exports back to the same tensors; a ptdp-trained model with ``--kv-channels`` and
``--qk-layernorm`` runs in transformers; what ptdp cannot express is refused, naming the field.

Float64 on both sides, compared within :data:`~helpers.hf_families.HF_TOL`: transformers computes
its RMSNorms and rotary angles in float32 whatever the model's dtype."""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers.hf_families import HF_TOL, full_logits, load_hf, random_hf
from helpers.hf_llama import assert_same_state, tokens
from helpers.layout_cases import rank_microbatches
from ptdp.commands.generate import load_for_inference
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.run.checkpoint.folders import CheckpointError
from ptdp.run.checkpoint.hf import configs_from_hf, export_hf, import_hf
from ptdp.run.checkpoint.io import save_checkpoint

transformers = pytest.importorskip("transformers")

QWEN3 = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    kv_channels=12,
    qk_layernorm=True,
    num_query_groups=2,
)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_import_gives_transformers_logits_and_exports_the_same_tensors(tmp_path, tied):
    reference = random_hf(tmp_path / "hf", "qwen3", tie_word_embeddings=tied)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, meta, _ = load_for_inference(tmp_path / "ckpt", "float64")
    m = meta["model"]
    assert (m["kv_channels"], m["qk_layernorm"], m["num_query_groups"], meta["moe"]["num_experts"]) == (
        24,
        True,
        2,
        None,
    )
    with torch.no_grad():
        expected = reference(tokens()).logits
    torch.testing.assert_close(full_logits(model, tokens()), expected, **HF_TOL)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 24
    assert_same_state(reference.state_dict(), load_hf(tmp_path / "out", "qwen3").state_dict())


def test_ptdp_trained_qwen3_runs_in_transformers(tmp_path):
    model = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=303,
        params_dtype="float64",
        **QWEN3,
    )
    train = TrainConfig(micro_batch_size=2, global_batch_size=4, train_iters=2, lr=3e-3)
    cfg = resolve(Config(model=model, parallel=ParallelConfig(1, 1, 1), train=train), 1)
    stage = build_stage(cfg, ParallelGroups.single_process())
    for i in range(2):
        train_step(stage, rank_microbatches(i, cfg, 0, 1), i)
    save_checkpoint(stage, tmp_path / "ckpt", 2, consumed_samples=8)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    theirs = load_hf(tmp_path / "hf", "qwen3")
    x = tokens(303, 8)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, full_logits(stage.model.eval(), x), **HF_TOL)
    norms = [p for n, p in stage.model.named_parameters() if n.endswith("q_norm.weight")]
    assert norms and not torch.equal(norms[0], torch.ones_like(norms[0]))  # trained, not the initial ones


def test_what_qwen3_cannot_map_is_refused(tmp_path):
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "max_position_embeddings": 16,
    }
    assert configs_from_hf(base)[0].head_dim == 24
    window = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    assert configs_from_hf(base | window | {"max_window_layers": 2})[0].qk_layernorm  # no layer slides
    for extra, field in [
        (window, "use_sliding_window=True with sliding_window=8 (a sliding attention window of 8"),
        (window | {"layer_types": ["full_attention", "sliding_attention"]}, "use_sliding_window=True"),
        ({"attention_bias": True}, "attention_bias=True (biases on q, k, v and o but not the MLP)"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures=['Qwen3ForSequenceClassification']"),
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "ptdp reads one of GPT2LMHeadModel, LlamaForCausalLM"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(field)):
            configs_from_hf(base | extra)
    # a ptdp model with query/key norms that Qwen3 cannot express: linear biases, LayerNorm
    for options, message in [
        ({}, "add_bias_linear=True (Qwen3 has no MLP biases): Qwen3 cannot express it"),
        ({"normalization": "LayerNorm"}, "normalization='LayerNorm': neither GPT-2"),
    ]:
        fields = QWEN3 | {"add_bias_linear": True} | options
        model = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=303, **fields)
        train = TrainConfig(micro_batch_size=1, global_batch_size=1)
        cfg = resolve(Config(model=model, parallel=ParallelConfig(1, 1, 1), train=train), 1)
        folder = tmp_path / options.get("normalization", "biases")
        save_checkpoint(build_stage(cfg, ParallelGroups.single_process()), folder, 0, consumed_samples=0)
        with pytest.raises(CheckpointError, match=re.escape(message)):
            export_hf(folder, tmp_path / "out")
        assert not (tmp_path / "out").exists()
