"""The recompute tests' cases: each recompute setting against the same base without it."""

from __future__ import annotations

import torch

from helpers.layout_cases import tiny_config, train_and_collect
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups

FULL_UNIFORM_1 = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
FULL_UNIFORM_2 = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}
FULL_BLOCK_1 = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
SELECTIVE = {"recompute_granularity": "selective"}
RECOMPUTE = {
    "full_uniform_1": FULL_UNIFORM_1,
    "full_uniform_2": FULL_UNIFORM_2,
    "full_block_1": FULL_BLOCK_1,
    "selective": SELECTIVE,
}
#: (name, dtype, model overrides, parallel overrides used where pp > 1): each recompute variant is
#: compared with the variant of the same base without recompute
BASES = {
    "float64": ("float64", {}, {}),
    "float32": ("float32", {}, {}),
    # 8 layers in 2 chunks of 2 per rank at pp = 2: block and uniform act on each chunk
    "interleaved": ("float64", {"num_layers": 8}, {"num_layers_per_virtual_pipeline_stage": 2}),
    # forward pre-hooks of the parameter all-gathers fire again in the recompute
    "gather": (
        "float64",
        {},
        {
            "use_distributed_optimizer": True,
            "overlap_param_gather": True,
            "overlap_grad_reduce": True,
            "ddp_bucket_size": 1500,
        },
    ),
    # rotary q and k enter the recomputed core; 2 key/value groups (grouped-query attention)
    "llama": (
        "float64",
        {
            "normalization": "RMSNorm",
            "swiglu": True,
            "position_embedding_type": "rope",
            "num_query_groups": 2,
            "add_bias_linear": False,
        },
        {},
    ),
}
CASES = [(base, rec) for base in ("float64", "float32") for rec in RECOMPUTE] + [
    ("interleaved", "full_uniform_2"),
    ("interleaved", "full_block_1"),
    ("gather", "full_uniform_1"),
    ("llama", "selective"),
    ("llama", "full_uniform_1"),
]


def case_config(base: str, recompute: str | None, tp: int, pp: int, dp: int) -> Config:
    dtype, model, parallel = BASES[base]
    parallel = dict(parallel)
    if pp == 1:
        parallel.pop("num_layers_per_virtual_pipeline_stage", None)
    return tiny_config(tp, pp, dp, dtype, parallel_overrides=parallel, **model, **RECOMPUTE.get(recompute, {}))


def run_cases(tp: int, pp: int, dp: int, groups: ParallelGroups) -> dict:
    """Every base without recompute and every case, trained from the same weights and data."""
    runs = {(base, None) for base, _ in CASES} | set(CASES)
    return {
        key: train_and_collect(case_config(*key, tp, pp, dp), groups, record_comm_step=0)
        for key in sorted(runs, key=str)
    }


def assert_bitwise(results: dict, base: str, recompute: str) -> None:
    want, got = results[(base, None)], results[(base, recompute)]
    assert got["losses"] == want["losses"] and got["norms"] == want["norms"], (base, recompute)
    assert sorted(got["params"]) == sorted(want["params"])
    for name, (tensor, _spec, _tied) in want["params"].items():
        assert torch.equal(got["params"][name][0], tensor), f"{base}/{recompute}: {name} differs"
