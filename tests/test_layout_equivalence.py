"""Invariant 1: every layout trains exactly like the single-process model (float64 1e-9, float32 1e-5)."""

from __future__ import annotations

import functools

import pytest
import torch

from ptdp.groups import ParallelGroups
from ptdp.tensor_parallel.sharding import unshard
from dist_helpers import run_workers
from layout_cases import layout_worker, tiny_config, train_and_collect

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 4, 1), (4, 1, 1)]
TOL = {"float64": dict(rtol=1e-9, atol=1e-12), "float32": dict(rtol=1e-5, atol=1e-5)}


@functools.cache
def reference(dtype: str) -> dict:
    return train_and_collect(tiny_config(1, 1, 1, dtype), ParallelGroups.single_process())


@functools.cache
def parallel_run(tp: int, pp: int, dp: int) -> list[dict]:
    return run_workers(layout_worker, tp * pp * dp, tp, pp, dp, ["float64", "float32"], (tp, pp, dp) == (2, 2, 2))


def full_parameters(results: list[dict], dtype: str) -> dict[str, torch.Tensor]:
    """Global tensors rebuilt from the tp shards of dp rank 0, every stage; checks replicas agree."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    specs = {}
    for res in results:
        tp_rank, _dp_rank, _pp_rank = res[dtype]["coords"]
        for name, (tensor, spec, _tied_copy) in res[dtype]["params"].items():
            specs[name] = spec
            key = shards.setdefault(name, {})
            if tp_rank in key:
                # another dp replica, or the tied copy on the other stage: must be bitwise equal
                torch.testing.assert_close(tensor, key[tp_rank], rtol=0, atol=0, msg=f"{name} differs between copies")
            else:
                key[tp_rank] = tensor
    out = {}
    for name, by_rank in shards.items():
        full = unshard([by_rank[r] for r in sorted(by_rank)], specs[name])
        real = specs[name].real_rows
        out[name] = full[:real] if real is not None else full
    return out


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_layout_matches_single_process(layout, dtype):
    ref = reference(dtype)
    results = parallel_run(*layout)
    tol = TOL[dtype]
    for res in results:
        torch.testing.assert_close(torch.tensor(res[dtype]["losses"]), torch.tensor(ref["losses"]), **tol)
        torch.testing.assert_close(torch.tensor(res[dtype]["norms"]), torch.tensor(ref["norms"]), **tol)
    assert all(n > 0.05 for n in ref["norms"]), "clipping must fire in this test"
    got = full_parameters(results, dtype)
    want = {name: t for name, (t, spec, _) in ref["params"].items()}
    want = {n: (t[: ref["params"][n][1].real_rows] if ref["params"][n][1].real_rows else t) for n, t in want.items()}
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")


def test_padded_vocab_rows_stay_zero():
    results = parallel_run(4, 1, 1)
    for res in results:
        tensor, spec, _ = res["float64"]["params"]["word_embeddings.weight"]
        assert spec.global_shape[0] == 320  # 303 padded to a multiple of 8 * tp
        tp_rank = res["float64"]["coords"][0]
        rows = torch.arange(tp_rank * 80, (tp_rank + 1) * 80)
        assert torch.all(tensor[rows >= 303] == 0)
