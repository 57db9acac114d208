"""Hugging Face Llama interop in one process: a ptdp-trained Llama-like model exported and run by
transformers; tied / multi-head / multi-query / biased / wide-head variants; what cannot be mapped
(the round trip through tp=2 pp=2: tests/dist/test_hf_llama_dist.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_families import full_logits
from helpers.hf_llama import assert_same_state, random_llama, tokens
from helpers.layout_cases import VOCAB as TINY_VOCAB
from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.commands.generate import load_for_inference
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.run.checkpoint.folders import CheckpointError
from ptdp.run.checkpoint.hf import configs_from_hf, export_hf, import_hf
from ptdp.run.checkpoint.io import save_checkpoint

transformers = pytest.importorskip("transformers")

LLAMA_FLAGS = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


@pytest.mark.parametrize(
    "kv_heads,tied,bias,shard,head_dim",
    [(4, True, True, None, None), (1, False, False, "40KB", None), (2, False, False, None, 24)],
    ids=["multi-head-tied-biases", "multi-query-sharded", "wide-heads"],
)
def test_llama_variants_in_one_process(tmp_path, kv_heads, tied, bias, shard, head_dim):
    reference = random_llama(tmp_path / "hf", kv_heads=kv_heads, tied=tied, bias=bias, shard=shard, head_dim=head_dim)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == bool(shard)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, meta, _ = load_for_inference(tmp_path / "ckpt")
    assert meta["model"]["num_query_groups"] == (None if kv_heads == 4 else kv_heads)
    assert meta["model"]["kv_channels"] == head_dim  # None: hidden / heads (16)
    with torch.no_grad():
        expected = reference(tokens()).logits
    torch.testing.assert_close(full_logits(model, tokens()), expected, rtol=1e-5, atol=1e-5)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert ("lm_head.weight" in load_file(tmp_path / "out" / "model.safetensors")) == (not tied)
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert_same_state(reference.state_dict(), again.state_dict())


def test_ptdp_trained_llama_runs_in_transformers(tmp_path):
    cfg = tiny_config(1, 1, 1, "float32", num_query_groups=2, rotary_base=500.0, **LLAMA_FLAGS)
    groups = ParallelGroups.single_process()
    stage = build_stage(cfg, groups)
    for i in range(2):
        train_step(stage, rank_microbatches(i, cfg, 0, 1), i)
    save_checkpoint(stage, tmp_path / "ckpt", 2, consumed_samples=2 * cfg.train.global_batch_size)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens(TINY_VOCAB, cfg.model.seq_length)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, full_logits(stage.model.eval(), x), rtol=1e-5, atol=1e-5)
    assert theirs.config.num_key_value_heads == 2 and theirs.config.vocab_size == TINY_VOCAB  # real rows only
    import_hf(tmp_path / "hf", tmp_path / "back")  # and back: the same model tensors
    model, _, _ = load_for_inference(tmp_path / "back")
    for (name, p), (other, q) in zip(stage.model.named_parameters(), model.named_parameters(), strict=True):
        rows = TINY_VOCAB if name in ("word_embeddings.weight", "output_layer.weight") else None  # not the padding
        assert name == other and torch.equal(p[:rows], q[:rows]), name


def test_what_cannot_be_mapped_is_refused(tmp_path):
    base = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "max_position_embeddings": 16,
    }
    for extra, field in [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters={'rope_type': 'yarn'"),
        ({"attention_bias": True}, "attention_bias=True with mlp_bias=False"),
        ({"hidden_size": 66}, "hidden_size=66 is not a multiple of num_attention_heads=4 and head_dim is not"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "mistral"}, "model_type 'mistral' is not one of gpt2, llama, qwen3, mixtral, qwen3_moe"),
        ({"hidden_size": None}, "has no hidden_size"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(field)):
            configs_from_hf({k: v for k, v in (base | extra).items() if v is not None})
    # tensors that do not fit the config
    random_llama(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 4}))
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \(32, 64\), the config needs \(64, 64\)"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    # a ptdp model that is neither GPT-2 nor Llama
    cfg = tiny_config(1, 1, 1, "float32", position_embedding_type="rope")
    save_checkpoint(build_stage(cfg, ParallelGroups.single_process()), tmp_path / "mix", 0, consumed_samples=0)
    with pytest.raises(CheckpointError, match="normalization='LayerNorm', swiglu=False: neither GPT-2"):
        export_hf(tmp_path / "mix", tmp_path / "out")
    assert not (tmp_path / "out").exists()
