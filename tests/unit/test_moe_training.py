"""An MoE model in a training step: the step's gradient norm equals that of ``mean over
micro-batches of (LM loss + aux + z)`` backpropagated in one plain process; the end-of-run report
does not compare the planner's bytes, which do not count MoE layers yet."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.layout_cases import rank_microbatches
from helpers.moe_cases import moe_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.moe import layer as moe_layer
from ptdp.engine.stage import build_stage
from ptdp.engine.step import read_results, train_step


def _grad_norm(model: torch.nn.Module) -> float:
    return float(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None)))


def test_the_step_gradient_is_that_of_the_mean_of_loss_plus_balancing_losses(monkeypatch):
    cfg = moe_config("moe", 1, 1, 1, 1)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1))
    stage = build_stage(cfg, ParallelGroups.single_process())
    plain = copy.deepcopy(stage.model)
    microbatches = rank_microbatches(0, cfg, 0, 1)
    assert len(microbatches) == 4
    (result,) = read_results([train_step(stage, microbatches, 0)])

    # the plain objective: each MoE layer's (aux + z) added to the micro-batch's loss, all over m
    extra: list[torch.Tensor] = []
    losses = moe_layer.MoELayer._losses

    def keep(self, *args, **kwargs):
        value = losses(self, *args, **kwargs)
        extra.append(value)
        return value.detach()  # no AttachLoss: the objective below carries it

    monkeypatch.setattr(moe_layer.MoELayer, "_losses", keep)
    objective = 0.0
    for tokens, labels in microbatches:
        extra.clear()
        objective = objective + (plain(tokens, labels) + sum(extra)) / len(microbatches)
    objective.backward()
    assert abs(_grad_norm(plain) - result.grad_norm) <= 1e-12 * result.grad_norm

    plain.zero_grad(set_to_none=True)
    sum(plain(tokens, labels) for tokens, labels in microbatches).backward()  # without them: another norm
    assert abs(_grad_norm(plain) / len(microbatches) - result.grad_norm) > 1e-6 * result.grad_norm


def test_the_end_of_run_report_says_the_planner_does_not_model_moe():
    from ptdp.run.planner_report import compare, format_comparison

    check = compare(moe_config("moe", 1, 1, 1, 1), [], None, None)
    assert format_comparison(check) == ["  planner: the planner does not model mixture-of-experts layers yet"]
