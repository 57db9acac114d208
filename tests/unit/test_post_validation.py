"""Optimizer post-validation (--enable-optimizer-post-validation) equals the synchronous step bit
for bit, step after step with the optimizer state carried on: a plain step, a clipped one (the
optimistic update rolled back and redone), one with a nan or inf gradient (rolled back: nothing
changes), and float16's loss-scale overflow; for every optimizer (AdamW, float32 main parameters,
a bf16 gradient buffer, the distributed optimizer and sharded parameters), with no host read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ptdp.engine.step as step_module
from helpers.host_sync import count_host_syncs, label_check_on_device
from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.optim.post_validation import Snapshot
from ptdp.engine.stage import build_stage
from ptdp.engine.step import FP16_OVERFLOW, NONFINITE_GRAD_NORM, read_results, train_step

CLIP = 1.0
#: what each step's gradients are made: scaled far below (``plain``) or above (``clip``) the clip
#: norm, a nan or an inf put in, or (float16) an inf before unscaling while the scale can halve
STEPS = ["nan", "clip", "plain", "inf", "clip", "plain", "clip"]
FP16_STEPS = ["clip", "overflow", "plain", "clip", "overflow", "plain"]

#: name -> (dtype, parallel overrides, steps)
CASES = {
    "adamw": ("float64", {}, STEPS),
    "distributed_optimizer": ("float64", {"use_distributed_optimizer": True, "ddp_bucket_size": 901}, STEPS),
    "sharded_params": ("float64", {"data_parallel_sharding_strategy": "optim_grads_params"}, STEPS),
    "main_params": ("bfloat16", {}, STEPS),
    "bf16_grads": ("bfloat16", {"grad_reduce_in_bf16": True, "use_distributed_optimizer": True}, STEPS),
    "float16": ("float16", {}, FP16_STEPS),
}


FINALIZE = step_module.finalize_grads


def shaped(kind: str):
    """``finalize_grads``, then this rank's reduced gradients made of the kind asked."""

    def finalize(model, buffer, groups):
        FINALIZE(model, buffer, groups)
        with torch.no_grad():
            if kind == "plain":
                buffer.reduced.mul_(2.0**-12)
            elif kind == "clip":
                buffer.reduced.mul_(2.0**8)
            else:
                buffer.reduced[3] = float("nan") if kind == "nan" else float("inf")

    return finalize


def training_state(stage) -> dict[str, torch.Tensor]:
    """Parameters, every optimizer tensor (moments, step count, main parameters) and the loss
    scale, copied."""
    stage.wait_for_params()
    state = {f"param/{n}": p.detach().clone() for n, p in global_named_parameters(stage.model)}
    inner = getattr(stage.optimizer, "inner", stage.optimizer)
    for i, group in enumerate(inner.param_groups):
        for j, p in enumerate(group["params"]):
            state[f"optim/{i}/{j}"] = p.detach().clone()
            state.update({f"optim/{i}/{j}/{k}": v.clone() for k, v in inner.state.get(p, {}).items()})
    if stage.scaler is not None:
        state["scale"] = stage.scaler.scale.clone()
    return state


def run(case: str, post_validation: bool) -> tuple[list, list[dict[str, torch.Tensor]], list[str]]:
    """Train the case's steps; return the results, the training state after each step, and what
    the shim counted as host synchronisations."""
    dtype, parallel, kinds = CASES[case]
    cfg = tiny_config(1, 1, 1, dtype, parallel_overrides={"overlap_grad_reduce": False} | parallel)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, clip_grad=CLIP, enable_optimizer_post_validation=post_validation),
    )
    stage = build_stage(cfg, ParallelGroups.single_process())
    if stage.scaler is not None:
        stage.scaler.min_scale = 2.0**12  # each overflow halves the scale, from 2^16
    pending, states, syncs = [], [], []
    for i, kind in enumerate(kinds):
        step_module.finalize_grads = shaped(kind)
        try:
            with label_check_on_device(), count_host_syncs() as count:
                pending.append(train_step(stage, rank_microbatches(i, cfg, 0, 1), i))
        finally:
            step_module.finalize_grads = FINALIZE
        syncs += count.calls
        states.append(training_state(stage))
    return read_results(pending), states, syncs


def differing(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


@pytest.mark.parametrize("case", list(CASES))
def test_post_validated_steps_equal_synchronous_steps_bit_for_bit(case):
    kinds = CASES[case][2]
    results, states, syncs = run(case, post_validation=True)
    want_results, want_states, _ = run(case, post_validation=False)
    assert syncs == []
    for i, kind in enumerate(kinds):
        got, want = results[i], want_results[i]
        torch.testing.assert_close(
            torch.tensor([got.loss, got.grad_norm]),
            torch.tensor([want.loss, want.grad_norm]),
            rtol=0,
            atol=0,
            equal_nan=True,
        )
        assert (got.skip_reason, got.loss_scale) == (want.skip_reason, want.loss_scale), f"step {i} ({kind})"
        assert differing(states[i], want_states[i]) == [], f"step {i} ({kind})"
        # the steps are the kinds they were made to be
        if kind == "plain":
            assert not got.skipped and got.grad_norm < CLIP
        elif kind == "clip":
            assert not got.skipped and got.grad_norm > CLIP
        else:
            reason = FP16_OVERFLOW if kind == "overflow" else NONFINITE_GRAD_NORM
            assert got.skip_reason == reason
            before = states[i - 1] if i else None
            if before is not None:  # nothing changed but (float16) the halved scale
                assert differing(states[i], before) == (["scale"] if kind == "overflow" else [])
    if kinds[0] == "nan":  # a skipped first step leaves Adam's state as created: zeros
        first = {k: v for k, v in states[0].items() if k.endswith(("exp_avg", "exp_avg_sq", "step"))}
        assert first and all(not v.any() for v in first.values())


def test_a_snapshot_restores_only_where_told():
    """``restore(redo)`` puts back parameters and state (state created since: zeros) where
    ``redo`` is true, and leaves every bit as it is where it is false, nan included."""
    from ptdp.engine.optim.adamw import adamw

    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float64))
    opt = adamw([{"params": [p]}], lr=0.1)
    for redo, grad in ((True, float("nan")), (False, 1.0)):
        snapshot = Snapshot(opt)
        before = p.detach().clone()
        p.grad = torch.full_like(p, grad)
        opt.step()
        after = {"p": p.detach().clone()} | {k: v.clone() for k, v in opt.state[p].items()}
        snapshot.restore(torch.tensor(redo))
        if redo:
            assert torch.equal(p, before) and all(not v.any() for v in opt.state[p].values())
        else:
            assert torch.equal(p, after["p"]) and all(torch.equal(opt.state[p][k], after[k]) for k in opt.state[p])
            assert not torch.equal(p, before)
