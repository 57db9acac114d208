"""FP8 as ``ptdp train`` runs it (``--fp8-format``, ``--fp8-recipe``): what its layers keep for
backward, its GEMMs' time by recipe (native, per-row scales, emulated), its casts, the recipe a
plan models and the candidate of a run. Transformer Engine's FP8 (precision "fp8" without a
recipe): tests/unit/test_planner_fp8.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import ptdp
from ptdp.cli import main
from ptdp.planner.candidate import Candidate, run_candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import get_model, gpt
from ptdp.planner.memory.activations import fp8_kept_bytes, layer_activation_bytes
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.fp8 import FP8_WEIGHT_COPY_BYTES, layer_fp8_weights
from ptdp.planner.time import flops
from ptdp.planner.time.constants import DEFAULT_CONSTANTS
from ptdp.planner.time.stages import fp8_gemms
from ptdp.planner.time.step_time import evaluate_performance

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


def test_how_each_recipe_runs_its_gemms():
    """tensorwise and delayed on the FP8 tensor cores, rowwise at its efficiency, blockwise
    emulated at TF32; without an FP8 peak (a calibrated CPU) every recipe emulated at float32."""
    c = DEFAULT_CONSTANTS
    layout = Candidate.of(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=8, precision="fp8")
    assert fp8_gemms(layout.replace(precision="bf16"), H100, c) is None
    fp8 = H100.sustained_peak("fp8")
    assert fp8_gemms(layout, H100, c) == flops.FP8Gemms(None, fp8, 1.0, H100.sustained_peak("tf32"))
    for recipe in ("tensorwise", "delayed"):
        assert fp8_gemms(layout.replace(fp8_recipe=recipe), H100, c).native_peak == fp8
    rowwise = fp8_gemms(layout.replace(fp8_recipe="rowwise"), H100, c)
    assert (rowwise.native_peak, rowwise.efficiency) == (fp8, c.fp8_rowwise_gemm_efficiency)
    blockwise = fp8_gemms(layout.replace(fp8_recipe="blockwise"), H100, c)
    assert (blockwise.native_peak, blockwise.emulated_peak) == (0.0, H100.sustained_peak("tf32"))
    cpu = dataclasses.replace(H100, peak_flops={"fp32": 1e12})
    fp32 = layout.replace(precision="fp32", fp8_recipe="tensorwise")
    assert fp8_gemms(fp32, cpu, c) == flops.FP8Gemms("tensorwise", 0.0, 1.0, cpu.sustained_peak("fp32"), 4.0)


def test_fp8_gemm_time_native_rowwise_and_emulated():
    kw = dict(bandwidth=3e12, peak_fraction=0.6, half_dim=128.0)
    shape = (8192, 4096, 4096, 1)
    native = flops.FP8Gemms("tensorwise", 2e15)
    assert flops.fp8_gemm_time(*shape, native, **kw) == flops.gemm_time(
        *shape, peak_flops=2e15, bytes_per_element=1.0, **kw
    )
    rowwise = dataclasses.replace(native, efficiency=0.65)
    assert flops.fp8_gemm_time(*shape, rowwise, **kw) == pytest.approx(
        flops.fp8_gemm_time(*shape, native, **kw) / 0.65, rel=1e-12
    )
    # emulated: a float32 GEMM, both operands dequantised, the result cast to bf16
    emulated = flops.FP8Gemms("blockwise", 0.0, emulated_peak=5e14)
    m, n, k, _ = shape
    gemm = flops.gemm_time(*shape, peak_flops=5e14, bytes_per_element=4.0, **kw)
    passes = (flops.FP8_DEQUANTIZE_BYTES + flops.FP8_TILE_SCALE_BYTES) * (m * k + n * k) + 6.0 * m * n
    assert flops.fp8_gemm_time(*shape, emulated, **kw) == pytest.approx(gemm + passes / 3e12, rel=1e-12)
    # no kernel for K or N off a multiple of 16: emulated at the emulation's peak
    odd = flops.FP8Gemms("tensorwise", 2e15, emulated_peak=5e14)
    assert flops.fp8_gemm_time(8192, 4096, 4100, 1, odd, **kw) > flops.gemm_time(
        8192, 4096, 4100, 1, peak_flops=5e14, bytes_per_element=4.0, **kw
    )


@pytest.mark.parametrize("sp", [False, True])
def test_ptdp_casts_every_operand(sp):
    """Forward the four GEMM inputs, backward the four output gradients, each quantised (amax
    included) with tensorwise's FP8 transpose copied, rowwise's and blockwise's quantised again; with
    sequence parallelism QKV's and fc1's inputs once forward and once more in backward."""
    model, t, b = LLAMA, 2, 1
    h, a, d, kv, f = model.hidden_size, model.num_attention_heads, model.head_dim, model.kv_heads, model.ffn
    tokens = b * model.seq_length
    column, row = tokens * 2 * h, tokens * (a * d + f) / t
    grads = tokens * (2 * h + ((a + 2 * kv) * d + 2 * f) / t)
    q = 3 * 2 + (2 + 4) + 2 + flops.FP8_QUANTIZE_BYTES  # amax, cast to float32, infinity mask, the rest
    forward, backward = flops.fp8_cast_bytes(model, t, b, "tensorwise", sequence_parallel=sp)
    assert forward == pytest.approx(row * (q + 2) + column * (q if sp else q + 2), rel=1e-12)
    assert backward == pytest.approx(grads * (q + 2) + (column * (q + 2) if sp else 0), rel=1e-12)
    assert flops.fp8_cast_bytes(model, t, b, "delayed", sequence_parallel=sp) == (forward, backward)
    q = 5 * 2 + (2 + 4) + 2 + flops.FP8_QUANTIZE_BYTES  # per row: the padded |x| too
    forward, backward = flops.fp8_cast_bytes(model, t, b, "rowwise", sequence_parallel=sp)
    assert forward == pytest.approx(row * 2 * q + column * (q if sp else 2 * q), rel=1e-12)
    assert backward == pytest.approx(grads * 2 * q + (column * q if sp else 0), rel=1e-12)
    fp32 = flops.fp8_quantize_bytes("tensorwise", 4.0)
    assert fp32 == 3 * 4 + 4 + flops.FP8_QUANTIZE_BYTES  # no cast to float32


def test_step_time_by_recipe():
    """On H100: Transformer Engine's (fused casts) fastest, then tensorwise = delayed (the same
    passes), rowwise (slower GEMMs, two quantisations), blockwise (emulated)."""
    layout = Candidate.of(
        tp=2, pp=1, dp=4, micro_batch_size=1, global_batch_size=16, sequence_parallel=True, precision="fp8"
    )
    step = {
        recipe: evaluate_performance(LLAMA, layout.replace(fp8_recipe=recipe), Cluster(H100, 8)).time.step
        for recipe in (None, "tensorwise", "delayed", "rowwise", "blockwise")
    }
    assert step[None] < step["tensorwise"] == step["delayed"] < step["rowwise"] < step["blockwise"]


def test_fp8_emulated_on_a_cpu_profile_costs_more_than_float32():
    """A calibrated CPU has no FP8 peak: the FP8 GEMMs are float32 GEMMs plus the quantisation
    and dequantisation passes, so a float32 run with FP8 GEMMs is predicted slower than without."""
    cpu = dataclasses.replace(H100, name="local", peak_flops={"fp32": 2e11}, memory_bandwidth=2e10)
    model = gpt(4, 128, 4, seq_length=128, vocab_size=4096)
    layout = Candidate.of(tp=2, pp=1, dp=1, micro_batch_size=4, global_batch_size=32, precision="fp32")
    plain = evaluate_performance(model, layout, Cluster(cpu, 2, 2)).time.compute
    fp8 = evaluate_performance(model, layout.replace(fp8_recipe="tensorwise"), Cluster(cpu, 2, 2)).time.compute
    assert fp8 > plain
    assert math.isfinite(fp8)


def _plan(capsys, *flags: str) -> tuple[int, str, str]:
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch-size", "16"]
    code = main([*base, "--tp", "2", "--pp", "1", "--top", "1", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_recipe_a_plan_models(capsys):
    def recipe(*flags: str):
        code, out, _ = _plan(capsys, "--json", *flags)
        assert code == 0
        return {p["fp8_recipe"] for p in json.loads(out)}

    assert recipe("--fp8") == {"delayed"}  # ptdp train's default
    assert recipe("--fp8-format", "e4m3", "--fp8-recipe", "rowwise") == {"rowwise"}
    assert recipe("--fp8", "--fp8-param-gather") == {None}  # Megatron-LM's FP8 weights: Transformer Engine's
    assert recipe() == {None}
    code, out, _ = _plan(capsys, "--fp8-format", "hybrid", "--fp8-recipe", "blockwise")
    assert code == 0 and "blockwise FP8 is planned emulated" in out
    assert "FP8 GEMMs (blockwise)" in out
    code, _, err = _plan(capsys, "--fp8-recipe", "tensorwise", "--fp8-margin", "1")
    assert code == 2
    assert "--fp8-recipe tensorwise, --fp8-margin 1 without --fp8-format: no GEMM runs in FP8" in err


def test_a_mixture_of_experts_plans_transformer_engines_fp8_without_a_recipe(capsys):
    """--fp8 alone plans a mixture of experts as the published runs ran (Transformer Engine); with
    --fp8-recipe, as ptdp train runs its experts."""
    base = ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--gpu", "h100-sxm", "--global-batch-size", "256"]
    base += ["--fp8", "--top", "1", "--tp", "2", "--pp", "4", "--ep", "8"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "FP8 planned as Transformer Engine runs it under Megatron-Core (delayed scaling) for a mixture" in out
    assert main([*base, "--fp8-recipe", "tensorwise"]) == 0
    out = capsys.readouterr().out
    assert "FP8 experts planned as ptdp train runs them (tensorwise)" in out and "Transformer Engine" not in out
