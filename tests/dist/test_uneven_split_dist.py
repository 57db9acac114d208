"""Megatron's first/last pipeline stage counts train exactly like one process (float64 within
1e-9) and bitwise like the same split given as ``--pipeline-layer-split``, at pp = 4; so do splits
that count the embedding and the loss as layers, interleaved with model chunks holding only the
embedding or only the output layer + loss."""

from __future__ import annotations

import functools

import torch

from helpers.dist_helpers import run_in_pool
from helpers.layout_cases import TOL, full_parameters, layout_worker, real_rows, reference

VARIANTS = ["first_last", "first_last_explicit", "first_only", "accounted_interleaved", "accounted_embedding"]


@functools.cache
def _results() -> list[dict]:
    return run_in_pool(layout_worker, 4, 1, 4, 1, VARIANTS, False)


def _layers_by_stage(results: list[dict], variant: str) -> dict[int, list[int]]:
    return {
        res[variant]["coords"][2]: sorted(
            {int(n.split(".")[1]) for n in res[variant]["params"] if n.startswith("layers.")}
        )
        for res in results
    }


def test_first_last_counts_train_like_one_process():
    results = _results()
    for variant in ("first_last", "first_only", "accounted_interleaved", "accounted_embedding"):
        ref = reference(variant)
        for res in results:
            torch.testing.assert_close(
                torch.tensor(res[variant]["losses"]), torch.tensor(ref["losses"]), **TOL["float64"]
            )
            torch.testing.assert_close(
                torch.tensor(res[variant]["norms"]), torch.tensor(ref["norms"]), **TOL["float64"]
            )
        assert all(n > 0.05 for n in ref["norms"]), "clipping (clip_grad=0.05) must fire in this test"
        got = full_parameters(results, variant)
        want = {name: real_rows(t, spec) for name, (t, spec, _) in ref["params"].items()}
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL["float64"], msg=lambda m: f"{variant} {name}: {m}")
    assert _layers_by_stage(results, "first_last") == {0: [0], 1: [1, 2, 3], 2: [4, 5, 6], 3: [7]}
    assert _layers_by_stage(results, "first_only") == {0: [0], 1: [1, 2], 2: [3, 4], 3: [5, 6]}
    # units 0 (embedding), 1-6 (layers 0-5), 7 (loss); virtual stage k = chunk * 4 + rank holds unit k
    assert _layers_by_stage(results, "accounted_interleaved") == {0: [3], 1: [0, 4], 2: [1, 5], 3: [2]}
    assert _layers_by_stage(results, "accounted_embedding") == {0: [0], 1: [1, 2], 2: [3, 4], 3: [5, 6]}


def test_first_last_counts_equal_the_explicit_split_bitwise():
    for res in _results():
        a, b = res["first_last"], res["first_last_explicit"]
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert sorted(a["params"]) == sorted(b["params"])
        for name, (tensor, _, _) in a["params"].items():
            assert torch.equal(tensor, b["params"][name][0]), name
