"""Hugging Face MoE interop in one process: random ``MixtralForCausalLM`` and
``Qwen3MoeForCausalLM`` models (4 experts, top-2; Qwen3-MoE with renormalised and plain top-k
probabilities, dense layers by ``mlp_only_layers`` and by ``decoder_sparse_step``) imported give
transformers' logits and export back to the same tensors; the fused expert tensors of
transformers' modules import too; ptdp-trained MoE models run in transformers; ``ptdp convert``
prints the MoE flags; what ptdp or the family cannot express is refused, naming the field.

Float64 on both sides, compared within :data:`~helpers.hf_families.HF_TOL` (transformers' norms,
rotary angles and routing softmax run in float32); any expert chosen differently would be far
outside it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from helpers.hf_families import HF_TOL, full_logits, load_hf, random_hf
from helpers.hf_llama import assert_same_state, tokens
from helpers.layout_cases import rank_microbatches
from ptdp import cli
from ptdp.commands.convert import model_flags
from ptdp.commands.generate import load_for_inference
from ptdp.config.flags import config_from_args
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.config.train_flags import add_train_arguments
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.run.checkpoint.folders import CheckpointError, stored_moe
from ptdp.run.checkpoint.hf import configs_from_hf, export_hf, import_hf
from ptdp.run.checkpoint.io import save_checkpoint

transformers = pytest.importorskip("transformers")

LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_query_groups=2,
)

#: name -> (model_type, config fields, the MoE options ptdp reads)
CASES = {
    "mixtral": ("mixtral", {}, MoEConfig(num_experts=4, moe_router_topk=2)),
    "qwen3-moe-renormalised": (
        "qwen3_moe",
        {"norm_topk_prob": True, "mlp_only_layers": [0]},
        MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1)),
    ),
    "qwen3-moe-plain-top-k": (
        "qwen3_moe",
        {"norm_topk_prob": False, "decoder_sparse_step": 2},
        MoEConfig(
            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1), moe_router_pre_softmax=True
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_transformers_logits_and_exports_the_same_tensors(tmp_path, case):
    kind, fields, moe = CASES[case]
    reference = random_hf(tmp_path / "hf", kind, **fields)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, meta, _ = load_for_inference(tmp_path / "ckpt", "float64")
    assert stored_moe(meta) == moe
    assert (meta["model"]["kv_channels"], meta["model"]["qk_layernorm"]) == (24, kind == "qwen3_moe")
    with torch.no_grad():
        expected = reference(tokens()).logits
    torch.testing.assert_close(full_logits(model, tokens()), expected, **HF_TOL)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_same_state(reference.state_dict(), load_hf(tmp_path / "out", kind).state_dict())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [type(reference).__name__]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_the_fused_expert_tensors_of_transformers_modules_import_too(tmp_path, kind):
    """``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` [E, 2f, h] and ``mlp.experts.down_proj`` (the
    modules' state dict, not what save_pretrained writes) give the same checkpoint tensors."""
    reference = random_hf(tmp_path / "hf", kind)
    state = reference.state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"))
    import_hf(tmp_path / "hf", tmp_path / "a")
    import_hf(fused, tmp_path / "b")
    ours = [dict(load_for_inference(tmp_path / c, "float64")[0].named_parameters()) for c in ("a", "b")]
    assert ours[0].keys() == ours[1].keys()
    for name, p in ours[0].items():
        assert torch.equal(p, ours[1][name]), name


@pytest.mark.parametrize(
    "family,options,moe",
    [
        ("MixtralForCausalLM", {}, MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)),
        (
            "Qwen3MoeForCausalLM",
            {"kv_channels": 12, "qk_layernorm": True},
            MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=(1, 0)),
        ),
    ],
)
def test_ptdp_trained_moe_models_run_in_transformers(tmp_path, family, options, moe):
    model = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        seq_length=8,
        vocab_size=303,
        params_dtype="float64",
        **LLAMA | options,
    )
    train = TrainConfig(micro_batch_size=2, global_batch_size=4, train_iters=2, lr=3e-3)
    moe = dataclasses.replace(moe, moe_aux_loss_coeff=0.01)
    cfg = resolve(Config(model=model, moe=moe, parallel=ParallelConfig(1, 1, 1), train=train), 1)
    stage = build_stage(cfg, ParallelGroups.single_process())
    for i in range(2):
        train_step(stage, rank_microbatches(i, cfg, 0, 1), i)
    save_checkpoint(stage, tmp_path / "ckpt", 2, consumed_samples=8)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [family] and config["router_aux_loss_coef"] == 0.01
    theirs = load_hf(tmp_path / "hf", config["model_type"])
    x = tokens(303, 8)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, full_logits(stage.model.eval(), x), **HF_TOL)
    import_hf(tmp_path / "hf", tmp_path / "back")  # and back: the same MoE options and tensors
    again, meta, _ = load_for_inference(tmp_path / "back", "float64")
    back = stored_moe(meta)  # Mixtral has one width: the experts', which the import makes the dense one too
    assert back.expert_ffn(meta["model"]["ffn"]) == 24
    unset = dict(moe_ffn_hidden_size=None, moe_aux_loss_coeff=0.0)  # the loss: a training setting, not kept
    assert dataclasses.replace(back, **unset) == dataclasses.replace(moe, **unset)
    for (name, p), (other, q) in zip(stage.model.named_parameters(), again.named_parameters(), strict=True):
        rows = 303 if name in ("word_embeddings.weight", "output_layer.weight") else None  # not the padding
        assert name == other and torch.equal(p[:rows], q[:rows]), name


def test_convert_prints_the_flags_of_the_imported_moe_model(tmp_path, capsys):
    random_hf(tmp_path / "hf", "qwen3_moe", mlp_only_layers=[0], norm_topk_prob=False)
    assert cli.main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    for flag in ("--num-experts 4", "--moe-ffn-hidden-size 32", "--moe-layer-freq 0,1", "--moe-router-pre-softmax"):
        assert flag in out, flag
    model, moe = configs_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=True)
    parsed = config_from_args(parser.parse_args(model_flags(model, moe)))
    assert parsed.moe == moe and parsed.model == dataclasses.replace(model, vocab_size=parsed.model.vocab_size)


def test_what_cannot_be_mapped_is_refused(tmp_path):
    base = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # transformers' Mixtral default (8) does not divide 4 heads
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "max_position_embeddings": 16,
    }
    assert configs_from_hf(base | {"sliding_window": 16})[1].num_experts == 8  # a window as long as the sequence
    qwen = base | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    for config, field in [
        (base | {"sliding_window": 8}, "sliding_window=8 (a sliding attention window of 8 < max_position_embeddings"),
        (base | {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        (qwen | {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=True with sliding_window=4"),
        (base | {"model_type": "qwen2_moe"}, "architectures=['MixtralForCausalLM'] with model_type 'qwen2_moe'"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(field)):
            configs_from_hf(config)
    # ptdp MoE models Mixtral or Qwen3-MoE cannot express: named before anything is written
    qk = {"kv_channels": 12, "qk_layernorm": True}
    for options, moe, message in [
        (
            {},
            MoEConfig(num_experts=4, moe_shared_expert_intermediate_size=16),
            "moe_shared_expert_intermediate_size=16",
        ),
        ({}, MoEConfig(num_experts=4, moe_router_pre_softmax=True), "moe_router_pre_softmax=True: Mixtral cannot"),
        ({}, MoEConfig(num_experts=4, moe_layer_freq=(2,)), "dense layers [1] (every Mixtral layer is an MoE layer"),
        (qk, MoEConfig(num_experts=4, moe_router_score_function="sigmoid"), "moe_router_score_function='sigmoid'"),
        (qk, MoEConfig(num_experts=4, moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor=2.5"),
    ]:
        model = ModelConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=303, **LLAMA | options
        )
        train = TrainConfig(micro_batch_size=1, global_batch_size=1)
        cfg = resolve(Config(model=model, moe=moe, parallel=ParallelConfig(1, 1, 1), train=train), 1)
        folder = tmp_path / f"ckpt{len(message)}"
        save_checkpoint(build_stage(cfg, ParallelGroups.single_process()), folder, 0, consumed_samples=0)
        with pytest.raises(CheckpointError, match=re.escape(message)):
            export_hf(folder, tmp_path / "out")
        assert not (tmp_path / "out").exists()
