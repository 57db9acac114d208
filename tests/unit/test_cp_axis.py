"""The cp axis in the world size and what is derived from it before any process: dp from the
world, the local workers ``ptdp train`` starts, the run's layout in the planner's report and the
memory check (ZeRO-1 over dp x cp, one cp rank's activations)."""

from __future__ import annotations

import dataclasses

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import _resolve_dp, local_world_size, resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.errors import Violation
from ptdp.planner.candidate import run_candidate
from ptdp.run.memory_check import rank_estimates
from ptdp.run.rundir import run_dir_path


def _config(**parallel) -> Config:
    model = ModelConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512, params_dtype="bfloat16"
    )
    return Config(
        model=model, parallel=ParallelConfig(**parallel), train=TrainConfig(micro_batch_size=1, global_batch_size=8)
    )


def test_world_is_tp_cp_pp_dp():
    config = _config(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=3, context_parallel_size=2, data_parallel_size=5
    )
    assert config.world_size == 2 * 2 * 3 * 5
    errors: list[Violation] = []
    assert _resolve_dp(dataclasses.replace(config.parallel, data_parallel_size=None), 60, errors) == 5 and not errors
    _resolve_dp(dataclasses.replace(config.parallel, data_parallel_size=None), 18, errors)
    assert (
        "world_size=18 is not divisible by tp*cp*pp=2*2*3=12 (rule: world_size = tp * cp * pp * dp)"
        in errors[0].message
    )


def test_local_workers_count_cp():
    assert local_world_size(_config(context_parallel_size=2, data_parallel_size=3)) == 6
    assert local_world_size(_config(tensor_model_parallel_size=2, context_parallel_size=2)) == 8  # default 8 workers
    assert local_world_size(_config(tensor_model_parallel_size=3, context_parallel_size=2)) == 6  # 6 does not divide 8
    assert local_world_size(_config(tensor_model_parallel_size=2, context_parallel_size=2), gpus=4) == 4


def test_run_layout_for_the_planner_and_the_memory_check_has_cp():
    one = resolve(_config(context_parallel_size=1, data_parallel_size=4, use_distributed_optimizer=True), 4)
    two = resolve(
        _config(
            context_parallel_size=2, data_parallel_size=2, use_distributed_optimizer=True, cp_comm_type="all_gather"
        ),
        4,
    )
    layout = run_candidate(two)
    assert (layout.tp, layout.cp, layout.dp, layout.parallel.cp_comm_type) == (1, 2, 2, "all_gather")
    assert layout.sharding_strategy == "optim" and layout.shard_size == 4 and layout.num_gpus == 4
    assert run_candidate(one).cp == 1
    (r1,), (r2,) = rank_estimates(one), rank_estimates(two)
    # the same parameters and ZeRO-1 over dp x cp = 4 ranks either way; a cp rank holds half the tokens
    assert (r1.params, r1.grads, r1.optimizer) == (r2.params, r2.grads, r2.optimizer)
    assert r2.activations < r1.activations
    assert "-tp1-cp2-pp1-dp2" in str(run_dir_path(two)) and "-tp1-pp1-dp4" in str(run_dir_path(one))
