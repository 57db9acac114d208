"""``ptdp plan --calibrate`` on a GPU (skipped without CUDA): one worker measures on cuda:0 with
CUDA events and writes a profile holding the GPU's memory and rates above any CPU's."""

from __future__ import annotations

import argparse

import pytest
import torch

from ptdp.planner.time.profile import load_profile


@pytest.mark.gpu
def test_calibration_on_one_gpu_writes_a_gpu_profile(tmp_path):
    from ptdp.commands.calibrate import run_calibration

    out = tmp_path / "profile.json"
    args = argparse.Namespace(
        num_layers=2,
        hidden_size=1024,
        num_attention_heads=16,
        ffn_hidden_size=None,
        vocab_size=32000,
        seq_length=1024,
        micro_batch_size=2,
        global_batch_size=4,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        nproc_per_node=1,
        params_dtype="bfloat16",
        hardware_profile=str(out),
    )
    assert run_calibration(args) == 0
    gpu, constants = load_profile(out)
    assert gpu.shared_cores == 0 and gpu.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert gpu.peak("bf16") > 1e13  # tens of TFLOP/s at least on any data-centre GPU
    assert gpu.memory_bandwidth > 1e11 and constants.layer_overhead >= 0.0
    assert 0.02 < constants.moe_grouped_gemm_efficiency < 5.0  # one worker: no all-to-all, the default
