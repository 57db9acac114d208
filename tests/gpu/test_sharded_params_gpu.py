"""``optim_grads_params`` (ZeRO-3) on NCCL and CUDA (skipped without CUDA, and where fewer GPUs
than a test's world are visible): the units' storage freed with ``resize_`` and all-gathered on
the NCCL stream, waited for by the hooks, against a single-GPU reference: float64 within 1e-9
(resharding and kept, with full recompute) and bfloat16 within bf16 precision. Each worker r runs
on ``cuda:r`` of one machine."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT
from helpers.layout_cases import TOL, full_parameters, real_rows, tiny_config
from helpers.nccl_helpers import run_nccl_workers, train_on_device
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

pytestmark = pytest.mark.gpu

#: a realistic layer width (the tiny vocabulary keeps the output layer small)
WIDE = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 4096, "seq_length": 256}
ZERO3 = {"data_parallel_sharding_strategy": "optim_grads_params", "overlap_grad_reduce": True, "ddp_bucket_size": 2**20}
#: name -> (dtype, parallel overrides, model overrides)
VARIANTS = {
    "float64": ("float64", {}, {}),
    "kept_recompute": (
        "float64",
        {"reshard_after_forward": False},
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    ),
    "bfloat16": ("bfloat16", {}, {}),
}
STEPS = 3
LAYOUTS = [(1, 1, 2), (2, 2, 2)]


def gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


def _config(tp: int, pp: int, dp: int, variant: str):
    dtype, parallel, model = VARIANTS[variant]
    sharded = ZERO3 | parallel if tp * pp * dp > 1 else None
    return tiny_config(tp, pp, dp, dtype, parallel_overrides=sharded, **(WIDE | model))


def _worker(rank: int, world: int, tp: int, pp: int, dp: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), PG_TIMEOUT)
    device = torch.device("cuda", rank)
    return {v: train_on_device(_config(tp, pp, dp, v), groups, device, STEPS) for v in VARIANTS}


@functools.cache
def _reference(variant: str) -> dict:
    return train_on_device(_config(1, 1, 1, variant), ParallelGroups.single_process(), torch.device("cuda", 0), STEPS)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout",
    [pytest.param(lay, marks=gpus(lay[0] * lay[1] * lay[2])) for lay in LAYOUTS],
    ids=lambda lay: "tp{}pp{}dp{}".format(*lay),
)
def test_optim_grads_params_on_nccl_matches_one_gpu(layout):
    results = run_nccl_workers(_worker, layout[0] * layout[1] * layout[2], *layout)
    for variant, (dtype, _, _) in VARIANTS.items():
        ref = _reference(variant)
        tol = TOL["float64"] if dtype == "float64" else {"rtol": 1e-2, "atol": 0}
        for res in results:
            torch.testing.assert_close(torch.tensor(res[variant]["losses"]), torch.tensor(ref["losses"]), **tol)
        got = full_parameters(results, variant)  # replicas and tied copies bitwise equal
        if dtype == "float64":
            for name, (t, spec, _) in ref["params"].items():
                torch.testing.assert_close(
                    got[name], real_rows(t, spec), **tol, msg=lambda m, name=name: f"{name}: {m}"
                )
