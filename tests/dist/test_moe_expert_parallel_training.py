"""Expert parallelism trains exactly like one process (float64, 3 AdamW steps, clipping active):
per-step losses and gradient norms within 1e-9 relative and every parameter after them, the
experts rebuilt from their ep ranks' slices, at (tp, cp, pp, dp, ep) = (1,1,1,2,2), (1,1,1,4,4),
(1,1,1,4,2), (2,1,1,2,2) with sequence parallelism (ep over the tp ranks), (1,2,1,2,2) (ep over
the cp ranks) and (1,1,2,2,2) (two stages): expert gradients summed over their edp group, the
norm counting each expert once."""

from __future__ import annotations

import pytest
import torch

from helpers.layout_cases import TOL, real_rows
from helpers.moe_cases import EP_LAYOUTS, ep_variants, ep_world_results, reference
from ptdp.engine.tensor_parallel.sharding import unshard

CASES = [(world, layout) for world, layouts in EP_LAYOUTS.items() for layout in layouts]


def _full(results: list[dict], name: str) -> dict[str, torch.Tensor]:
    """Dense parameters from their tp shards, experts from their ep slices; replicas bitwise equal."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    kinds = {}
    for res in results:
        for key, (tensor, spec, index) in res[name]["params"].items():
            kinds[key] = spec
            seen = parts.setdefault(key, {})
            if index in seen:
                torch.testing.assert_close(tensor, seen[index], rtol=0, atol=0, msg=f"{name} {key}: replicas differ")
            else:
                seen[index] = tensor
    out = {}
    for key, by_index in parts.items():
        ordered = [by_index[i] for i in sorted(by_index)]
        if kinds[key] == "expert":
            out[key] = torch.cat(ordered)
        else:
            out[key] = real_rows(unshard(ordered, kinds[key]), kinds[key])
    return out


@pytest.mark.parametrize(
    "world, layout", CASES, ids=lambda x: "tp{}cp{}pp{}dp{}ep{}".format(*x) if isinstance(x, tuple) else f"world{x}"
)
def test_expert_parallel_training_equals_one_process(world, layout):
    results = [rank_results[layout] for rank_results in ep_world_results(world)]
    for name in ep_variants(layout):
        ref = reference(name)
        assert all(n > 0.05 for n in ref["norms"]), "clipping (clip_grad=0.05) must fire in this test"
        for res in results:
            torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), **TOL["float64"])
            torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), **TOL["float64"])
        got = _full(results, name)
        want = {key: real_rows(t, spec) for key, (t, spec, _) in ref["params"].items()}
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(
                got[key], want[key], **TOL["float64"], msg=lambda m, key=key: f"{name} {key}: {m}"
            )
