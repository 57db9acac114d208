"""Mixture-of-experts models train exactly like one process (float64, 3 AdamW steps, clipping
active): per-step losses and gradient norms within 1e-9 relative and every parameter after them,
at (tp, cp, pp, dp) = (2,1,1,1) with sequence parallelism, (1,2,1,1), (1,1,2,1), (1,1,1,2),
(2,1,2,1), experts on every rank (ep = 1): softmax and sigmoid routers, group-limited
routing, the Switch loss per micro-batch and per sequence, the z-loss, capacity drops by
probability and by position (the same assignments dropped as one process), a shared expert, dense
first layers, the forced balanced routing, aux-loss-free balancing (the expert biases after each
step equal too, counted once per micro-batch under full recompute)."""

from __future__ import annotations

import pytest
import torch

from helpers.layout_cases import TOL, full_parameters
from helpers.moe_cases import (
    LAYOUTS,
    VARIANTS,
    check_like_one_process,
    moe_config,
    reference,
    variants,
    world_results,
)
from ptdp.run.planner_report import compare

CASES = [(world, layout) for world, layouts in LAYOUTS.items() for layout in layouts]


@pytest.mark.parametrize(
    "world, layout", CASES, ids=lambda x: "tp{}cp{}pp{}dp{}".format(*x) if isinstance(x, tuple) else f"world{x}"
)
def test_moe_trains_like_one_process(world, layout):
    results = [rank_results[layout] for rank_results in world_results(world)]
    for name in variants(layout):
        ref = reference(name)
        check_like_one_process(results, name, ref, full_parameters(results, name))
        check = compare(moe_config(name, *layout), [res[name]["measured"] for res in results], None, None)
        assert check["bytes_exact_on_every_rank"] is True, (name, check["ranks"])  # the planner's state bytes
        for res in results:  # the step's MoE metrics: losses, drops, load
            for got, want in zip(res[name]["moe"], ref["moe"]):
                assert set(got) == set(want)
                for key in want:
                    if key == "moe_tokens_per_expert":  # per layer over the global batch: exact
                        assert got[key] == want[key], name
                    else:
                        assert abs(got[key] - want[key]) <= 1e-9 * abs(want[key]) + 1e-15, (name, key)
        held = set()
        for res in results:  # the expert biases (buffers): every copy equals one process's
            for key, bias in res[name]["buffers"].items():
                torch.testing.assert_close(bias, ref["buffers"][key], **TOL["float64"])
                held.add(key)
        assert held == set(ref["buffers"])
        if name == "moe_bias":  # the biases moved
            assert all(bias.abs().sum() > 0 for bias in ref["buffers"].values()) and ref["buffers"]


def test_every_variant_runs_at_two_layouts_or_more():
    layouts = [layout for ls in LAYOUTS.values() for layout in ls]
    for name in VARIANTS:
        if not name.startswith("moe_ep"):  # the expert-parallel variants: test_moe_expert_parallel_training.py
            assert sum(name in variants(layout) for layout in layouts) >= 2, name
