"""The non-finite check before a save reads each device's flags at once and names the first
offending tensor in parameter order, the 1-bit residual last (ptdp.run.checkpoint.io)."""

from __future__ import annotations

import pytest
import torch

from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.run.checkpoint import io
from ptdp.run.checkpoint.folders import CheckpointError


def test_all_finite_flags_per_tensor():
    tensors = [torch.zeros(3), torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf")]), torch.ones(2, 2)]
    assert io._all_finite(tensors) == [True, False, False, True]


def test_a_non_finite_residual_is_named_after_every_parameter(tmp_path, monkeypatch):
    stage = build_stage(tiny_config(1, 1, 1, "float64"), ParallelGroups.single_process())
    train_step(stage, rank_microbatches(0, stage.config, 0, 1), 0)
    monkeypatch.setattr(stage.grads, "residual", torch.tensor([0.0, float("nan")], dtype=torch.float64))
    with pytest.raises(CheckpointError, match="the 1-bit error-feedback residual holds nan/inf values on rank 0"):
        io.save_checkpoint(stage, tmp_path / "ckpt", 1, consumed_samples=8)
    names = [name for name, _ in global_named_parameters(stage.model)]
    last = dict(global_named_parameters(stage.model))[names[-1]]
    with torch.no_grad():
        last.view(-1)[0] = float("inf")  # a parameter comes before the residual
    with pytest.raises(CheckpointError, match=rf"parameter {names[-1]} holds nan/inf"):
        io.save_checkpoint(stage, tmp_path / "ckpt", 1, consumed_samples=8)
    assert not (tmp_path / "ckpt").exists()
