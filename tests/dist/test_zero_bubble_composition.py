"""Zero-bubble schedules composed with context parallelism, FP8 (emulated, float64) and MoE with
expert parallelism train like one process: losses, gradient norms and parameters after 3 steps
within 1e-9."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import full_parameters, tiny_config, train_and_collect
from helpers.moe_cases import check_like_one_process, collect_ep, ep_full_parameters, moe_config
from ptdp.config.fp8 import FP8Config
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

#: name: ((tp, cp, pp, dp), model overrides, parallel overrides, FP8, MoE)
CASES = {
    "zb_h1_cp": ((1, 2, 2, 1), {"seq_length": 16}, {"pipeline_schedule": "zb-h1"}, None, None),
    "zb_v_fp8_delayed": (
        (1, 1, 2, 2),
        {"num_layers": 8, "seq_length": 16},
        {"pipeline_schedule": "zb-v"},
        FP8Config(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2),
        None,
    ),
}


def case_config(name: str, parallel_run: bool) -> Config:
    (tp, cp, pp, dp), model, parallel, fp8, moe = CASES[name]
    if not parallel_run:
        tp = cp = pp = dp = 1
        parallel = {}
    parallel = {**parallel, "context_parallel_size": cp}
    train = {"micro_batch_size": 1}  # dualpipev: 2p microbatches per dp rank
    return tiny_config(
        tp, pp, dp, "float64", train_overrides=train, parallel_overrides=parallel, fp8=fp8, moe=moe, **model
    )


def worker(rank: int, world: int, name: str) -> dict:
    (tp, cp, pp, dp), *_ = CASES[name]
    cfg = case_config(name, True)
    ep = cfg.parallel.expert_model_parallel_size
    groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT, ep=ep)
    return train_and_collect(cfg, groups)


@functools.cache
def reference(name: str) -> dict:
    return train_and_collect(case_config(name, False), ParallelGroups.single_process())


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_bubble_composes(name):
    (tp, cp, pp, dp), *_ = CASES[name]
    results = [{name: r} for r in run_in_pool(worker, tp * cp * pp * dp, name)]
    check_like_one_process(results, name, reference(name), full_parameters(results, name))


def moe_case(pp: int, dp: int, ep: int) -> Config:
    """The expert-parallel MoE variant (8 experts, capacity, shared expert) with b = 1 under
    DualPipeV at pp > 1 (2p micro-batches per pipeline)."""
    cfg = moe_config("moe_ep", 1, 1, pp, dp, ep)
    train = dataclasses.replace(cfg.train, micro_batch_size=1)
    parallel = cfg.parallel if pp == 1 else dataclasses.replace(cfg.parallel, pipeline_schedule="dualpipev")
    return resolve(dataclasses.replace(cfg, train=train, parallel=parallel), pp * dp)


def moe_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=2, dp=2), PG_TIMEOUT, ep=2)
    return {"moe": collect_ep(moe_case(2, 2, 2), groups)}


def test_dualpipev_with_expert_parallelism_matches_one_process():
    results = run_in_pool(moe_worker, 4)
    ref = train_and_collect(moe_case(1, 1, 1), ParallelGroups.single_process())
    check_like_one_process(results, "moe", ref, ep_full_parameters(results, "moe"))


#: 16-bit parameters with float32 main parameters and gradients (float16 with a dynamic loss
#: scale): rounding differs by layout, so they track one process loosely
SIXTEEN_BIT = {"zb_v_bf16": ("bfloat16", "zb-v"), "zb_h1_fp16": ("float16", "zb-h1")}


def sixteen_bit_config(name: str, pp: int, dp: int) -> Config:
    dtype, kind = SIXTEEN_BIT[name]
    parallel = {"pipeline_schedule": kind} if pp > 1 else {}
    return tiny_config(1, pp, dp, dtype, parallel_overrides=parallel, num_layers=8)


def sixteen_bit_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=2, dp=2), PG_TIMEOUT)
    return {name: train_and_collect(sixteen_bit_config(name, 2, 2), groups) for name in SIXTEEN_BIT}


def test_zero_bubble_in_16_bit_tracks_one_process():
    results = run_in_pool(sixteen_bit_worker, 4)
    for name in SIXTEEN_BIT:
        ref = train_and_collect(sixteen_bit_config(name, 1, 1), ParallelGroups.single_process())
        for res in results:
            got = torch.tensor(res[name]["losses"])
            torch.testing.assert_close(got, torch.tensor(ref["losses"]), rtol=1e-2, atol=0, msg=name)
            torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), rtol=5e-2, atol=0)
        full_parameters(results, name)  # dp replicas bitwise equal
