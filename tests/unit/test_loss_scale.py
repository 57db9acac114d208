"""float16's dynamic loss scaler on the device: the schedule of scales a host-side scaler gives
(halve on a skip, never below the minimum; double after ``growth_interval`` good steps in a row),
the fused unscale and overflow flag, checkpoint state; and a single-process float16 step whose
gradients overflow: skipped as float16's overflow, scale halved, nothing read to the host."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.host_sync import count_host_syncs, label_check_on_device
from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.engine.data_parallel.loss_scale import DynamicLossScaler
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import FP16_OVERFLOW, NONFINITE_GRAD_NORM, read_results, train_step


def host_schedule(skips: list[bool], scale: float, interval: int, min_scale: float, good: int = 0) -> list[float]:
    """The scales after each step by the rule written out on the host: a skip halves the scale
    (not below ``min_scale``) and restarts the count; a good step counts, and every
    ``interval``-th good step in a row doubles the scale."""
    out = []
    for skipped in skips:
        if skipped:
            scale, good = max(scale / 2, min_scale), 0
        else:
            good += 1
            scale = scale * 2 if good % interval == 0 else scale
        out.append(scale)
    return out


def device_schedule(scaler: DynamicLossScaler, skips: list[bool]) -> list[float]:
    out = []
    for skipped in skips:
        scaler.update(torch.tensor(skipped))
        out.append(scaler.scale.item())
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_device_scaler_follows_the_host_schedule(seed):
    rng = random.Random(seed)
    skips = [rng.random() < 0.3 for _ in range(300)]
    skips[:12] = [True] * 12  # down to the minimum and held there
    skips[100:110] = [False] * 10  # grows at least twice in a row
    scaler = DynamicLossScaler(scale=2.0**10, growth_interval=3, min_scale=4.0)
    expected = host_schedule(skips, 2.0**10, 3, 4.0)
    assert device_schedule(scaler, skips) == expected
    pairs = list(zip(expected, expected[1:]))  # every branch of the rule was exercised:
    assert (4.0, 4.0) in pairs and any(b == 2 * a for a, b in pairs) and any(b == a / 2 for a, b in pairs)
    assert scaler.scale.dtype == torch.float32 and scaler.good_steps.dtype == torch.int64
    assert scaler.scale.dim() == 0 and scaler.good_steps.dim() == 0


def test_default_scaler_grows_after_a_thousand_good_steps_and_state_round_trips():
    scaler = DynamicLossScaler()
    scales = device_schedule(scaler, [False] * 1000)
    assert scales[998] == 2.0**16 and scales[999] == 2.0**17
    state = scaler.state_dict()
    assert state == {"scale": 2.0**17, "good_steps": 1000}
    # a loaded state continues the count: 999 good steps in, the next good step doubles
    resumed = DynamicLossScaler()
    held = resumed.scale
    resumed.load_state_dict({"scale": 2.0**12, "good_steps": 1999})
    assert resumed.scale is held and resumed.scale.item() == 2.0**12
    assert device_schedule(resumed, [False]) == host_schedule([False], 2.0**12, 1000, 1.0, good=1999) == [2.0**13]


def test_unscale_divides_in_place_and_flags_an_inf_or_nan():
    scaler = DynamicLossScaler()
    scale = torch.tensor(8.0)
    grads = torch.tensor([8.0, -4.0, 1.0], dtype=torch.float32)
    flag = scaler.unscale(grads, scale)
    assert flag.item() == 0.0 and flag.dim() == 0
    torch.testing.assert_close(grads, torch.tensor([1.0, -0.5, 0.125]), rtol=0, atol=0)
    for bad in (float("inf"), float("nan")):
        grads = torch.tensor([8.0, bad, 1.0])
        assert scaler.unscale(grads, scale).item() == 1.0


def test_no_host_read_in_the_scaler():
    scaler = DynamicLossScaler()
    grads = torch.ones(10)
    with count_host_syncs() as count:
        flag = scaler.unscale(grads, scaler.scale)
        scaler.update(flag > 0)
    assert count.calls == []


def overflowing_step(stage, cfg, iteration: int):
    """A step whose gradient buffer gets an inf after backward (the reduction of the last bucket
    has not started: overlap is off)."""
    import ptdp.engine.step as step_module

    original = step_module.finalize_grads

    def poisoned(model, buffer, g):
        buffer.data[3] = float("inf")
        original(model, buffer, g)

    step_module.finalize_grads = poisoned
    try:
        return train_step(stage, rank_microbatches(iteration, cfg, 0, 1), iteration)
    finally:
        step_module.finalize_grads = original


def test_an_overflowing_float16_step_is_skipped_and_halves_the_scale_without_a_host_read():
    cfg = tiny_config(1, 1, 1, "float16", parallel_overrides={"overlap_grad_reduce": False})
    stage = build_stage(cfg, ParallelGroups.single_process())
    stage.scaler.min_scale = 2.0**15
    train_step(stage, rank_microbatches(0, cfg, 0, 1), 0)  # the first step creates Adam's state
    before = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    with label_check_on_device(), count_host_syncs() as count:
        bad = overflowing_step(stage, cfg, 1)  # at 2^16: the scaler halves it
        at_min = overflowing_step(stage, cfg, 2)  # at 2^15, the minimum: a real failure
    assert count.calls == []
    assert all(torch.equal(before[n], p) for n, p in stage.model.named_parameters())
    with label_check_on_device(), count_host_syncs() as count:
        good = train_step(stage, rank_microbatches(3, cfg, 0, 1), 3)
    assert count.calls == []
    bad_result, min_result, good_result = read_results([bad, at_min, good])
    assert (bad_result.skipped, bad_result.skip_reason, bad_result.loss_scale) == (True, FP16_OVERFLOW, 2.0**16)
    assert not bad_result.nonfinite
    assert (min_result.skip_reason, min_result.loss_scale, min_result.nonfinite) == (NONFINITE_GRAD_NORM, 2.0**15, True)
    assert (good_result.skipped, good_result.skip_reason, good_result.loss_scale) == (False, None, 2.0**15)
    assert any(not torch.equal(before[n], p) for n, p in stage.model.named_parameters())
    assert stage.scaler.scale.item() == 2.0**15 and stage.scaler.good_steps.item() == 1


def test_a_checkpoint_keeps_the_scale_and_the_count(tmp_path):
    from ptdp.run.checkpoint import io

    cfg = tiny_config(1, 1, 1, "float16", parallel_overrides={"overlap_grad_reduce": False})
    stage = build_stage(cfg, ParallelGroups.single_process())
    with label_check_on_device():
        overflowing_step(stage, cfg, 0)
        train_step(stage, rank_microbatches(1, cfg, 0, 1), 1)
        train_step(stage, rank_microbatches(2, cfg, 0, 1), 2)
    assert stage.scaler.state_dict() == {"scale": 2.0**15, "good_steps": 2}
    io.save_checkpoint(stage, tmp_path / "ckpt", 3, consumed_samples=24)
    fresh = build_stage(cfg, ParallelGroups.single_process())
    io.load_checkpoint(fresh, tmp_path / "ckpt")
    assert fresh.scaler.state_dict() == {"scale": 2.0**15, "good_steps": 2}
    with label_check_on_device():
        assert train_step(fresh, rank_microbatches(3, cfg, 0, 1), 3).loss_scale == 2.0**15
