"""``--data-parallel-sharding-strategy optim_grads_params`` (ZeRO-3) trains exactly like one process
without sharding (float64, 3 AdamW steps, clipping firing, 2-4 microbatches accumulated per step):
losses, gradient norms and every parameter within 1e-9 at (tp, pp, dp) = (1,1,4), (2,1,2), (1,2,2),
(2,2,2), with the interleaved schedule at pp = 2, full recompute with sequence parallelism (the
Llama-like model) at (2,1,2), selective recompute with the gathered parameters kept from forward
to backward (``--no-reshard-after-forward``) at (1,1,4) and (1,2,2), context parallelism at (tp,
cp, pp, dp) = (1,2,1,2), and bf16 weights within bf16 precision at (2,2,2)
(:data:`helpers.zero_cases.RUNS`). Each rank keeps 1/dp of the parameters, gradients and
optimizer state as the planner counts them, and one step communicates exactly the gradient
reduce-scatters and the unit all-gathers the formula gives; evaluation sees the gathered
parameters. The runs share the jobs of
``test_sharded_grads`` (:mod:`helpers.zero_cases`)."""

from __future__ import annotations

import pytest
import torch

from helpers.torch_features import NEEDS_FUSED_WGRAD
from helpers.zero_cases import (
    CHUNK_VARIANTS,
    CP_LAYOUT,
    CP_PARAMS_VARIANT,
    EVAL_VARIANTS,
    LAYOUTS,
    VARIANTS,
    check_against_reference,
    check_transients,
    cp_config,
    eval_reference,
    is_chunk_by_chunk,
    planner_gathers,
    variants,
    world_results,
    zero_config,
)
from ptdp.layout.buckets import chunk_rounds
from ptdp.layout.pipeline.program import build_programs
from ptdp.layout.pipeline.schedule import Action
from ptdp.run.planner_report import compare

STRATEGY = "optim_grads_params"
CASES = [(world, layout) for world, layouts in LAYOUTS.items() for layout in layouts]
IDS = ["tp{}pp{}dp{}".format(*layout) for _, layout in CASES]


def _results(world: int, layout: tuple) -> list[dict]:
    return [rank_results[layout] for rank_results in world_results(world)]


@pytest.mark.parametrize("world, layout", CASES, ids=IDS)
def test_optim_grads_params_trains_like_one_process(world, layout):
    names = variants(*layout, STRATEGY)
    assert names
    for name in names:
        check_against_reference(_results(world, layout), name)


def test_optim_grads_params_with_context_parallelism_trains_like_one_process():
    """(tp, cp, pp, dp) = (1,2,1,2): parameters and gradients sharded over the 4 dp x cp ranks."""
    results = _results(4, CP_LAYOUT)
    check_against_reference(results, CP_PARAMS_VARIANT)
    for res in results:
        m = res[CP_PARAMS_VARIANT]["measured"]
        assert m["params"] == m["grads"] == 8 * (m["numel"] + m["padding"]) // 4, m


@NEEDS_FUSED_WGRAD  # the planner counts the fused path
@pytest.mark.parametrize("world, layout", CASES, ids=IDS)
def test_optim_grads_params_keeps_a_shard_as_the_planner_counts(world, layout):
    """Bytes per rank: parameters, gradients and optimizer state each 1/dp of the stage's (plus
    bucket padding; float64: 8, 8 and 16 bytes per parameter, bf16: 4, 4 and 8, the float32 shard
    being the main copy); equal to the planner's on every rank (bf16). When units are freed after
    use a rank never holds its whole stage gathered at once."""
    results = _results(world, layout)
    dp = layout[2]
    for name in variants(*layout, STRATEGY):
        bf16 = VARIANTS[name][0] == "bfloat16"
        per_param = (4, 4, 8) if bf16 else (8, 8, 16)
        if bf16:  # the planner models bf16, not float64
            check = compare(zero_config(name, *layout), [res[name]["measured"] for res in results], None, None)
            assert check["bytes_exact_on_every_rank"], check["ranks"]
        for res in results:
            m = res[name]["measured"]
            held = m["numel"] + m["padding"]
            assert (m["params"], m["grads"], m["optimizer"]) == tuple(b * held // dp for b in per_param), (name, m)
            whole = (2 if bf16 else 8) * held  # gathered in the parameters' dtype
            if zero_config(name, *layout).parallel.reshard_after_forward:
                assert 0 < m["params_transient"] < whole, (name, m["params_transient"], whole)


@NEEDS_FUSED_WGRAD  # the planner counts the fused path
@pytest.mark.parametrize("world, layout", CASES, ids=IDS)
def test_optim_grads_params_transients_are_what_the_planner_counts(world, layout):
    """The most gathered parameter memory and the most full-size bucket gradient memory a rank
    held at once over the run (the engine's own counters) equal the planner's counts exactly, on
    every rank: units resharded after forward (two neighbours; at pp = 1 the tied unit with two
    layers) and kept (the whole stage), buckets of 901, 1,500 and 8,544 elements within units,
    reduced during and after backward, interleaved, bf16; and at (tp, cp, pp, dp) = (1,2,1,2)."""
    results = _results(world, layout)
    for name in variants(*layout, STRATEGY):
        check_transients(results, name, zero_config(name, *layout))
    if world == 4:
        check_transients(_results(4, CP_LAYOUT), CP_PARAMS_VARIANT, cp_config(CP_PARAMS_VARIANT))


def _stretches(cfg, pp_rank: int, m: int) -> int:
    """Kept gathered: how often each unit of this pp rank is gathered in one step (each chunk's
    units alike), once per stretch of the program during which the unit's chunk has a microbatch
    in flight (forward run, backward not)."""
    v = cfg.pipeline.virtual_stages
    program = build_programs(cfg.parallel.schedule, cfg.parallel.pp, m, v)[pp_rank]
    inflight, stretches = [0] * v, [0] * v
    for step in program:
        if isinstance(step, Action) and step.kind == "forward":
            stretches[step.chunk] += inflight[step.chunk] == 0
            inflight[step.chunk] += 1
        elif isinstance(step, Action) and step.kind == "backward":
            inflight[step.chunk] -= 1
    assert len(set(stretches)) == 1, stretches
    return stretches[0]


@NEEDS_FUSED_WGRAD  # the planner counts the fused path
@pytest.mark.parametrize("world, layout", CASES, ids=IDS)
def test_one_step_communicates_as_the_formula_says(world, layout):
    """Step 0 on the dp axis: each backward reduce-scatters every bucket (m times the gradient
    elements per step; interleaved, once per round: m / pp times); each forward all-gathers every unit (every bucket of the stage), each
    backward every unit but the embeddings' (only looked up: their gradients need the ids, not
    the tables; the tied unit of a pp = 1 stage, which projects too, is gathered again), or with
    --no-reshard-after-forward each unit once per stretch of microbatches in flight (m at pp = 1,
    fewer under 1F1B on an earlier stage), this rank sending its 1/dp share each time: the
    planner's counts; no all-gather after the optimizer step; no gradient all-reduce."""
    dp = layout[2]
    for name in variants(*layout, STRATEGY):
        if name in CHUNK_VARIANTS:  # once per step: test_sharded_grads.test_chunk_by_chunk_*
            continue
        cfg = zero_config(name, *layout)
        m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
        for res in _results(world, layout):
            run, pp_rank = res[name], res[name]["coords"][2]
            comm = run["comm"]
            rs, gathers = comm["dp/reduce_scatter/grads"], comm["dp/all_gather/params"]
            assert "dp/all_reduce/grads" not in comm, comm
            reductions = chunk_rounds(m, layout[1]) if is_chunk_by_chunk(cfg) else m
            assert rs["numel"] == reductions * run["grad_numel"], (name, rs, m)
            forward, backward = planner_gathers(cfg, pp_rank)
            assert forward == (rs["calls"] // reductions, run["grad_numel"]), (name, forward, rs)  # every bucket
            embeddings = pp_rank == 0 and (layout[1] > 1 or cfg.model.untie_embeddings_and_output_weights)
            assert (backward[1] < forward[1]) == embeddings, (name, pp_rank, forward, backward)
            if cfg.parallel.reshard_after_forward:
                calls, numel = m * (forward[0] + backward[0]), m * (forward[1] + backward[1])
            else:
                times = _stretches(cfg, pp_rank, m)
                assert times == m or layout[1] > 1, (name, times, m)
                calls, numel = times * forward[0], times * forward[1]
            assert (gathers["calls"], gathers["numel"]) == (calls, numel // dp), (name, pp_rank, gathers)


def test_evaluation_gathers_the_parameters_it_reads():
    """``eval_loss`` at (2,2,2) with optim_grads_params, resharding and keeping, before and after a
    training step, equals one unsharded process's (float64, 1e-12): every unit is gathered for its
    forward without autograd and freed after it."""
    for rank_results in world_results(8):
        for name in EVAL_VARIANTS:
            got, want = rank_results["eval"][name], eval_reference(name)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-12, atol=0, msg=name)
