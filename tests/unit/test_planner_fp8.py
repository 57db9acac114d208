"""Precision "fp8" without a recipe, Transformer Engine's FP8 (:mod:`ptdp.planner.memory.fp8`): FP8
activation bytes, FP8 weight copies, the FP8 GEMM peak and casts; ``ptdp plan --fp8``'s errors before
any search; a published FP8 run on H100. ``ptdp train``'s recipes: tests/unit/test_planner_fp8_recipes.py."""

from __future__ import annotations

import dataclasses

import pytest

from ptdp.cli import main
from ptdp.errors import ConfigError
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import get_model, gpt
from ptdp.planner.memory.activations import layer_activation_bytes
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.fp8 import FP8_WEIGHT_COPY_BYTES, fp8_precision, layer_fp8_weights
from ptdp.planner.memory.params import layer_param_count
from ptdp.planner.time import flops
from ptdp.planner.time.constants import DEFAULT_CONSTANTS
from ptdp.planner.time.step_time import evaluate_performance

H100 = CATALOG["h100-sxm"]


@pytest.mark.parametrize(
    "model", [get_model("llama3-8b"), gpt(4, 1024, 16, seq_length=2048)], ids=["swiglu-gqa", "gpt"]
)
@pytest.mark.parametrize("t,sp", [(1, False), (4, False), (4, True)])
def test_fp8_keeps_the_four_gemm_inputs_in_one_byte(model, t, sp):
    kw = dict(sequence_parallel=sp, recompute="none")
    bf16 = layer_activation_bytes(model, t, 2, precision="bf16", **kw)
    fp8 = layer_activation_bytes(model, t, 2, precision="fp8", **kw)
    h, a = model.hidden_size, model.num_attention_heads
    d = h // a
    # QKV and fc1 inputs (h each, replicated over tp unless sp), projection input a d / t, fc2 input ffn / t:
    # one byte each instead of two
    saved = 2 * model.seq_length * (2 * h / (t if sp else 1) + (a * d + model.ffn) / t)
    assert bf16 - fp8 == pytest.approx(saved, rel=1e-12)
    # full recompute keeps the bf16 layer input either way
    assert layer_activation_bytes(
        model, t, 2, precision="fp8", sequence_parallel=sp, recompute="full"
    ) == layer_activation_bytes(model, t, 2, precision="bf16", sequence_parallel=sp, recompute="full")


def test_fp8_weight_copies_in_memory():
    model = get_model("llama3-8b")
    layout = Candidate.of(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8, precision="bf16")
    bf16 = memory_breakdown(model, layout, H100)
    fp8 = memory_breakdown(model, layout.replace(precision="fp8"), H100)
    copies = FP8_WEIGHT_COPY_BYTES * (model.num_layers // 2) * layer_fp8_weights(model, 2)
    assert fp8.stage == bf16.stage
    assert fp8.params - bf16.params == pytest.approx(copies, rel=1e-12)
    assert (fp8.grads, fp8.optimizer) == (bf16.grads, bf16.optimizer)
    assert fp8.activations < bf16.activations
    # the FP8 GEMM weights are the layer's parameters less its norms (Llama: no biases)
    assert layer_fp8_weights(model, 2) == layer_param_count(model, 2) - 2 * model.hidden_size


@pytest.mark.parametrize("sharding", ["optim", "optim_grads_params"])
def test_fp8_param_gather_keeps_the_gemm_weights_in_one_byte(sharding):
    """--fp8-param-gather: the FP8 GEMMs' weights are 1 byte (under optim_grads_params, whose shards
    are float32, the gathered layers) and have no FP8 copy; everything else as with --fp8."""
    model = get_model("llama3-8b")
    layout = Candidate.of(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8, precision="fp8", sharding=sharding)
    copies = memory_breakdown(model, layout, H100)
    fp8_params = memory_breakdown(model, layout.replace(fp8_param_gather=True), H100)
    bf16 = memory_breakdown(model, layout.replace(precision="bf16"), H100)
    # ZeRO-3's shards are float32: only its two gathered layers are FP8 (1 byte instead of 2)
    weights = (2 if sharding == "optim_grads_params" else model.num_layers // 2) * layer_fp8_weights(model, 2)
    assert fp8_params.stage == copies.stage == bf16.stage
    assert bf16.params - fp8_params.params == pytest.approx(weights, rel=1e-12)
    assert (fp8_params.grads, fp8_params.optimizer, fp8_params.activations) == (
        copies.grads,
        copies.optimizer,
        copies.activations,
    )


def test_cli_fp8_param_gather_and_bf16_gradients(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "16", "--tp", "2", "--pp", "1"]
    assert main([*base, "--gpu", "h100-sxm", "--fp8-param-gather"]) == 2
    assert "--fp8-param-gather keeps the FP8 GEMMs' weights in FP8: it needs --fp8" in capsys.readouterr().err
    flags = ["--fp8", "--fp8-param-gather", "--grad-reduce-in-bf16", "--top", "1", "--json"]
    assert main([*base, "--gpu", "h100-sxm", *flags]) == 0
    out = capsys.readouterr().out
    assert '"fp8_param_gather": true' in out and '"grad_reduce_in_bf16": true' in out


def test_fp8_gemms_at_the_fp8_peak_plus_casts():
    model = dataclasses.replace(get_model("llama3-70b"), num_layers=1)
    kw = (H100.peak("bf16"), 3.35e12 * 0.8, 0.77, 64.0)
    fwd, bwd, _ = flops.layer_compute_times(model, 4, 1, True, *kw)
    fwd8, bwd8, _ = flops.layer_compute_times(model, 4, 1, True, *kw, flops.FP8Gemms(None, H100.peak("fp8")))
    shapes = flops.layer_gemms(model, 4, 1)

    def linear(peak, nbytes):
        return sum(
            flops.gemm_time(
                *shapes[i],
                peak_flops=peak,
                bandwidth=kw[1],
                peak_fraction=0.77,
                half_dim=64.0,
                bytes_per_element=nbytes,
            )
            for i in flops.LINEAR_GEMMS
        )

    cast_f, cast_b = flops.fp8_cast_bytes(model, 4, 1)
    saved = linear(H100.peak("bf16"), 2.0) - linear(H100.peak("fp8"), 1.0)
    assert fwd - fwd8 == pytest.approx(saved - cast_f / kw[1], rel=1e-9)
    assert bwd - bwd8 == pytest.approx(2 * saved - cast_b / kw[1], rel=1e-9)
    assert saved == pytest.approx(linear(H100.peak("bf16"), 2.0) / 2, rel=1e-3)  # compute-bound GEMMs


def test_fp8_precision_checks():
    assert fp8_precision(H100, "bf16") == "fp8" == fp8_precision(CATALOG["h200"], "bf16")
    with pytest.raises(ConfigError, match="a100-80gb has no FP8 tensor cores"):
        fp8_precision(CATALOG["a100-80gb"], "bf16")
    with pytest.raises(ConfigError, match="requested precision is fp16"):
        fp8_precision(H100, "fp16")


def test_cli_fp8(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "16", "--tp", "2", "--pp", "1"]
    assert main([*base, "--gpu", "a100-80gb", "--fp8"]) == 2
    assert "no FP8 tensor cores" in capsys.readouterr().err
    assert main([*base, "--gpu", "h100-sxm", "--fp16", "--fp8"]) == 2
    capsys.readouterr()
    assert main([*base, "--gpu", "h100-sxm", "--fp8", "--json"]) == 0
    assert '"precision": "fp8"' in capsys.readouterr().out
    assert main([*base, "--gpu", "h100-sxm", "--fp8", "--top", "1"]) == 0
    assert "s=8192, flash attention, FP8 GEMMs (delayed);" in capsys.readouterr().out.splitlines()[0]
    assert main([*base, "--gpu", "h100-sxm", "--no-use-flash-attn", "--top", "1"]) == 0
    assert "s=8192, unfused attention;" in capsys.readouterr().out.splitlines()[0]


#: Megatron-Bridge performance summary (github.com/NVIDIA-NeMo/Megatron-Bridge,
#: docs/performance-summary-archive.md), DGX-H100, Llama 3 70B, FP8 (current scaling), 64 GPUs,
#: sequence 8192, micro batch 1, TP 4, PP 8, CP 1, VP 5, no FSDP: tokens/s per GPU by release
#: (global batch): 25.09 1619 (128), 25.11 1602 (128), 26.02 1621 (256).
LLAMA3_70B_FP8_H100 = [(128, 1619), (128, 1602), (256, 1621)]


@pytest.mark.parametrize("global_batch,tokens_per_gpu", LLAMA3_70B_FP8_H100)
def test_published_fp8_run_llama3_70b_on_h100(global_batch, tokens_per_gpu):
    """The run fits in 80 GB and its step is predicted within 25% (+17% today: the FP8 GEMMs run at
    the Hopper fit's share of the FP8 peak, as bf16 GEMMs do of theirs). Not stated by the source and
    assumed as Megatron-Bridge's recipes run it: sequence parallelism, the distributed optimizer,
    no recompute, the tensor-parallel communication overlapped with the GEMMs (all but one of tp
    chunks hidden, as ``ptdp.planner.validate.accuracy.run_constants`` counts it)."""
    model = get_model("llama3-70b")
    layout = Candidate.of(
        tp=4,
        pp=8,
        dp=2,
        micro_batch_size=1,
        global_batch_size=global_batch,
        virtual_stages=5,
        recompute="none",
        sequence_parallel=True,
        distributed_optimizer=True,
        precision="fp8",
    )
    assert memory_breakdown(model, layout, H100).total <= H100.memory_bytes
    constants = dataclasses.replace(DEFAULT_CONSTANTS.for_gpu(H100), tp_overlap=3 / 4)
    step = evaluate_performance(model, layout, Cluster(H100, 64), constants).step_time
    reported = global_batch * model.seq_length / (tokens_per_gpu * 64)
    assert step / reported - 1 == pytest.approx(0, abs=0.25)
    bf16 = evaluate_performance(model, layout.replace(precision="bf16"), Cluster(H100, 64), constants).step_time
    assert 1.2 < bf16 / step < 2.0  # FP8 speeds up the GEMMs only
