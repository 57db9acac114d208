"""ptdp train's report predicts its step as ``ptdp plan`` does: with the run's
``--overlap-grad-reduce`` credited (the end-of-step reduction behind the last microbatch's
backward, ``PerfConstants.overlap_window``)."""

from __future__ import annotations

import dataclasses

import pytest

import ptdp
from ptdp.planner.candidate import run_candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.time.constants import DEFAULT_CONSTANTS
from ptdp.planner.time.profile import save_profile
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.run.planner_report import compare


@pytest.mark.parametrize("overlap", [True, False])
def test_report_credits_the_runs_overlap_grad_reduce(tmp_path, overlap):
    config = ptdp.load_config(world_size=4, tp=1, pp=1, overlap_grad_reduce=overlap)
    gpu = CATALOG["h100-sxm"]
    profile = tmp_path / "profile.json"
    save_profile(profile, gpu, DEFAULT_CONSTANTS, {})
    per_rank = [
        {"coords": (0, 0, 0, d), "numel": 0, "params": 0, "grads": 0, "optimizer": 0, "peak": 1, "peak_kind": "rss"}
        for d in range(4)
    ]
    step = compare(config, per_rank, 1.0, profile)["step_time"]["predicted_s"]
    layout = run_candidate(config)
    cluster = Cluster(gpu, 4, 4)

    def predicted(window: bool) -> float:
        c = dataclasses.replace(DEFAULT_CONSTANTS, overlap_window=window)
        model = config.model
        return evaluate_performance(
            model, layout, cluster, c, make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by
        ).time.step

    assert predicted(True) < predicted(False)  # the layout has data-parallel time to hide
    assert step == pytest.approx(predicted(overlap), rel=1e-12)
