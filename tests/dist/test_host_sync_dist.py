"""At (tp, pp, dp) = (2, 2, 2) too, a steady-state step synchronises the host once if it is logged
and never otherwise, on every rank: with the gradient buffer's overlapped reduction, the
distributed optimizer and the 1-bit codec, in float16 with its loss scaler, and with optimizer
post-validation."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.host_sync import label_check_on_device
from helpers.sync_cases import ITERS, counted_run, logged
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

VARIANTS = {
    "float64": ("float64", {}),
    "bf16_distributed_optimizer": (
        "bfloat16",
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True},
    ),
    "1bit": ("float64", {"grad_compression": "1bit", "grad_compression_warmup_iters": 0}),
    # the loss scale as a device tensor in the loss, the unscale and the 1-bit codec's residual
    "float16_1bit": (
        "float16",
        {"grad_compression": "1bit", "grad_compression_warmup_iters": 0, "overlap_grad_reduce": True},
    ),
    "float16_post_validation": (
        "float16",
        {"use_distributed_optimizer": True, "overlap_param_gather": True},
        {"enable_optimizer_post_validation": True},
    ),
}


def sync_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=2, dp=2), PG_TIMEOUT)
    out = {}
    with tempfile.TemporaryDirectory() as tmp, label_check_on_device():
        for name, (dtype, parallel, *train) in VARIANTS.items():
            out[name] = counted_run(
                groups, 2, 2, 2, Path(tmp) / name, dtype, train=train[0] if train else None, **parallel
            )
    return out


@pytest.mark.slow
def test_one_synchronisation_per_logged_step_on_every_rank():
    results = run_in_pool(sync_worker, 8)
    for name in VARIANTS:
        for rank, res in enumerate(results):
            run = res[name]
            assert run["iterations"] == ITERS, (name, rank)
            for iteration, calls in run["per_step"].items():
                if iteration > 1:
                    assert len(calls) == (1 if logged(iteration) else 0), (name, rank, iteration, calls)
        assert len({res[name]["final_loss"] for res in results}) == 1, name
