"""An MoE model in a training step: the step's gradient norm equals that of ``mean over
micro-batches of (LM loss + aux + z)`` backpropagated in one plain process; the end-of-run report
compares the planner's state bytes (not its activations or step time)."""

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


def test_the_end_of_run_report_compares_the_state_bytes_of_an_moe_run():
    """The planner's parameter, gradient and optimizer bytes of one process holding every expert
    equal what it holds; the report says it does not model MoE activations or step time."""
    from ptdp.run.planner_report import compare, format_comparison, measure_stage

    cfg = moe_config("moe", 1, 1, 1, 1)
    stage = build_stage(cfg, ParallelGroups.single_process())
    read_results([train_step(stage, rank_microbatches(0, cfg, 0, 1), 0)])
    check = compare(cfg, [measure_stage(stage)], None, None)
    assert check["bytes_exact_on_every_rank"] is True
    lines = format_comparison(check)
    assert lines[-2:] == [
        "    bytes equal on every rank: yes",
        "    (compared: the state bytes of every rank and, with ep or etp > 1, the all-to-all time and the expert load; not yet: an MoE run's step time and peak memory)",
    ]


def test_expert_bias_moves_by_the_step_loads_counted_once_under_recompute():
    """After one step each bias is ``rate x sign(mean load - load)`` of the step's loads, the same
    with full recompute (which runs every layer's forward again in backward)."""
    from ptdp.engine.moe.layer import MoELayer

    biases = []
    for recompute in ({}, {"recompute_granularity": "full", "recompute_num_layers": 1}):
        cfg = moe_config("moe_bias", 1, 1, 1, 1)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **recompute))
        stage = build_stage(cfg, ParallelGroups.single_process())
        # without early stop the recompute runs each layer's whole forward again, counting included
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            read_results([train_step(stage, rank_microbatches(0, cfg, 0, 1), 0)])
        layers = [m for m in stage.model.modules() if isinstance(m, MoELayer)]
        for layer in layers:
            loads = layer.step_counts.double()
            assert int(loads.sum()) == 4 * 2 * 16 * 2  # 4 micro-batches of 2 x 16 tokens, top-2
            want = cfg.moe.moe_router_bias_update_rate * torch.sign(loads.mean() - loads)
            torch.testing.assert_close(layer.expert_bias, want, rtol=0, atol=0)
        biases.append([layer.expert_bias.clone() for layer in layers])
    for plain, again in zip(*biases):
        torch.testing.assert_close(again, plain, rtol=0, atol=0)
    # the next step reports the range of the biases it routed with
    (result,) = read_results([train_step(stage, rank_microbatches(1, cfg, 0, 1), 1)])
    every = torch.cat(biases[-1])
    assert (result.moe["moe_expert_bias_min"], result.moe["moe_expert_bias_max"]) == (every.min(), every.max())
    assert every.min() < every.max()


def test_a_step_reports_its_balancing_losses_drops_and_load():
    """``StepResult.moe``: the losses as the mean over micro-batches of their sum over layers, the
    dropped share of all assignments, the most loaded expert over the mean."""
    from ptdp.engine.moe.layer import MoELayer

    cfg = moe_config("moe_capacity_shared", 1, 1, 1, 1)
    stage = build_stage(cfg, ParallelGroups.single_process())
    plain = copy.deepcopy(stage.model)
    microbatches = rank_microbatches(0, cfg, 0, 1)
    (result,) = read_results([train_step(stage, microbatches, 0)])
    layers = [mod for mod in plain.modules() if isinstance(mod, MoELayer)]
    aux = dropped = 0.0
    loads = [torch.zeros(4, dtype=torch.float64) for _ in layers]
    for tokens, labels in microbatches:
        plain(tokens, labels)
        for i, layer in enumerate(layers):
            aux += float(layer.stats.aux + layer.stats.z) / len(microbatches)
            dropped += float(layer.stats.dropped)
            loads[i] += layer.stats.counts.double()
    assert set(result.moe) == {
        "moe_aux_loss",
        "moe_z_loss",
        "moe_dropped_fraction",
        "moe_max_load",
        "moe_max_rank_load",
        "moe_tokens_per_expert",
    }
    ids = [layer.layer_id for layer in layers]
    assert result.moe["moe_tokens_per_expert"] == {str(i): load.long().tolist() for i, load in zip(ids, loads)}
    assert result.moe["moe_max_rank_load"] == 1.0  # one ep rank holds every expert
    assert abs(result.moe["moe_aux_loss"] + result.moe["moe_z_loss"] - aux) <= 1e-12 * aux
    assigned = len(layers) * len(microbatches) * 2 * 16 * 2
    assert result.moe["moe_dropped_fraction"] == dropped / assigned > 0
    assert result.moe["moe_max_load"] == max(float(load.max() / load.mean()) for load in loads)


def test_global_aux_loss_weighs_the_scores_by_the_previous_steps_global_counts(monkeypatch):
    """``global_aux_loss``: after a step each layer keeps its assignments over the global batch
    ``C``; the next forward's loss is ``coeff E sum_i C_i / (k N) x mean_t p_ti`` (N tokens)."""
    from ptdp.engine.moe.layer import MoELayer

    cfg = moe_config("moe_global", 1, 1, 1, 1)
    stage = build_stage(cfg, ParallelGroups.single_process())
    read_results([train_step(stage, rank_microbatches(0, cfg, 0, 1), 0)])
    layers = [m for m in stage.model.modules() if isinstance(m, MoELayer)]
    k, e, coeff = cfg.moe.moe_router_topk, 4, cfg.moe.moe_aux_loss_coeff
    for layer in layers:
        torch.testing.assert_close(layer.global_counts, layer.step_counts.double(), rtol=0, atol=0)
        assert int(layer.global_counts.sum()) == 4 * 2 * 16 * k
    captured = []
    route = moe_layer.route
    monkeypatch.setattr(moe_layer, "route", lambda *a, **kw: captured.append(route(*a, **kw)) or captured[-1])
    tokens, labels = rank_microbatches(1, cfg, 0, 1)[0]
    with torch.no_grad():
        stage.model(tokens, labels)
    assert len(captured) == len(layers) == 4
    for layer, routing in zip(layers, captured):
        counts = layer.global_counts
        share = counts / counts.sum()  # C_i / (k N)
        want = coeff * e * float((share * routing.scores.double().mean(0)).sum())
        assert abs(float(layer.stats.aux) - want) <= 1e-12 * want
