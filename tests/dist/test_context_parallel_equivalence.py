"""Context parallelism trains exactly like one process (float64, 3 AdamW steps, clipping active):
per-step losses and gradient norms within 1e-9 relative, every parameter after them, at
(tp, cp, pp, dp) = (1,2,1,1), (1,4,1,1), (2,2,1,1), (1,2,2,1), (1,2,1,2), (2,2,2,1): the GPT and
the Llama-like model (rotary, grouped-query attention) and both ``--cp-comm-type``s at every
layout; hidden and attention dropout (the masks of the unsplit model at every cp) with selective
or full recompute at the dp = 1 layouts; sequence parallelism inside the cp ranks (with dropout,
and with selective recompute) at tp = 2; the initial model's evaluation (the forward-only
schedule) at every layout; interleaved 1F1B and GPipe at (1,2,2,1); bf16 weights at cp = 2 within bf16
precision; no step with cp, dropout and (at tp = 2) sequence parallelism makes a call that would
synchronise the host on a GPU. Each cp rank holds chunks r and 2cp-1-r of every sequence; parameters are replicated
over cp, and every copy (cp, dp, the tied embedding) must be bitwise equal. All layouts of a world
size run in one job (:mod:`helpers.cp_cases`)."""

from __future__ import annotations

import pytest
import torch

from helpers.cp_cases import EVALUATED, LAYOUTS, SYNC_COUNTED, VARIANTS, reference, variants, world_results
from helpers.layout_cases import TOL, full_parameters, real_rows

CASES = [(world, layout) for world, layouts in LAYOUTS.items() for layout in layouts]


def _check(results: list[dict], name: str) -> None:
    ref = reference(name)
    if VARIANTS[name][0].get("params_dtype") == "bfloat16":
        return _check_bf16(results, ref, name)
    assert all(n > 0.05 for n in ref["norms"]), "clipping (clip_grad=0.05) must fire in this test"
    for res in results:
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), **TOL["float64"])
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), **TOL["float64"])
    got = full_parameters(results, name)  # cp and dp replicas and tied copies bitwise equal
    want = {key: real_rows(t, spec) for key, (t, spec, _) in ref["params"].items()}
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL["float64"], msg=lambda m, key=key: f"{name} {key}: {m}")


def _check_bf16(results: list[dict], ref: dict, name: str) -> None:
    """bf16 activations round differently when the sequence is split: losses and norms agree to
    bf16 precision; cp replicas stay bitwise equal."""
    for res in results:
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-2, atol=0)
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]),
                                   rtol=5e-2, atol=0)
    full_parameters(results, name)


@pytest.mark.parametrize("world, layout", CASES, ids=lambda x: "tp{}cp{}pp{}dp{}".format(*x) if isinstance(x, tuple)
                         else f"world{x}")
def test_context_parallel_trains_like_one_process(world, layout):
    results = [rank_results[layout] for rank_results in world_results(world)]
    assert sorted({res["gpt_p2p"]["cp_rank"] for res in results}) == list(range(layout[1]))
    for name in variants(*layout):
        _check(results, name)
    for name in EVALUATED:  # the forward-only schedule: evaluation of the initial model
        for res in results:
            assert abs(res[name]["eval"] - reference(name)["eval"]) <= 1e-9 * reference(name)["eval"], name
    for counted_layout, name in SYNC_COUNTED:  # cp attention, positions and dropout masks: no host sync
        if counted_layout == layout:
            for res in results:
                assert res[name]["syncs"] == [[], []], res[name]["syncs"]


def test_every_option_runs_at_two_layouts_or_more():
    """Coverage of the cases above: each option at >= 2 layouts, both comm types everywhere."""
    layouts = [layout for ls in LAYOUTS.values() for layout in ls]
    for option in ("dropout", "selective", "full", "sp", "llama"):
        assert sum(any(option in name for name in variants(*layout)) for layout in layouts) >= 2, option
    for layout in layouts:
        names = variants(*layout)
        assert any(n.startswith("gpt") for n in names) and any(n.startswith("llama") for n in names)
        assert any(n.endswith("p2p") for n in names) and any(n.endswith("all_gather") for n in names)
