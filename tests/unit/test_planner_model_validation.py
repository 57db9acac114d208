"""The planner's fit to the 18 published runs stays within its targets (a guard, not a benchmark).

Targets: every TFLOP/s-per-GPU and iteration-time prediction within 10%, mean absolute error
<= 5% per metric; on Korthikanti Table 5 better than Calculon's published 3.65% mean / 8.87% max;
activation memory within 10% of Korthikanti Figure 1; every published layout fits in 80 GiB.
"""

from __future__ import annotations

import dataclasses

import pytest

from ptdp.planner.time.constants import DEFAULT_CONSTANTS
from ptdp.planner.validate.accuracy import (
    ACT_NONE,
    ACT_SEQSEL,
    ITER_TIME,
    PARAMS_OPT,
    TFLOPS,
    fit_check,
    fit_constants,
    format_validation_table,
    summarize,
    validate,
)
from ptdp.planner.validate.published import default_csv, load_published_runs

CSV = default_csv()
pytestmark = pytest.mark.skipif(CSV is None, reason="published_runs.csv not found (set PTDP_PUBLISHED_RUNS)")


@pytest.fixture(scope="module")
def runs():
    return load_published_runs(CSV)


@pytest.fixture(scope="module")
def rows(runs):
    return validate(runs)


def test_csv_parsed(runs):
    assert len(runs) == 18
    assert sum(r.reported_tflops is not None for r in runs) == 10
    assert sum(r.reported_iteration_time is not None for r in runs) == 8
    t5 = [r for r in runs if r.reported_iteration_time is not None]
    assert {(r.layout.recompute, r.layout.parallel.sequence_parallel) for r in t5} == {
        ("full", False),
        ("selective", True),
    }
    assert all(r.reported_act_none_gib and r.reported_act_seqsel_gib for r in t5)


def test_time_predictions_within_targets(rows):
    stats = summarize(rows)
    for metric in (TFLOPS, ITER_TIME):
        n, mae, worst = stats[metric]
        assert worst < 0.10, format_validation_table(rows)
        assert mae <= 0.05, format_validation_table(rows)
    _, mae, worst = stats[ITER_TIME]
    assert mae < 0.0365 and worst < 0.0887, "no longer better than Calculon on Table 5"


def test_memory_predictions_within_targets(rows):
    stats = summarize(rows)
    for metric in (ACT_NONE, ACT_SEQSEL, PARAMS_OPT):
        assert stats[metric][0] == 4
        assert stats[metric][2] < 0.10, format_validation_table(rows)


def test_memory_rows_only_for_reported_numbers(runs):
    """A run reporting only the activations without recompute gets that one row: a number it does
    not report is no row (it once became a row whose ``reported`` was None)."""
    run = next(r for r in runs if r.reported_act_none_gib is not None and r.reported_params_opt_gib is not None)
    only_none = dataclasses.replace(
        run,
        reported_tflops=None,
        reported_iteration_time=None,
        reported_act_seqsel_gib=None,
        reported_params_opt_gib=None,
    )
    got = validate([only_none])
    assert [row.metric for row in got] == [ACT_NONE]
    assert got[0] == next(row for row in validate([run]) if row.metric == ACT_NONE)
    assert sorted(row.metric for row in validate([run]) if row.metric != ACT_NONE) == sorted(
        m
        for m, value in (
            (ACT_SEQSEL, run.reported_act_seqsel_gib),
            (PARAMS_OPT, run.reported_params_opt_gib),
            (TFLOPS, run.reported_tflops),
            (ITER_TIME, run.reported_iteration_time),
        )
        if value is not None
    )


def test_every_published_layout_fits(runs):
    for name, layout, total, capacity in fit_check(runs):
        assert total <= capacity, f"{name} {layout}: {total:.1f} GiB > {capacity:.0f} GiB"


def test_default_constants_are_the_least_squares_fit(runs):
    """A change to the model must come with a refit (``python -m ptdp.planner.validate.accuracy --fit``)."""
    best, _ = fit_constants(runs)
    assert (best.gemm_peak_fraction, best.hbm_efficiency) == (
        DEFAULT_CONSTANTS.gemm_peak_fraction,
        DEFAULT_CONSTANTS.hbm_efficiency,
    )


def test_table_format(rows):
    table = format_validation_table(rows)
    assert table.startswith("| model | layout | metric | reported | predicted | error |")
    assert "| TFLOP/s per GPU | 10 |" in table and "| iteration time (s) | 8 |" in table
