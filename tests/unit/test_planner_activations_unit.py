"""The planner's activation peak against the bytes ptdp's GPT keeps for backward, in this process
(tp = pp = dp = 1, 1F1B and GPipe); the several-process layouts and the method:
tests/dist/test_planner_activations.py."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.activations import CASES, DTYPES, MODEL, TOLERANCE, _table, compared
from ptdp.config.model import ModelConfig


@pytest.mark.parametrize("world", [1])  # worlds 2 and 4: tests/dist/test_planner_activations.py
def test_activation_peak_per_rank_within_tolerance(world):
    rows = compared(world)
    assert len(rows) == world * len(CASES[world]) * len(DTYPES)
    worst = max(abs(r["error"]) for r in rows)
    assert worst <= TOLERANCE, _table(rows)


def test_model_config_describes_ptdp_attention_and_dropout():
    cfg = ModelConfig(**MODEL)
    assert cfg.flash_attention and not cfg.has_dropout

    assert dataclasses.replace(cfg, hidden_dropout=0.1).has_dropout
