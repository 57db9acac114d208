"""A nan/inf loss or gradient norm on one rank skips the step on every rank, with no change to the
training state; too many in a row stop training; a non-finite state is never checkpointed."""

from __future__ import annotations

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.faults import NAN_LOSS_ENV, FaultPlan, install
from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage
from ptdp.engine.step import NONFINITE_LOSS, train_step
from ptdp.layout.grid import ParallelLayout

POST_VALIDATION = {"enable_optimizer_post_validation": True}
#: variant -> (dtype, parallel overrides, the global rank whose forward is poisoned at iteration 2,
#: train overrides)
VARIANTS = {
    "float64": ("float64", {}, 6, {}),  # a last stage's tp rank 0: its loss is the one summed
    "distributed_optimizer": ("float64", {"use_distributed_optimizer": True, "ddp_bucket_size": 901}, 1, {}),
    "bf16": ("bfloat16", {}, 5, {}),  # a last stage's tp rank 1: only the flag carries its nan loss
    "bf16_distributed_optimizer": ("bfloat16", {"use_distributed_optimizer": True}, 2, {}),
    "1bit": ("float64", {"grad_compression": "1bit", "grad_compression_warmup_iters": 0}, 3, {}),
    # every rank updates before it knows, then rolls back
    "post_validation": ("float64", {}, 0, POST_VALIDATION),
    "post_validation_bf16_distributed_optimizer": ("bfloat16", {"use_distributed_optimizer": True}, 6, POST_VALIDATION),
}


def training_state(stage) -> dict[str, torch.Tensor]:
    """Parameters, every optimizer tensor (Adam moments and step, float32 main parameters, whole or
    sharded) and the 1-bit residual of this rank, copied."""
    stage.wait_for_params()
    state = {f"param/{n}": p.detach().clone() for n, p in global_named_parameters(stage.model)}
    inner = getattr(stage.optimizer, "inner", stage.optimizer)
    for i, group in enumerate(inner.param_groups if inner is not None else []):
        for j, p in enumerate(group["params"]):
            state[f"optim/{i}/{j}"] = p.detach().clone()
            state.update({f"optim/{i}/{j}/{k}": v.clone() for k, v in inner.state.get(p, {}).items()})
    if stage.grads.residual is not None:
        state["residual"] = stage.grads.residual.clone()
    return state


def differing(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def skip_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=2, dp=2), PG_TIMEOUT)
    out = {}
    for name, (dtype, parallel, poisoned, train) in VARIANTS.items():
        cfg = tiny_config(2, 2, 2, dtype, parallel_overrides=parallel, train_overrides=train)

        def step(stage, it, faults=None):
            remove = install(faults)
            try:
                return train_step(stage, rank_microbatches(it, cfg, groups.dp.rank, groups.dp.size), it)
            finally:
                remove()

        stage = build_stage(cfg, groups)
        first = step(stage, 0)
        before = training_state(stage)
        bad = step(stage, 1, FaultPlan.from_env({NAN_LOSS_ENV: f"{poisoned}:2"}))
        after_skip = training_state(stage)
        later = step(stage, 2)
        # the same steps without the skipped one: 0, then 2 (same data, same learning rate)
        reference = build_stage(cfg, groups)
        step(reference, 0)
        ref_later = step(reference, 2)
        out[name] = {
            "results": [(r.skipped, r.skip_reason) for r in (first, bad, later)],
            "losses": [first.loss, bad.loss, later.loss],
            "changed_by_skip": differing(before, after_skip),
            "later_equals_reference": (later.loss, later.grad_norm) == (ref_later.loss, ref_later.grad_norm)
            and not differing(training_state(stage), training_state(reference)),
        }
    return out


@pytest.mark.slow
def test_nan_on_one_rank_skips_the_step_everywhere_without_any_change():
    """(2,2,2): NaN in one rank's forward at iteration 2 -> every rank skips iteration 2 with the
    same reason, parameters, Adam state, main parameters and 1-bit residual stay bitwise equal,
    and iteration 3 continues exactly as if iteration 2 had not been trained on."""
    results = run_in_pool(skip_worker, 8)
    for name in VARIANTS:
        for rank, res in enumerate(results):
            r = res[name]
            assert r["results"] == [(False, None), (True, NONFINITE_LOSS), (False, None)], (name, rank, r)
            assert r["changed_by_skip"] == [], (name, rank)
            assert r["later_equals_reference"], (name, rank)
            assert all(map(torch.isfinite, map(torch.tensor, (r["losses"][0], r["losses"][2])))), (name, r)
        assert len({tuple(map(str, res[name]["losses"])) for res in results}) == 1, name
