"""The context-parallel equivalence cases: a tiny float64 GPT or Llama-like model trained 3 steps at
a (tp, cp, pp, dp) layout, every layout of one world size in one job, against one process."""

from __future__ import annotations

import dataclasses
import functools

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.host_sync import count_host_syncs, label_check_on_device
from helpers.layout_cases import LLAMA_OPTIONS, VOCAB, rank_microbatches, train_and_collect
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import eval_loss, read_results, train_step
from ptdp.layout.grid import ParallelLayout

#: (tp, cp, pp, dp) of the issue, by world size (one job per world size)
LAYOUTS = {2: [(1, 2, 1, 1)], 4: [(1, 4, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 2)], 8: [(2, 2, 2, 1)]}

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
SELECTIVE = {"recompute_granularity": "selective"}
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
QWEN3_HEADS = {"kv_channels": 12, "qk_layernorm": True}

#: name -> (model overrides, parallel overrides). Every layout runs the GPT with p2p and the
#: Llama-like model (rotary, 2 query groups of 2 heads) with all_gather; the options below run where
#: :func:`variants` says, with the other pairings (dropout only at dp = 1: masks depend on the dp rank).
VARIANTS = {
    "gpt_p2p": ({}, {"cp_comm_type": "p2p"}),
    "llama_all_gather": (LLAMA_OPTIONS, {"cp_comm_type": "all_gather"}),
    "gpt_dropout_selective_all_gather": (DROPOUT | SELECTIVE, {"cp_comm_type": "all_gather"}),
    "llama_dropout_full_p2p": (LLAMA_OPTIONS | DROPOUT | FULL, {"cp_comm_type": "p2p"}),
    "gpt_sp_dropout_all_gather": (DROPOUT, {"cp_comm_type": "all_gather", "sequence_parallel": True}),
    "llama_sp_selective_p2p": (LLAMA_OPTIONS | SELECTIVE, {"cp_comm_type": "p2p", "sequence_parallel": True}),
    # interleaved 1F1B: 4 layers in 2 model chunks of 1 layer per pipeline rank
    "gpt_interleaved_all_gather": (
        {"num_layers": 4},
        {
            "cp_comm_type": "all_gather",
            "pipeline_schedule": "interleaved-1f1b",
            "num_layers_per_virtual_pipeline_stage": 1,
        },
    ),
    # GPipe: every microbatch's forward before any backward
    "llama_gpipe_p2p": (LLAMA_OPTIONS, {"cp_comm_type": "p2p", "pipeline_schedule": "gpipe"}),
    # the other two pairings of model and comm type, where no dropout variant runs them (dp > 1)
    "gpt_all_gather": ({}, {"cp_comm_type": "all_gather"}),
    "llama_p2p": (LLAMA_OPTIONS, {"cp_comm_type": "p2p"}),
    # Qwen3's heads (12 channels, h / a = 8, query/key norms; their gradients summed over tp at tp = 2)
    "qwen3_p2p": (LLAMA_OPTIONS | QWEN3_HEADS, {"cp_comm_type": "p2p"}),
    "qwen3_all_gather": (LLAMA_OPTIONS | QWEN3_HEADS, {"cp_comm_type": "all_gather"}),
    # bf16 weights (float32 main parameters and gradients; attention blocks accumulate in float32)
    "gpt_bf16_p2p": ({"params_dtype": "bfloat16"}, {"cp_comm_type": "p2p"}),
}
#: variants whose initial model is also evaluated (forward only, eval mode) on a held-out batch
EVALUATED = ("gpt_p2p", "llama_all_gather")
#: (layout, variant) whose steps also count the host synchronisations a GPU would make
SYNC_COUNTED = {((1, 2, 1, 1), "llama_dropout_full_p2p"), ((2, 2, 1, 1), "gpt_sp_dropout_all_gather")}


def variants(tp: int, cp: int, pp: int, dp: int) -> list[str]:
    """The variants one layout runs: each model with each comm type everywhere (the GPT with p2p and
    the Llama-like model with all_gather plainly; the other two pairings with dropout and selective
    or full recompute at dp = 1, plainly at dp > 1); sequence parallelism at tp = 2; bf16 at
    (1,2,1,1); the interleaved and GPipe schedules at (1,2,2,1); Qwen3's heads at (1,2,1,1) and
    (2,2,1,1)."""
    names = ["gpt_p2p", "llama_all_gather"]
    if dp == 1:
        names += ["gpt_dropout_selective_all_gather", "llama_dropout_full_p2p"]
    else:
        names += ["gpt_all_gather", "llama_p2p"]
    if tp > 1:
        names += ["gpt_sp_dropout_all_gather", "llama_sp_selective_p2p"]
    if (tp, cp, pp, dp) == (1, 2, 1, 1):
        names += ["gpt_bf16_p2p", "qwen3_p2p"]
    if (tp, cp, pp, dp) == (2, 2, 1, 1):
        names += ["qwen3_all_gather"]
    if (tp, cp, pp, dp) == (1, 2, 2, 1):
        names += ["gpt_interleaved_all_gather", "llama_gpipe_p2p"]
    return names


def cp_config(name: str, tp: int, cp: int, pp: int, dp: int) -> Config:
    """The tiny model of ``name`` at this layout: 2 layers, h 32, 4 heads, s 16, b 2, B 4 (1-2
    microbatches per pipeline), float64, clipping active. At tp = cp = pp = dp = 1 (the reference)
    the parallel overrides are dropped: the same model in one process."""
    model_overrides, parallel_overrides = VARIANTS[name]
    model = dataclasses.replace(
        ModelConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            ffn_hidden_size=64,
            seq_length=16,
            vocab_size=VOCAB,
            make_vocab_size_divisible_by=8,
            params_dtype="float64",
        ),
        **model_overrides,
    )
    train = TrainConfig(
        micro_batch_size=2,
        global_batch_size=4,
        train_iters=3,
        lr=3e-3,
        min_lr=3e-4,
        lr_warmup_iters=1,
        clip_grad=0.05,
        weight_decay=0.1,
    )
    parallel = dict(parallel_overrides) if tp * cp * pp * dp > 1 else {}
    if tp == 1:
        parallel.pop("sequence_parallel", None)
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        context_parallel_size=cp,
        **parallel,
    )
    return resolve(Config(model=model, parallel=par, train=train), tp * cp * pp * dp)


def cp_worker(rank: int, world: int) -> dict:
    """Every layout of this world size, each of its variants in turn: ``{layout: {variant: result}}``
    (with the first step's communication counts, ``"comm"``)."""
    out = {}
    for tp, cp, pp, dp in LAYOUTS[world]:
        groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT)
        runs = {}
        for name in variants(tp, cp, pp, dp):
            cfg = cp_config(name, tp, cp, pp, dp)
            res = train_and_collect(cfg, groups, record_comm_step=0)
            res["cp_rank"] = groups.cp.rank
            if name in EVALUATED:
                res["eval"] = evaluate_initial(cfg, groups)
            if ((tp, cp, pp, dp), name) in SYNC_COUNTED:
                res["syncs"] = step_syncs(cfg, groups)
            runs[name] = res
        out[(tp, cp, pp, dp)] = runs
    return out


@functools.cache
def world_results(world: int) -> list[dict]:
    """Every rank's results of the layouts of ``world`` (one job on the session's workers; cached)."""
    return run_in_pool(cp_worker, world)


def evaluate_initial(cfg: Config, groups: ParallelGroups) -> float:
    """The initial model's evaluation loss on a held-out global batch (the pipeline's forward-only
    schedule, eval mode)."""
    stage = build_stage(cfg, groups)
    return eval_loss(stage, [rank_microbatches(100, cfg, groups.dp.rank, groups.dp.size)])


def step_syncs(cfg: Config, groups: ParallelGroups, steps: int = 2) -> list[list[str]]:
    """The calls of each of ``steps`` training steps that would synchronise the host on a GPU
    (:mod:`helpers.host_sync`; the label check takes its device path); the results are read after."""
    stage, pending, calls = build_stage(cfg, groups), [], []
    with label_check_on_device():
        for step in range(steps):
            microbatches = rank_microbatches(step, cfg, groups.dp.rank, groups.dp.size)
            with count_host_syncs() as counted:
                pending.append(train_step(stage, microbatches, step))
            calls.append(counted.calls)
    read_results(pending)
    return calls


@functools.cache
def reference(name: str) -> dict:
    """The single-process run of variant ``name``."""
    cfg, groups = cp_config(name, 1, 1, 1, 1), ParallelGroups.single_process()
    res = train_and_collect(cfg, groups)
    if name in EVALUATED:
        res["eval"] = evaluate_initial(cfg, groups)
    return res
