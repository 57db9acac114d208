"""A non-finite training state is never checkpointed (one process)."""

from __future__ import annotations

import pytest
import torch

from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.run.checkpoint.folders import CheckpointError
from ptdp.run.checkpoint.io import save_checkpoint


def test_a_non_finite_state_is_never_saved(tmp_path):
    stage = build_stage(tiny_config(1, 1, 1, "float64"), ParallelGroups.single_process())
    train_step(stage, rank_microbatches(0, stage.config, 0, 1), 0)
    name, param = next(iter(global_named_parameters(stage.model)))
    with torch.no_grad():
        param.view(-1)[3] = float("nan")
    with pytest.raises(
        CheckpointError,
        match=rf"refusing to save the checkpoint of iteration 1: parameter {name} "
        r"holds nan/inf values on rank 0; nothing was written",
    ):
        save_checkpoint(stage, tmp_path / "ckpt", 1, consumed_samples=8)
    assert not (tmp_path / "ckpt").exists()
    with torch.no_grad():
        param.view(-1)[3] = 0.0
        stage.optimizer.state[param]["exp_avg_sq"].view(-1)[0] = float("inf")
    with pytest.raises(CheckpointError, match=rf"optimizer exp_avg_sq of {name} holds nan/inf"):
        save_checkpoint(stage, tmp_path / "ckpt", 1, consumed_samples=8)
    assert not (tmp_path / "ckpt").exists()
