"""FP8 runs train exactly like one process at every layout: the emulated FP8 GEMMs with float64
compute quantise the same elements with the same scales, so losses, gradient norms and parameters
after 3 steps agree within 1e-9 at (tp, cp, pp, dp) = (2,1,1,1) with sequence parallelism,
(1,2,1,1), (1,1,2,2) and (2,1,2,2), for each recipe; delayed scaling's histories are equal."""

from __future__ import annotations

import pytest
import torch

from helpers.fp8_cases import LAYOUTS, RECIPES, reference, world_results
from helpers.layout_cases import TOL, full_parameters, real_rows

CASES = [(world, layout) for world, layouts in LAYOUTS.items() for layout in layouts]


def _check(results: list[dict], recipe: str) -> None:
    ref = reference(recipe)
    assert all(n > 0.05 for n in ref["norms"]), "clipping (clip_grad=0.05) must fire in this test"
    for res in results:
        torch.testing.assert_close(torch.tensor(res[recipe]["losses"]), torch.tensor(ref["losses"]), **TOL["float64"])
        torch.testing.assert_close(torch.tensor(res[recipe]["norms"]), torch.tensor(ref["norms"]), **TOL["float64"])
    got = full_parameters(results, recipe)  # dp replicas and tied copies bitwise equal
    want = {key: real_rows(t, spec) for key, (t, spec, _) in ref["params"].items()}
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL["float64"], msg=lambda m, key=key: f"{recipe} {key}: {m}")


@pytest.mark.parametrize(
    "world, layout",
    CASES,
    ids=lambda x: "tp{}cp{}pp{}dp{}".format(*x) + ("sp" if x[4] else "") if isinstance(x, tuple) else f"world{x}",
)
def test_fp8_runs_train_like_one_process(world, layout):
    results = [rank_results[layout] for rank_results in world_results(world)]
    for recipe in RECIPES:
        _check(results, recipe)
    want = reference("delayed")["history"]
    for res in results:  # every rank's layers: the one-process histories of the same layers
        got = res["delayed"]["history"]
        assert got and set(got) <= set(want)
        for name, history in got.items():
            assert history == want[name], name


def test_fp8_changes_the_numbers_and_delayed_scaling_keeps_history():
    """The FP8 runs are not the float64 run: each recipe moves the losses (quantisation acts), and
    delayed scaling records nonzero amaxes (history of 2 steps per operand)."""
    plain = torch.tensor(reference(None)["losses"])
    for recipe in RECIPES:
        diff = (torch.tensor(reference(recipe)["losses"]) - plain).abs().max().item()
        assert diff > 1e-6 * plain.abs().max().item(), recipe
    history = reference("delayed")["history"]
    assert len(history) == 4 * 4  # 4 layers x (qkv, proj, fc1, fc2)
    assert all(len(h) == 2 * 3 and min(h) > 0 for h in history.values())
