"""Flash vs unfused attention in the planner: activation bytes per layer against [K22]'s formula
(Korthikanti et al. 2022, arXiv:2205.05198, eq. 1-2 and §5) with the score term replaced by the
flash kernel's fp32 log-sum-exp; selective recompute saving and costing nothing with flash; the
attention time; the presets' and ``ptdp plan``'s default kernel."""

from __future__ import annotations

import dataclasses

import pytest

from ptdp.cli import build_parser
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import PRESETS, get_model, gpt
from ptdp.planner.memory.activations import layer_activation_bytes
from ptdp.planner.request import model_from_args
from ptdp.planner.search.layouts import Fixed, search
from ptdp.planner.time import flops

# GPT with dropout (the [K22] setting): a = 16, h = 1024, s = 2048, b = 2
GPT = gpt(4, 1024, 16, vocab_size=51200, seq_length=2048)


def _bytes(model, t, sp, rec, b=2):
    return layer_activation_bytes(model, t, b, sequence_parallel=sp, recompute=rec)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_unfused_and_flash_bytes_follow_k22(t):
    s, b, h, a = GPT.seq_length, 2, GPT.hidden_size, GPT.num_attention_heads
    sbh = s * b * h
    flash = dataclasses.replace(GPT, use_flash_attn=True)
    lse = 4 * a * s * b  # one fp32 log-sum-exp per head and token
    if t == 1:
        assert _bytes(GPT, 1, False, "none") == 34 * sbh + 5 * a * s * s * b
        assert _bytes(flash, 1, False, "none") == 34 * sbh + lse
    assert _bytes(GPT, t, False, "none") == pytest.approx(sbh * (10 + 24 / t) + 5 * a * s * s * b / t, rel=1e-12)
    assert _bytes(flash, t, False, "none") == pytest.approx(sbh * (10 + 24 / t) + lse / t, rel=1e-12)
    assert _bytes(GPT, t, True, "none") == pytest.approx((34 * sbh + 5 * a * s * s * b) / t, rel=1e-12)
    assert _bytes(flash, t, True, "none") == pytest.approx((34 * sbh + lse) / t, rel=1e-12)
    # selective recompute drops the score term of the unfused kernel and changes nothing with flash
    assert _bytes(GPT, t, True, "selective") == pytest.approx(34 * sbh / t, rel=1e-12)
    assert _bytes(flash, t, True, "selective") == _bytes(flash, t, True, "none")
    assert _bytes(flash, t, False, "selective") == _bytes(flash, t, False, "none")
    # full recompute keeps the layer input whatever the kernel
    assert _bytes(flash, t, True, "full") == _bytes(GPT, t, True, "full") == 2 * sbh / t


def test_flash_saves_the_scores_at_long_sequences():
    llama = get_model("llama3-405b")
    unfused = dataclasses.replace(llama, use_flash_attn=False)
    # at s = 8192 the unfused kernel's 2 a s bytes per token are 4x everything else (a = 128)
    ratio = _bytes(unfused, 8, True, "none", b=1) / _bytes(llama, 8, True, "none", b=1)
    s, h, a, kv, ffn = 8192, 16384, 128, 8, 53248
    d = h // a
    per_token_flash = (8 * h + 2 * (2 * a * d + 2 * kv * d + 3 * ffn) + 4 * a) / 8  # no dropout, SwiGLU
    per_token_unfused = per_token_flash - 4 * a / 8 + 2 * a * s / 8
    assert ratio == pytest.approx(per_token_unfused / per_token_flash, rel=1e-12)
    assert ratio > 5


def test_selective_recompute_costs_nothing_with_flash():
    flash = dataclasses.replace(GPT, use_flash_attn=True)
    base = flops.model_flops_per_step(flash, 64)
    assert flops.hardware_flops_per_step(flash, 64, "selective") == base
    assert flops.hardware_flops_per_step(GPT, 64, "selective") == pytest.approx(
        flops.model_flops_per_step(GPT, 64) + 64 * GPT.num_layers * 4 * 2048**2 * 1024, rel=1e-12
    )
    kw = dict(peak_flops=312e12, bandwidth=1.6e12, peak_fraction=0.77, half_dim=64.0)
    assert flops.layer_compute_times(flash, 2, 1, True, *kw.values())[2] == 0.0
    assert flops.layer_compute_times(GPT, 2, 1, True, *kw.values())[2] > 0.0


def test_flash_attention_time_is_compute_bound_causal_half():
    kw = (312e12, 1.6e12, 0.77, 64.0)
    flash = dataclasses.replace(GPT, use_flash_attn=True)
    fwd_f, bwd_f, _ = flops.layer_compute_times(flash, 1, 1, False, *kw)
    fwd_u, bwd_u, core_u = flops.layer_compute_times(GPT, 1, 1, False, *kw)
    s, d = GPT.seq_length, GPT.hidden_size // GPT.num_attention_heads
    eff = flops.gemm_efficiency(s, s, d, peak_fraction=0.77, half_dim=64.0)
    attention = 0.5 * flops.attention_core_flops(GPT, 1, 1) / (312e12 * eff)
    # the unfused layer minus its attention core (GEMMs + score bytes) plus the flash kernel
    assert fwd_f == pytest.approx(fwd_u - core_u + attention, rel=1e-12)
    scores = flops.layer_elementwise_bytes(GPT, 1, 1, sequence_parallel=False)[1]
    assert bwd_f == pytest.approx(
        bwd_u - 2 * (core_u - scores / 1.6e12) - 2 * scores / 1.6e12 + 2.5 * attention, rel=1e-12
    )
    assert flops.layer_elementwise_bytes(flash, 1, 1, sequence_parallel=False)[1] == 0.0


def test_presets_kernel():
    for name, model in PRESETS.items():  # the Megatron-paper GPT runs as published; today's models flash
        assert model.flash_attention == (not name.startswith("gpt")), name


def _args(*argv):
    return build_parser().parse_args(["plan", *argv])


@pytest.mark.parametrize(
    "argv,gpu,flash",
    [
        (["--model", "gpt3-175b"], "a100-80gb", False),  # as published
        (["--model", "gpt3-175b"], "h100-sxm", True),  # today's GPUs
        (["--model", "llama3-8b"], "a100-80gb", True),  # the Llama presets
        (["--model", "llama3-8b", "--no-use-flash-attn"], "h200", False),
        (["--model", "gpt-1.7b", "--use-flash-attn"], "a100-80gb", True),
        (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"], "a100-80gb", False),
        (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"], "h200", True),
    ],
)
def test_plan_flag_and_defaults(argv, gpu, flash):
    model, notes = model_from_args(_args(*argv), CATALOG[gpu])
    assert model.flash_attention is flash and notes == []


def test_search_does_not_list_selective_twice_with_flash():
    model = get_model("llama3-8b")
    result = search(
        model,
        Cluster(CATALOG["h100-sxm"], 8),
        64,
        fixed=Fixed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1),
    )
    assert result.plans and all(p.layout.recompute != "selective" for p in result.plans)
    fixed = search(
        model,
        Cluster(CATALOG["h100-sxm"], 8),
        64,
        fixed=Fixed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, recompute_granularity="selective"),
    )
    assert fixed.plans and {p.layout.recompute for p in fixed.plans} == {"selective"}
