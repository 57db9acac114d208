"""GPU checks (skipped without CUDA): the single-process model on CUDA trains like on CPU."""

from __future__ import annotations

import pytest
import torch

from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step


@pytest.mark.gpu
def test_cuda_step_matches_cpu():
    cfg = tiny_config(1, 1, 1, "float64")
    results = {}
    for device in ("cpu", "cuda"):
        stage = build_stage(cfg, ParallelGroups.single_process(), device)
        results[device] = [train_step(stage, rank_microbatches(i, cfg, 0, 1), i).loss for i in range(3)]
        results[device + "_params"] = {n: p.detach().cpu() for n, p in stage.model.named_parameters()}
    torch.testing.assert_close(torch.tensor(results["cuda"]), torch.tensor(results["cpu"]), rtol=1e-9, atol=1e-12)
    for name, value in results["cpu_params"].items():
        torch.testing.assert_close(results["cuda_params"][name], value, rtol=1e-7, atol=1e-9)


@pytest.mark.gpu
def test_device_microbatches_on_cuda(tmp_path):
    import numpy as np

    from ptdp.data.dataset import TokenWindows, device_microbatches, microbatches
    from ptdp.data.indexed import IndexedTokens, write_indexed

    write_indexed(tmp_path / "s", np.array_split(np.arange(1001), 7), np.uint16)
    windows = TokenWindows(IndexedTokens(tmp_path / "s"), 16)
    indices = np.array([5, 1, 9, 2])
    for (t, l), (dt, dl) in zip(microbatches(windows, indices, 2), device_microbatches(windows, indices, 2, "cuda")):
        assert dt.device.type == "cuda" and torch.equal(dt.cpu(), t) and torch.equal(dl.cpu(), l)
