"""ptdp train's report of an MoE run with expert parallelism: the MoE layers' all-to-all seconds per
step as the planner predicts them (``moe_exchange_times`` on the profile's links) against the
slowest rank's timed ones, and the planner's expert load against the run's ``moe_max_rank_load``
(the run's timing itself: tests/e2e/test_moe_e2e.py)."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.moe_cases import moe_config
from ptdp.engine.comm import CommStats
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.moe_model import with_moe
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, links_for
from ptdp.planner.time.moe_time import moe_exchange_times
from ptdp.planner.time.profile import save_profile
from ptdp.run.planner_report import compare, format_comparison, moe_exchange_seconds

#: (tp, cp, pp, dp, ep): two stages, 4 ranks; MoE layers 1, 2, 3 of 4: one on stage 0, two on stage 1
LAYOUT = (1, 1, 2, 2, 2)
TIMED = [0.01, 0.03, 0.02, 0.02]


def _ranks(timed: list[float | None], pp: int = 2) -> list[dict]:
    """Ranks (coordinates tp, dp, pp) holding nothing, each with its timed exchange seconds."""
    zeros = {"numel": 0, "params": 0, "grads": 0, "optimizer": 0, "peak": 1, "peak_kind": "rss"}
    per_stage = len(timed) // pp
    return [dict(zeros, coords=(0, 0, r // per_stage), moe_exchange_s=t) for r, t in enumerate(timed)]


def _profile(tmp_path, cores: int = 0):
    gpu = dataclasses.replace(CATALOG["h100-sxm"], shared_cores=cores)
    constants = dataclasses.replace(DEFAULT_CONSTANTS, moe_exchange_efficiency=0.5)
    path = tmp_path / "profile.json"
    save_profile(path, gpu, constants, {})
    return path, gpu, constants


def _one_exchange(cfg, gpu, constants, tokens: int) -> float:
    """One MoE layer's four all-to-alls over ep 2 for one micro-batch of a rank routing ``tokens``
    tokens of float64 (8 bytes)."""
    links = links_for(Cluster(gpu, 4, 4), constants)
    model = with_moe(cfg.model, cfg.moe)
    return moe_exchange_times(model, tokens, 2, 1, "alltoall", links, 8.0, 0.5)


@pytest.mark.parametrize(
    "layout, tokens, layers, cores, recompute",
    [
        (LAYOUT, 32, 2, 0, False),
        (LAYOUT, 32, 2, 2, False),
        (LAYOUT, 32, 2, 0, True),
        ((1, 2, 1, 2, 2), 16, 3, 0, False),  # cp 2: half the sequence
        ((2, 1, 1, 2, 2), 16, 3, 0, False),  # tp 2 with sequence parallelism
    ],
)
def test_the_busiest_stages_predicted_exchanges_against_the_slowest_rank(
    tmp_path, layout, tokens, layers, cores, recompute
):
    """The busiest stage's MoE layers (two of stage 1 at pp 2) x m micro-batches x one layer's
    exchanges of the rank's 2 x 16 / (cp or tp) tokens (1.5 x with full recompute, x 4 workers / 2
    cores on a CPU profile sharing them) against the slowest rank's 0.03 s."""
    cfg = moe_config("moe_ep", *layout)
    if recompute:
        model = dataclasses.replace(cfg.model, recompute_granularity="full", recompute_num_layers=1)
        cfg = dataclasses.replace(cfg, model=model)
    path, gpu, constants = _profile(tmp_path, cores)
    check = compare(cfg, _ranks(TIMED, layout[2]), 1.0, path, moe_max_rank_load=1.25)
    want = cfg.num_microbatches * layers * _one_exchange(cfg, gpu, constants, tokens)
    want *= (1.5 if recompute else 1.0) * (2.0 if cores else 1.0)
    ex = check["moe_exchange"]
    assert ex["predicted_s"] == pytest.approx(want, rel=1e-12) and ex["measured_s"] == 0.03
    assert ex["error"] == pytest.approx(want / 0.03 - 1.0, rel=1e-12)
    assert check["expert_load"] == {"predicted": 1.0, "measured": 1.25}
    lines = [line for line in format_comparison(check) if "schedule: the step idles" not in line]  # pp 2's bubble
    assert lines[-3:] == [
        f"    MoE all-to-all per step: {1e3 * want:.3g} ms predicted (busiest stage), 30 ms measured (slowest rank) "
        f"({100 * (want / 0.03 - 1):+.0f}%)",
        "    expert load (busiest ep rank over the mean): 1.00 predicted, 1.25 measured (mean over steps)",
        "    (compared: the state bytes of every rank and, with ep or etp > 1, the all-to-all time and the expert load; not yet: an MoE run's step time and peak memory)",
    ]


def test_without_a_profile_or_a_timing_the_report_says_why(tmp_path):
    cfg = moe_config("moe_ep", *LAYOUT)
    check = compare(cfg, _ranks(TIMED), 1.0, None)
    assert check["moe_exchange"] == {
        "measured_s": 0.03,
        "note": "no hardware profile: run `ptdp plan --calibrate` to predict it",
    }
    lines = [line for line in format_comparison(check) if "schedule: the step idles" not in line]  # pp 2's bubble
    assert lines[-4:-1] == [
        "    MoE all-to-all per step: 30 ms measured (slowest rank)",
        "      (not predicted: no hardware profile: run `ptdp plan --calibrate` to predict it)",
        "    expert load (busiest ep rank over the mean): 1.00 predicted, not measured",
    ]
    path, _, _ = _profile(tmp_path)
    check = compare(cfg, _ranks([0.01, None, 0.02, 0.02]), 1.0, path)  # a CUDA run: not timed
    assert check["moe_exchange"]["measured_s"] is None and "error" not in check["moe_exchange"]
    lines = [line for line in format_comparison(check) if "schedule: the step idles" not in line]
    assert "      (not measured: not timed on CUDA" in lines[-3]


def test_no_exchange_report_without_expert_parallelism():
    cfg = moe_config("moe", 1, 1, 1, 1)
    check = compare(cfg, _ranks([0.01], 1), 1.0, None, moe_max_rank_load=1.0)
    assert "moe_exchange" not in check and "expert_load" not in check


@pytest.mark.parametrize(
    "layout, dispatcher, want",
    [
        ((2, 1), "alltoall", 1 + 2 + 4 + 8),
        ((1, 2), "alltoall", 16 + 32 + 64 + 128),
        ((2, 2), "alltoall", 1 + 2 + 4 + 8 + 16 + 32 + 64 + 128),
        ((2, 2), "allgather", 256 + 512 + 1024 + 2048),
    ],
)
def test_the_timed_exchanges_are_those_the_planner_models(layout, dispatcher, want):
    """The seconds of the row exchanges the layout runs, not the counts' nor other axes' calls."""
    stats = CommStats()
    tags = [
        ("ep", "moe_dispatch"),
        ("ep", "moe_combine"),
        ("ep", "moe_dispatch_grad"),
        ("ep", "moe_combine_grad"),
        ("etp", "moe_etp_gather"),
        ("etp", "moe_etp_scatter"),
        ("etp", "moe_etp_gather_grad"),
        ("etp", "moe_etp_scatter_grad"),
        ("ep", "moe_allgather"),
        ("ep", "moe_reduce_scatter"),
        ("ep", "moe_allgather_grad"),
        ("ep", "moe_reduce_scatter_grad"),
        ("ep", "moe_counts"),
        ("dp", "moe_dispatch"),
    ]
    for i, (axis, tag) in enumerate(tags):
        stats.add_seconds(axis, "all_to_all", tag, float(2**i))
    stats.add_seconds("ep", "all_gather", "moe_dispatch", 1e6)
    ep, etp = layout
    cfg = moe_config("moe_ep_swiglu:allgather" if dispatcher == "allgather" else "moe_ep_swiglu", 1, 1, 1, 4, ep, etp)
    assert moe_exchange_seconds(cfg, stats) == want
