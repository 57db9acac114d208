"""Throughput as logged: the model FLOPs of a step are the planner's (and [K22]'s formula for GPT),
tokens/s, TFLOP/s per GPU and MFU follow from the step time, and the device peak comes from the
catalog (CUDA device names) or a calibrated profile (CPU)."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.layout_cases import tiny_config
from ptdp.planner.candidate import run_candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster, GPUType
from ptdp.planner.time.constants import DEFAULT_CONSTANTS
from ptdp.planner.time.profile import save_profile
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.run.throughput import Throughput, catalog_gpu, device_peak, step_model_flops


def k22_model_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """[K22] §6: 72 B s l h^2 (1 + s/(6h) + V/(12 h l)), written out independently of the planner."""
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * h * l))


def test_a_gpt_step_counts_the_papers_model_flops():
    cfg = tiny_config(1, 1, 1, "float32", ffn_hidden_size=None, seq_length=16)
    m = cfg.model
    expected = k22_model_flops(cfg.train.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size)
    assert step_model_flops(cfg) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_the_step_flops_are_the_planners_mfu_numerator_whatever_the_recompute(recompute):
    """Model FLOPs: recompute not counted, the same count the planner's MFU divides (for a
    Llama-style model too, where no closed formula applies)."""
    cfg = tiny_config(
        2,
        2,
        1,
        "bfloat16",
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        num_query_groups=2,
        recompute_granularity=recompute,
    )
    cluster = Cluster(CATALOG["h100"], cfg.world_size)
    perf = evaluate_performance(cfg.model, run_candidate(cfg), cluster, DEFAULT_CONSTANTS)
    assert step_model_flops(cfg) == perf.model_flops
    assert step_model_flops(cfg) == step_model_flops(
        tiny_config(
            2,
            2,
            1,
            "bfloat16",
            swiglu=True,
            normalization="RMSNorm",
            position_embedding_type="rope",
            num_query_groups=2,
        )
    )


def test_rates_follow_from_the_step_time():
    rate = Throughput(tokens_per_step=8 * 32, flops_per_step=6.0e12, world=4, peak_flops=2.0e12)
    out = rate.of(0.5)
    assert out == {
        "tokens_per_s": 8 * 32 / 0.5,
        "tflops_per_gpu": 6.0e12 / 0.5 / 4 / 1e12,
        "mfu": 6.0e12 / 0.5 / 4 / 2.0e12,
    }
    assert "mfu" not in dataclasses.replace(rate, peak_flops=None).of(0.5)


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
    ],
)
def test_cuda_device_names_match_the_catalog(name, key):
    gpu = catalog_gpu(name)
    assert (gpu.name if gpu else None) == (CATALOG[key].name if key else None)


def test_the_cpu_peak_is_the_calibrated_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("PTDP_CACHE_DIR", str(tmp_path / "empty"))
    cfg = tiny_config(1, 1, 1, "float32")
    assert device_peak(cfg, "cpu")[0] is None
    assert Throughput.for_run(cfg, "cpu").peak_flops is None
    profile = tmp_path / "profile.json"
    gpu = GPUType("local", {"fp32": 5.0e10}, 1e9, 1e10, 0.0, 1e9, gpus_per_node=2, shared_cores=2)
    save_profile(profile, gpu, DEFAULT_CONSTANTS, {})
    cfg = dataclasses.replace(cfg, hardware_profile=str(profile))
    assert device_peak(cfg, "cpu") == (5.0e10, f"profile {profile}")
    assert Throughput.for_run(cfg, "cpu").peak_flops == 5.0e10
    # a precision the profile has no peak for, and float64 (no peak anywhere): no MFU
    for dtype in ("bfloat16", "float64"):
        other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, params_dtype=dtype))
        assert device_peak(other, "cpu")[0] is None, dtype


def test_the_trainers_lines_carry_throughput_mfu_memory_and_the_loss_scale(tmp_path, monkeypatch):
    """One process through ``ptdp.run.trainer.train`` in float16, with a calibrated profile at the
    default place: every training line has the fields, consistent with its step time."""
    import json

    from helpers.sync_cases import ITERS, counted_run, logged
    from ptdp.engine.groups import ParallelGroups
    from ptdp.run.profiling import process_peak_rss

    monkeypatch.setenv("PTDP_CACHE_DIR", str(tmp_path / "cache"))
    gpu = GPUType("local", {"fp16": 4.0e10}, 1e9, 1e10, 0.0, 1e9, gpus_per_node=1, shared_cores=1)
    save_profile(tmp_path / "cache" / "hardware-profile.json", gpu, DEFAULT_CONSTANTS, {})
    counted_run(ParallelGroups.single_process(), 1, 1, 1, tmp_path / "run", "float16")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    assert [r["iteration"] for r in train] == [i for i in range(1, ITERS + 1) if logged(i)]
    cfg = tiny_config(1, 1, 1, "float16")
    flops = step_model_flops(cfg)  # the synthetic data's vocabulary is the config's
    for r in train:
        t = r["step_time_s"]
        assert r["tokens_per_s"] == pytest.approx(cfg.train.global_batch_size * cfg.model.seq_length / t, rel=1e-12)
        assert r["tflops_per_gpu"] == pytest.approx(flops / t / 1e12, rel=1e-12)
        assert r["mfu"] == pytest.approx(flops / t / 4.0e10, rel=1e-12)
        assert r["loss_scale"] > 0
        assert 0 < r["peak_memory_bytes"] <= process_peak_rss()


@pytest.mark.gpu
def test_on_cuda_the_lines_carry_the_allocators_peak_and_the_catalog_mfu_without_extra_synchronisation(tmp_path):
    """On one GPU in bfloat16: the peak-memory reduction is read in the step results' one
    synchronisation (none in a step that is not logged); peak_memory_bytes is the allocator's peak;
    mfu is there exactly when the device name is a catalog GPU, against its bf16 peak."""
    import json

    import torch

    from helpers.sync_cases import counted_run, logged
    from ptdp.engine.groups import ParallelGroups

    torch.cuda.reset_peak_memory_stats()
    run = counted_run(ParallelGroups.single_process(), 1, 1, 1, tmp_path / "run", "bfloat16", device="cuda")
    for iteration, calls in run["per_step"].items():
        if iteration > 1:
            assert len(calls) == (1 if logged(iteration) else 0), (iteration, calls)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    assert 0 < train[-1]["peak_memory_bytes"] <= torch.cuda.max_memory_allocated()
    gpu = catalog_gpu(torch.cuda.get_device_name())
    for r in train:
        assert ("mfu" in r) == (gpu is not None)
        if gpu is not None:
            assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] * 1e12 / gpu.peak("bf16"), rel=1e-12)
