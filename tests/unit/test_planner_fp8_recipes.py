"""FP8 as ``ptdp train`` runs it (``--fp8-format``, ``--fp8-recipe``): what its layers keep for
backward and the candidate of a run. Transformer Engine's FP8 (precision "fp8" without a recipe):
tests/unit/test_planner_fp8.py."""

from __future__ import annotations

import dataclasses

import pytest

import ptdp
from ptdp.planner.candidate import Candidate, run_candidate
from ptdp.planner.inputs.hardware import CATALOG
from ptdp.planner.inputs.models import get_model, gpt
from ptdp.planner.memory.activations import fp8_kept_bytes, layer_activation_bytes
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.fp8 import FP8_WEIGHT_COPY_BYTES, layer_fp8_weights

H100 = CATALOG["h100-sxm"]
LLAMA = get_model("llama3-8b")


@pytest.mark.parametrize("model", [LLAMA, gpt(4, 1024, 16, seq_length=2048)], ids=["swiglu-gqa", "gpt"])
@pytest.mark.parametrize("sp", [False, True])
def test_ptdp_keeps_16_bit_input_shards_under_sp_and_the_flash_output(model, sp):
    """Beside Transformer Engine's FP8: with sequence parallelism QKV and fc1 keep their 2-byte
    input shard (h / t per token each, instead of 1 byte), and a flash kernel keeps the attention
    output (2 bytes, ``a d / t``) beside the projection's FP8 copy (the GPT preset, trained with
    dropout, runs the unfused kernel, which keeps no output)."""
    t, b = 4, 2
    kw = dict(sequence_parallel=sp, recompute="none", precision="fp8")
    te = layer_activation_bytes(model, t, b, **kw)
    ptdp_fp8 = layer_activation_bytes(model, t, b, **kw, fp8_recipe="tensorwise")
    h, a, d = model.hidden_size, model.num_attention_heads, model.head_dim
    tokens = b * model.seq_length
    flash = 2 * a * d / t if model.flash_attention else 0
    assert ptdp_fp8 - te == pytest.approx(tokens * (flash + (2 * h / t if sp else 0)), rel=1e-12)
    # an unfused kernel keeps no output of its own; recomputed, the flash kernel keeps none either
    unfused = dataclasses.replace(model, use_flash_attn=False)
    gap = tokens * (2 * h / t if sp else 0)
    assert layer_activation_bytes(unfused, t, b, **kw, fp8_recipe="delayed") - layer_activation_bytes(
        unfused, t, b, **kw
    ) == pytest.approx(gap, rel=1e-12)
    selective = {**kw, "recompute": "selective"}
    assert layer_activation_bytes(model, t, b, **selective, fp8_recipe="delayed") - layer_activation_bytes(
        model, t, b, **selective
    ) == pytest.approx(gap, rel=1e-12)


def test_fp8_gemms_of_float32_parameters_keep_one_byte_inputs():
    """ptdp train runs FP8 GEMMs with float32 parameters too: the four inputs kept in 1 byte of
    4 (QKV and fc1 replicated, h each; fc2 ``ffn / t``); the projection's copy beside the flash
    kernel's 4-byte output; everything else float32."""
    model, t, b = LLAMA, 2, 1
    fp32 = layer_activation_bytes(model, t, b, sequence_parallel=False, recompute="none", precision="fp32")
    fp8 = layer_activation_bytes(
        model, t, b, sequence_parallel=False, recompute="none", precision="fp32", fp8_recipe="tensorwise"
    )
    h, a, d = model.hidden_size, model.num_attention_heads, model.head_dim
    saved = b * model.seq_length * (3 * 2 * h + 3 * model.ffn / t - a * d / t)
    assert fp32 - fp8 == pytest.approx(saved, rel=1e-12)


def test_rowwise_and_blockwise_keep_their_scales():
    """The kept FP8 input ``x^T [K, T]``: rowwise a float32 scale per row (4 / T per element),
    blockwise per 1x128 tile (4 ceil(T / 128) / T)."""
    assert fp8_kept_bytes("tensorwise", 100) == fp8_kept_bytes(None, 100) == 1.0
    assert fp8_kept_bytes("rowwise", 64) == 1.0 + 4 / 64
    assert fp8_kept_bytes("blockwise", 64) == 1.0 + 4 / 64
    assert fp8_kept_bytes("blockwise", 16384) == 1.0 + 4 / 128
    assert fp8_kept_bytes("blockwise", 200) == 1.0 + 8 / 200


def test_ptdp_keeps_every_layers_weight_copies_under_zero3():
    """ptdp train keeps each FP8 GEMM weight's two copies until the step ends, sharded or not;
    Transformer Engine under ZeRO-3 only the two gathered layers'."""
    layout = Candidate.of(
        tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8, precision="fp8", sharding="optim_grads_params"
    )
    bf16 = memory_breakdown(LLAMA, layout.replace(precision="bf16"), H100)
    te = memory_breakdown(LLAMA, layout, H100)
    ours = memory_breakdown(LLAMA, layout.replace(fp8_recipe="delayed"), H100)
    per_layer = FP8_WEIGHT_COPY_BYTES * layer_fp8_weights(LLAMA, 2)
    assert te.params - bf16.params == pytest.approx(2 * per_layer, rel=1e-12)
    assert ours.params - bf16.params == pytest.approx(LLAMA.num_layers // 2 * per_layer, rel=1e-12)


@pytest.mark.parametrize("dtype,precision", [("bfloat16", "fp8"), ("float32", "fp32")])
def test_a_runs_candidate_carries_its_recipe(dtype, precision):
    kw = dict(world_size=2, tp=2, pp=1, params_dtype=dtype)
    layout = run_candidate(ptdp.load_config(**kw, fp8_format="hybrid", fp8_recipe="rowwise"))
    assert (layout.precision, layout.fp8_recipe, layout.fp8) == (precision, "rowwise", True)
    plain = run_candidate(ptdp.load_config(**kw))
    assert (plain.fp8_recipe, plain.fp8) == (None, False)
