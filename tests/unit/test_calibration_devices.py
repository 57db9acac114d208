"""``ptdp plan --calibrate`` on GPUs: the worker count follows the visible GPUs, times on a CUDA
device come from CUDA events (milliseconds converted to seconds), a GPU profile holds the device's
memory and shares no cores (ptdp.run.calibration, ptdp.commands.calibrate). CUDA is simulated by
monkeypatching torch.cuda; the CPU path runs for real."""

from __future__ import annotations

import argparse

import pytest
import torch

from ptdp.commands import calibrate as calibrate_command
from ptdp.errors import ConfigError
from ptdp.run import calibration


class _FakeEvent:
    """A CUDA event that counts the calls made between its record() and the end's."""

    calls = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        self.at = _FakeEvent.calls

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _FakeEvent) -> float:
        return 250.0 * (end.at - self.at)  # 250 ms per call


def test_cuda_timing_uses_events_and_returns_seconds_per_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)

    def call() -> None:
        _FakeEvent.calls += 1

    assert calibration._timed(call, 4, torch.device("cuda", 0)) == pytest.approx(0.25)
    assert _FakeEvent.calls == 5  # one warm-up call outside the events


def test_cpu_timing_uses_the_host_clock():
    assert 0.0 < calibration._timed(lambda: sum(range(1000)), 3, torch.device("cpu")) < 1.0


def _args(nproc=None) -> argparse.Namespace:
    return argparse.Namespace(nproc_per_node=nproc)


@pytest.mark.parametrize(
    "available, count, nproc, expected",
    [
        (True, 4, None, 4),
        (True, 1, None, 1),
        (True, 8, 2, 2),
        (False, 0, None, 8),
        (False, 0, 3, 3),
    ],
)
def test_calibration_workers_default_to_the_gpus(monkeypatch, available, count, nproc, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert calibrate_command.calibration_workers(_args(nproc)) == expected


def test_more_calibration_workers_than_gpus_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"--nproc-per-node 4 .* only 2 GPU\(s\)"):
        calibrate_command.calibration_workers(_args(4))


def _mine() -> dict:
    gemms = [
        {"m": 256, "n": 256, "k": 256, "batch": 1, "flops_per_s": 1e12},
        {"m": 512, "n": 512, "k": 512, "batch": 1, "flops_per_s": 2e12},
    ]
    return {
        "gemms": gemms,
        "bandwidth": 2e12,
        "optimizer": (1000, 1e-5),
        "tp_all_reduce": [(1 << 20, 1e-5), (1 << 24, 1e-4)],
        "layer_s": 1e-3,
        "head_s": 1e-3,
    }


def _config():
    from ptdp.commands.calibrate import calibration_config

    args = argparse.Namespace(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=None,
        vocab_size=512,
        seq_length=16,
        micro_batch_size=2,
        global_batch_size=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        nproc_per_node=2,
        precision="bf16",
    )
    return calibration_config(args, 2)


def test_a_gpu_profile_holds_the_device_memory_and_shares_no_cores():
    config = _config()
    per_rank = [_mine(), _mine()]
    combined = calibration._combine(per_rank, config, 0)
    assert combined["layer_s"] == 1e-3  # not scaled by a core share
    gpu, _, _ = calibration.build_profile(combined, config, "bf16", 0, {"name": "NVIDIA H100", "memory_bytes": 80e9})
    assert gpu.memory_bytes == 80e9 and gpu.shared_cores == 0 and gpu.gpus_per_node == 2
    assert "2 x NVIDIA H100" in gpu.source
    cpu, _, _ = calibration.build_profile(calibration._combine(per_rank, config, 1), config, "bf16", 1)
    assert cpu.shared_cores == 1 and cpu.memory_bytes < 80e9 * 100


def test_the_profile_holds_the_moe_efficiencies_fitted_from_its_measurements():
    """All-to-alls timed at 0.25 of the profile's own links and experts' GEMMs at 0.5 of its own
    roofline give a profile with those efficiencies; without them the defaults stay. The world's
    all-to-all is the ranks' median, scaled to one core per worker like the all-reduces."""
    from functools import partial

    from ptdp.planner.inputs.hardware import Cluster
    from ptdp.planner.time.constants import DEFAULT_CONSTANTS, links_for
    from ptdp.planner.time.moe_time import exchange_time, experts_gemm_time

    config, device = _config(), {"name": "NVIDIA H100", "memory_bytes": 80e9}
    base = calibration._combine([_mine(), _mine()], config, 0)
    gpu, constants, _ = calibration.build_profile(base, config, "bf16", 0, device)
    assert constants.moe_exchange_efficiency == DEFAULT_CONSTANTS.moe_exchange_efficiency
    assert constants.moe_grouped_gemm_efficiency == DEFAULT_CONSTANTS.moe_grouped_gemm_efficiency
    links = links_for(Cluster(gpu, 2, 2), constants)
    rates = {"peak_flops": gpu.peak("bf16"), "bandwidth": gpu.memory_bandwidth, "half_dim": constants.gemm_half_dim}
    gemms = partial(experts_gemm_time, peak_fraction=1.0, element=2.0, **rates)
    mine = dict(
        base,
        all_to_all=[(2, n, exchange_time(n, 2, links, efficiency=0.25)) for n in (1 << 16, 1 << 20, 1 << 24)],
        grouped_gemm=[
            {
                "experts": e,
                "rows": r,
                "hidden": 1024,
                "ffn": 4096,
                "seconds": gemms(e, r, 1024, 4096, 4096) / 0.5,
            }
            for e, r in ((2, 2048), (8, 512), (32, 128), (64, 4))  # the last memory-bound
        ],
    )
    _, fitted, measured = calibration.build_profile(mine, config, "bf16", 0, device)
    assert fitted.moe_exchange_efficiency == pytest.approx(0.25, rel=1e-9)
    assert fitted.moe_grouped_gemm_efficiency == pytest.approx(0.5, rel=1e-9)
    assert measured["fitted"]["moe_exchange_efficiency"] == fitted.moe_exchange_efficiency
    assert measured["all_to_all"] == mine["all_to_all"] and measured["grouped_gemm"] == mine["grouped_gemm"]
    ranks = [dict(_mine(), all_to_all=[(4096, 2e-3)]), dict(_mine(), all_to_all=[(4096, 4e-3)])]
    assert calibration._combine(ranks, config, 1)["all_to_all"] == [(2, 4096, pytest.approx(0.5 * 3e-3))]
    assert calibration._combine(ranks, config, 0)["all_to_all"] == [(2, 4096, pytest.approx(3e-3))]


def test_cpu_measurements_run_on_the_given_device():
    from ptdp.planner.inputs.models import gpt

    model = gpt(1, 32, 4, seq_length=16, vocab_size=128, ffn_hidden_size=128)
    rows = calibration.measure_gemms(model, 1, 1, 128, torch.float32, torch.device("cpu"))
    assert rows and all(r["flops_per_s"] > 0 for r in rows)
    assert calibration.measure_bandwidth(1 << 12, torch.device("cpu")) > 0
    shapes = calibration.expert_gemm_shapes(model, 1)
    assert shapes == [(2, 16, 32, 128), (8, 16, 32, 128), (32, 16, 32, 128)]  # 2 x 16 routed rows, 16 at least
    for dtype, grouped in ((torch.float32, True), (torch.float64, False)):  # float64: the loop
        rows = calibration.measure_grouped_gemm(shapes[:2], dtype, torch.device("cpu"))
        assert [(r["experts"], r["grouped"]) for r in rows] == [(2, grouped), (8, grouped)]
        assert all(r["seconds"] > 0 and r["one_gemm_s"] > 0 for r in rows)


def test_calibration_refuses_context_parallelism(capsys):
    """--calibrate does not run cp: asking for it is a bad request (exit 2), not silently ignored."""
    from ptdp import cli

    code = cli.main(["plan", "--calibrate", "--tp", "1", "--pp", "1", "--cp", "2", "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--context-parallel-size=2" in err and "leave --cp out" in err
