"""Data-parallel engine pieces that need their own setups: compression, fp16 loss scaling, an
unused parameter, no_sync."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import rank_microbatches, tiny_config
from ptdp.engine.data_parallel.compression import start_reduction
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import FP16_OVERFLOW, train_step
from ptdp.layout.grid import ParallelLayout


def compression_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=world), PG_TIMEOUT)
    out = {}
    for codec in ("none", "fp16", "bf16"):
        grad = torch.full((1000,), 3e4)
        groups.stats.reset()
        start_reduction(codec, grad, groups.dp)()
        out[codec] = (grad.clone(), groups.stats.as_dict())
        big = torch.full((10,), 7e4)  # a mean beyond float16's largest value, 65,504
        start_reduction(codec, big, groups.dp)()
        out[f"{codec}_beyond_fp16"] = big
    # 1 bit: two scale blocks (64 + 36 elements); rank r sends r+1 in the first, 10(r+1) in the
    # second, and one negative element in each
    grad = one_bit_input(rank)
    residual = torch.zeros_like(grad)
    groups.stats.reset()
    start_reduction("1bit", grad, groups.dp, residual=residual)()
    out["1bit"] = (grad.clone(), groups.stats.as_dict(), residual.clone())
    # 50 steps of the same gradient (varied within each block): what was sent plus what is kept
    # equals what was given, so the running sum of averages tracks the true running sum
    grad = torch.linspace(-1.0, 3.0, 200, dtype=torch.float64) * (rank + 1) ** 2
    residual, total = torch.zeros_like(grad), torch.zeros_like(grad)
    for _ in range(50):
        step = grad.clone()
        start_reduction("1bit", step, groups.dp, residual=residual)()
        total += step
    out["1bit_feedback"] = (grad, total, residual)
    return out


def one_bit_input(rank: int) -> torch.Tensor:
    grad = torch.full((100,), float(rank + 1))
    grad[64:] = 10.0 * (rank + 1)
    grad[5], grad[70] = -1.0, -1.0
    return grad


def one_bit_sent(rank: int) -> torch.Tensor:
    """What rank ``rank`` sends: sign times its block's mean absolute value."""
    scales = ((63 * (rank + 1) + 1) / 64, (35 * 10 * (rank + 1) + 1) / 36)
    sent = torch.full((100,), scales[0])
    sent[64:] = scales[1]
    sent[5], sent[70] = -scales[0], -scales[1]
    return sent


@functools.cache
def compression_results() -> list[dict]:
    return run_in_pool(compression_worker, 4)


def test_fp16_compression_does_not_overflow_large_gradients():
    for res in compression_results():
        for codec in ("none", "fp16", "bf16"):
            grad = res[codec][0]
            assert torch.isfinite(grad).all(), codec
            torch.testing.assert_close(grad, torch.full((1000,), 3e4), rtol=1e-2, atol=0)


def test_fp16_compression_overflows_only_where_the_mean_itself_exceeds_float16():
    """The documented limit: each value is divided by dp before the cast, so only a mean gradient
    above 65,504 becomes inf (the step is then skipped, with a hint to use bf16); bf16 and fp32
    carry it."""
    for res in compression_results():
        assert torch.isinf(res["fp16_beyond_fp16"]).all()
        for codec in ("none", "bf16"):
            torch.testing.assert_close(res[f"{codec}_beyond_fp16"], torch.full((10,), 7e4), rtol=1e-2, atol=0)


def test_compressed_collectives_only_on_the_dp_axis_with_smaller_payloads():
    res = compression_results()[0]
    payload = {}
    for codec in ("none", "fp16", "bf16", "1bit"):
        comm = res[codec][1]
        assert comm and all(key.split("/")[0] == "dp" for key in comm), comm
        payload[codec] = sum(c["bytes"] for c in comm.values())
    assert payload["none"] == 4000 and payload["fp16"] == payload["bf16"] == 2000
    assert payload["1bit"] == 100 // 8 + 1 + 2 * 4  # packed signs + one fp32 scale per 64-element block


def test_one_bit_average_and_error_feedback():
    results = compression_results()
    expected = sum(one_bit_sent(r) for r in range(4)) / 4  # the same average on every rank
    for rank, res in enumerate(results):
        grad, _, residual = res["1bit"]
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(residual, one_bit_input(rank) - one_bit_sent(rank))


def test_one_bit_error_feedback_tracks_the_running_sum():
    results = [res["1bit_feedback"] for res in compression_results()]
    true_mean = sum(g for g, _, _ in results) / 4
    residual_mean = sum(r for _, _, r in results) / 4
    for grad, total, residual in results:
        # sum over steps of the compressed averages = 50 * true average - average kept residual
        torch.testing.assert_close(total, 50 * true_mean - residual_mean, rtol=1e-10, atol=1e-10)
        # and the residual stays of the gradient's order, far below 50 steps of it (2.5x measured)
        assert residual.abs().max() < 4 * grad.abs().max()
    assert (residual_mean.abs() / 50 < 0.1 * true_mean.abs().max()).all()


def loss_scaling_worker(rank: int, world: int, tp: int, pp: int, dp: int, parallel: dict) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), PG_TIMEOUT)
    # the inf is put into the buffer after backward, so the reduction must not have started in it
    cfg = tiny_config(tp, pp, dp, "float16", parallel_overrides={"overlap_grad_reduce": False, **parallel})
    stage = build_stage(cfg, groups)
    import ptdp.engine.step as step_module

    original = step_module.finalize_grads

    def poisoned(model, buffer, g):  # one element of one rank's gradient becomes inf
        if g.global_rank == 3:
            buffer.data[7] = float("inf")
        original(model, buffer, g)

    stage.wait_for_params()
    before = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    scale_before = stage.scaler.scale.item()
    step_module.finalize_grads = poisoned
    try:
        result = train_step(stage, rank_microbatches(0, cfg, groups.dp.rank, groups.dp.size), 0)
    finally:
        step_module.finalize_grads = original
    stage.wait_for_params()
    unchanged = all(torch.equal(before[n], p) for n, p in stage.model.named_parameters())
    scale_after = stage.scaler.scale.item()
    good = train_step(stage, rank_microbatches(1, cfg, groups.dp.rank, groups.dp.size), 1)
    stage.wait_for_params()
    changed = any(not torch.equal(before[n], p) for n, p in stage.model.named_parameters())
    return {
        "skipped": result.skipped,
        "reason": result.skip_reason,
        "used": result.loss_scale,
        "unchanged": unchanged,
        "scales": (scale_before, scale_after),
        "good_skipped": good.skipped,
        "good_used": good.loss_scale,
        "changed_after_good": changed,
    }


@pytest.mark.parametrize(
    "tp, pp, dp, parallel",
    [
        (2, 1, 2, {}),
        pytest.param(2, 2, 2, {"use_distributed_optimizer": True}, marks=pytest.mark.slow),
    ],
    ids=["tp2_dp2", "tp2_pp2_dp2_distributed_optimizer"],
)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(tp, pp, dp, parallel):
    """An inf in one rank's gradient (rank 3: a first stage's tp rank 1, never the rank that counts
    a replicated parameter in the norm) skips the step on every rank as float16's overflow, with no
    collective of its own (the flag rides in the metrics all-reduce); the scale is halved on every
    rank and the next step, at the halved scale, trains."""
    results = run_in_pool(loss_scaling_worker, tp * pp * dp, tp, pp, dp, parallel)
    for res in results:
        assert res["skipped"] and res["reason"] == FP16_OVERFLOW and res["unchanged"], res
        assert res["scales"] == (2.0**16, 2.0**15) and res["used"] == 2.0**16, res
        assert not res["good_skipped"] and res["good_used"] == 2.0**15 and res["changed_after_good"], res


def unused_param_worker(rank: int, world: int) -> dict:
    """A stage whose model has a parameter that gets no gradient; small buckets; overlap on."""
    from ptdp.engine.tensor_parallel.sharding import GlobalParam, make_parameter

    groups = (
        ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=world), PG_TIMEOUT)
        if world > 1
        else ParallelGroups.single_process()
    )
    cfg = tiny_config(1, 1, world, "float64", parallel_overrides={"ddp_bucket_size": 300, "overlap_grad_reduce": True})
    import ptdp.engine.stage as stage_module

    original = stage_module.GPTModel

    class WithUnused(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.unused = make_parameter(GlobalParam((50,), init="ones"), 1, torch.float64)

    stage_module.GPTModel = WithUnused
    try:
        stage = build_stage(cfg, groups)
    finally:
        stage_module.GPTModel = original
    losses = [train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i).loss for i in range(2)]
    return {
        "losses": losses,
        "unused": stage.model.unused.detach().clone(),
        "params": {n: p.detach().clone() for n, p in stage.model.named_parameters()},
    }


def test_unused_parameter_neither_hangs_nor_corrupts():
    dp2 = run_in_pool(unused_param_worker, 2)
    ref = unused_param_worker(0, 1)
    for res in dp2:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-9, atol=0)
        assert torch.equal(res["unused"], torch.ones(50, dtype=torch.float64))  # zero gradient, no decay (1-D)
        for name, value in ref["params"].items():
            torch.testing.assert_close(res["params"][name], value, rtol=1e-9, atol=1e-12)


def compression_warmup_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=world), PG_TIMEOUT)
    out = {}
    for codec, warmup in (("none", None), ("1bit", 2)):
        cfg = tiny_config(
            1,
            1,
            world,
            "float64",
            parallel_overrides={"grad_compression": codec, "grad_compression_warmup_iters": warmup},
        )
        torch.manual_seed(0)
        stage = build_stage(cfg, groups)
        params = []
        for i in range(3):
            train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i)
            params.append({n: p.detach().clone() for n, p in stage.model.named_parameters()})
        out[codec] = params
    return out


def test_one_bit_compression_starts_after_its_warmup():
    """Iterations 0 and 1 are reduced exactly (bitwise the uncompressed run); iteration 2 is not."""
    for res in run_in_pool(compression_warmup_worker, 2):
        for i in (0, 1):
            assert all(torch.equal(res["1bit"][i][n], p) for n, p in res["none"][i].items()), i
        assert any(not torch.equal(res["1bit"][2][n], p) for n, p in res["none"][2].items())


def deferred_gather_worker(rank: int, world: int) -> dict:
    """overlap_param_gather with all-gathers that only run when waited on: a forward that read a
    parameter before its module's pre-hook waited would see the old value."""
    import ptdp.engine.optim.zero as zero

    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=2, dp=2), PG_TIMEOUT)
    real = zero.all_gather_async

    class Deferred:
        def __init__(self, *args, **kwargs):
            self.call = (args, kwargs)

        def wait(self):
            real(*self.call[0], **self.call[1]).wait()

    out = {}
    for overlap in (False, True):
        cfg = tiny_config(
            1,
            2,
            2,
            "float64",
            parallel_overrides={
                "use_distributed_optimizer": True,
                "overlap_param_gather": overlap,
                "ddp_bucket_size": 1500,
            },
        )
        zero.all_gather_async = Deferred if overlap else real
        try:
            stage = build_stage(cfg, groups)
            losses = [
                train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i).loss for i in range(3)
            ]
            stage.wait_for_params()
        finally:
            zero.all_gather_async = real
        out[overlap] = (losses, {n: p.detach().clone() for n, p in stage.model.named_parameters()})
    return out


def test_overlapped_param_gather_is_waited_for_by_every_reader():
    for res in run_in_pool(deferred_gather_worker, 4):
        assert res[True][0] == res[False][0]
        for name, value in res[False][1].items():
            assert torch.equal(res[True][1][name], value), name


def fp16_one_bit_worker(rank: int, world: int) -> dict:
    """float16 + 1-bit: an inf on one rank at step 0 is skipped and does not poison the residual."""
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=2), PG_TIMEOUT)
    # the inf is put into the buffer after backward, so the reduction must not have started in it
    cfg = tiny_config(
        1,
        1,
        2,
        "float16",
        parallel_overrides={
            "grad_compression": "1bit",
            "overlap_grad_reduce": False,
            "grad_compression_warmup_iters": 0,
        },
    )
    stage = build_stage(cfg, groups)
    import ptdp.engine.step as step_module

    original = step_module.finalize_grads

    def poisoned(model, buffer, g):
        if g.global_rank == 1:
            buffer.data[7] = float("inf")
        original(model, buffer, g)

    step_module.finalize_grads = poisoned
    try:
        first = train_step(stage, rank_microbatches(0, cfg, groups.dp.rank, groups.dp.size), 0)
    finally:
        step_module.finalize_grads = original
    later = [train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i) for i in range(1, 4)]
    return {
        "first": first.skipped,
        "later": [r.skipped for r in later],
        "residual_finite": bool(torch.isfinite(stage.grads.residual).all()),
    }


def test_fp16_overflow_with_one_bit_does_not_poison_the_error_feedback():
    for res in run_in_pool(fp16_one_bit_worker, 2):
        assert res["first"] and res["later"] == [False, False, False] and res["residual_finite"]


def one_bit_tp_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=1, dp=2), PG_TIMEOUT)
    cfg = tiny_config(
        2, 1, 2, "float32", parallel_overrides={"grad_compression": "1bit", "grad_compression_warmup_iters": 0}
    )
    stage = build_stage(cfg, groups)
    for i in range(3):
        train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i)
    from ptdp.engine.tensor_parallel.sharding import global_param

    return {
        "tp": groups.tp.rank,
        "replicated": {
            n: p.detach().clone() for n, p in stage.model.named_parameters() if global_param(p).tp_dim is None
        },
    }


def test_one_bit_keeps_tensor_parallel_replicas_identical():
    """LayerNorms, row-parallel biases and positions are replicated over tp: their compressed
    gradients (blocks never shared with a sharded neighbour) and so their values stay bitwise equal."""
    results = run_in_pool(one_bit_tp_worker, 4)
    for a, b in ((results[0], results[1]), (results[2], results[3])):
        assert a["tp"] != b["tp"]
        for name, value in a["replicated"].items():
            assert torch.equal(b["replicated"][name], value), name
