"""The sharded data-parallel cases (``--data-parallel-sharding-strategy``): the tiny float64 GPT
trained 3 steps at a (tp, pp, dp) layout, every layout of one world size in one job, against the
same model in one process without sharding."""

from __future__ import annotations

import dataclasses
import functools

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import LLAMA_OPTIONS, tiny_config, train_and_collect
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

#: (tp, pp, dp) by world size: one job per world size
LAYOUTS = {4: [(1, 1, 4), (2, 1, 2), (1, 2, 2)], 8: [(2, 2, 2), (1, 2, 4)]}


def _chunk_case(dtype: str, overlap: bool, global_batch: int | None) -> tuple:
    """An 8-layer interleaved variant (2 layers per chunk, 901-element buckets) that reduces chunk
    by chunk; ``global_batch`` None keeps the default batch."""
    parallel = {
        "pipeline_schedule": "interleaved-1f1b",
        "num_layers_per_virtual_pipeline_stage": 2,
        "ddp_bucket_size": 901,
        "overlap_grad_reduce": overlap,
    }
    return dtype, {"num_layers": 8}, parallel, ({} if global_batch is None else {"global_batch_size": global_batch})


#: name -> (dtype, model overrides, parallel overrides, train overrides). Every case accumulates
#: 2 (dp = 4) or 4 (dp = 2) microbatches of 1 sequence per step (the chunk-by-chunk cases 2 at
#: dp = 2 and 4), clipping at 0.05 fires.
VARIANTS = {
    # buckets of 901 elements: padded to a multiple of dp, several per stage, reduced when each
    # backward ends
    "grads": ("float64", {}, {"ddp_bucket_size": 901}, {}),
    # buckets reduced during every backward, parameters gathered by the next forward's pre-hooks
    "grads_overlap": (
        "float64",
        {},
        {"ddp_bucket_size": 1500, "overlap_grad_reduce": True, "overlap_param_gather": True},
        {},
    ),
    # an untied output layer, one bucket per stage (the default size)
    "grads_untied": ("float64", {"untie_embeddings_and_output_weights": True}, {}, {}),
    # interleaved 1F1B: 8 layers in 2 chunks per pipeline rank
    "grads_interleaved": (
        "float64",
        {"num_layers": 8},
        {"pipeline_schedule": "interleaved-1f1b", "num_layers_per_virtual_pipeline_stage": 2, "ddp_bucket_size": 901},
        {},
    ),
    # the Llama-like model with full recompute of every layer and sequence parallelism (the tp sum
    # of the norms' gradients acts on the shards), reduced during backward
    "grads_sp": (
        "float64",
        LLAMA_OPTIONS | {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"ddp_bucket_size": 1500, "overlap_grad_reduce": True, "sequence_parallel": True},
        {},
    ),
    # bf16 weights: float32 main gradients written by the layers (main_grad), float32 shards
    "grads_bf16": ("bfloat16", {}, {"ddp_bucket_size": 901, "overlap_grad_reduce": True}, {}),
    # optim_grads_params (ZeRO-3): parameters kept as shards, gathered unit by unit. Units cut
    # into 901-element buckets, reduced when each backward ends, gathered again for backward
    "params": ("float64", {}, {"ddp_bucket_size": 901}, {}),
    # gathered parameters kept from forward to backward (--no-reshard-after-forward), selective
    # recompute (the attention core again in backward), reduced during backward
    "params_keep": (
        "float64",
        {"recompute_granularity": "selective"},
        {"ddp_bucket_size": 1500, "overlap_grad_reduce": True, "reshard_after_forward": False},
        {},
    ),
    # the Llama-like model, full recompute of every layer (its forward again inside backward
    # reads the gathered unit) and sequence parallelism
    "params_sp": (
        "float64",
        LLAMA_OPTIONS | {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"ddp_bucket_size": 1500, "overlap_grad_reduce": True, "sequence_parallel": True},
        {},
    ),
    "params_interleaved": (
        "float64",
        {"num_layers": 8},
        {"pipeline_schedule": "interleaved-1f1b", "num_layers_per_virtual_pipeline_stage": 2, "ddp_bucket_size": 901},
        {},
    ),
    # bf16 weights gathered, float32 main-parameter and gradient shards
    "params_bf16": ("bfloat16", {}, {"ddp_bucket_size": 901, "overlap_grad_reduce": True}, {}),
    # buckets of one layer's size at tp 1 (8,544 elements), reduced when each backward ends
    # (--no-overlap-grad-reduce: a backward holds all its buckets at its end)
    "grads_sync": ("float64", {}, {"ddp_bucket_size": 8544, "overlap_grad_reduce": False}, {}),
    "params_sync": ("float64", {}, {"ddp_bucket_size": 8544, "overlap_grad_reduce": False}, {}),
    # interleaved, one bucket per chunk (the default size), reduced when each backward ends: the
    # last backward of a chunk keeps its buckets through the next chunk's backward
    "grads_interleaved_sync": (
        "float64",
        {"num_layers": 8},
        {
            "pipeline_schedule": "interleaved-1f1b",
            "num_layers_per_virtual_pipeline_stage": 2,
            "overlap_grad_reduce": False,
        },
        {},
    ),
    # chunk by chunk (ptdp.layout.buckets.chunk_by_chunk): interleaved with m == pp = 2
    # microbatches per step (dp 2), each chunk's buckets accumulated over its 2 backwards and
    # reduce-scattered once, during its last backward (overlap) or when it ends (``_sync``); the
    # ``_b8`` ones over 4 ranks: 8 sequences per step, m == pp = 2 at dp 4
    **{
        name: _chunk_case(dtype, overlap, batch)
        for name, dtype, overlap, batch in (
            ("grads_chunk", "float64", True, 4),
            ("grads_chunk_sync", "float64", False, 4),
            ("grads_chunk_bf16", "bfloat16", True, 4),
            ("params_chunk", "float64", True, 4),
            ("params_chunk_sync", "float64", False, 4),
            ("grads_chunk_b8", "float64", True, None),
            ("params_chunk_b8", "float64", False, None),
        )
    },
}

#: the variants trained with optim_grads_params (the others with optim_grads)
PARAMS_VARIANTS = (
    "params",
    "params_keep",
    "params_sp",
    "params_interleaved",
    "params_bf16",
    "params_sync",
    "params_chunk",
    "params_chunk_sync",
    "params_chunk_b8",
)

#: the variants whose gradients are reduced chunk by chunk (each chunk once per step)
CHUNK_VARIANTS = (
    "grads_chunk",
    "grads_chunk_sync",
    "grads_chunk_bf16",
    "params_chunk",
    "params_chunk_sync",
    "grads_chunk_b8",
    "params_chunk_b8",
)


#: the variants each layout runs (kept few: every run costs seconds on a 2-core machine); every
#: layout runs a float64 case with 2-4 accumulated microbatches
RUNS = {
    (1, 1, 4): ["grads", "grads_overlap", "grads_bf16", "params", "params_keep", "grads_sync"],
    (2, 1, 2): ["grads_sp", "params_sp"],
    (1, 2, 2): [
        "grads",
        "grads_untied",
        "grads_interleaved",
        "params_interleaved",
        "params_keep",
        "grads_interleaved_sync",
        "grads_chunk_sync",
        "grads_chunk_bf16",
        "params_chunk",
    ],
    (2, 2, 2): [
        "grads_overlap",
        "grads_bf16",
        "params",
        "params_bf16",
        "params_sync",
        "grads_chunk",
        "params_chunk_sync",
    ],
    (1, 2, 4): ["grads_chunk_b8", "params_chunk_b8"],
}


def variants(tp: int, pp: int, dp: int, strategy: str | None = None) -> list[str]:
    """The variants layout (tp, pp, dp) runs (:data:`RUNS`), those of ``strategy`` only if given."""
    return [name for name in RUNS[(tp, pp, dp)] if strategy is None or strategy_of(name) == strategy]


def strategy_of(name: str) -> str:
    """The sharding strategy variant ``name`` trains with."""
    return "optim_grads_params" if name in PARAMS_VARIANTS else "optim_grads"


def zero_config(name: str, tp: int, pp: int, dp: int, strategy: str | None = None) -> Config:
    """Variant ``name`` at this layout with ``strategy`` (default: the variant's own,
    :func:`strategy_of`); at tp = pp = dp = 1 (the reference) the same model in one process with
    no sharding and no pipeline options."""
    strategy = strategy or strategy_of(name)
    dtype, model, parallel, train = VARIANTS[name]
    parallel = dict(parallel)
    if tp == 1:
        parallel.pop("sequence_parallel", None)
    if pp == 1:
        parallel.pop("pipeline_schedule", None)
        parallel.pop("num_layers_per_virtual_pipeline_stage", None)
    if tp * pp * dp == 1:
        parallel, strategy = {}, "no_shard"
    parallel["data_parallel_sharding_strategy"] = strategy
    train = {"micro_batch_size": 1} | train
    return tiny_config(tp, pp, dp, dtype, train_overrides=train, parallel_overrides=parallel, **model)


def planner_transients(cfg: Config, pp_rank: int) -> tuple[int, int]:
    """The planner's (gathered parameter, gradient bucket) elements at their peaks on a rank of
    pipeline stage ``pp_rank`` of run ``cfg`` (:func:`ptdp.planner.memory.transients.rank_transients`)."""
    from ptdp.layout.buckets import chunk_by_chunk, chunk_rounds
    from ptdp.planner.memory.chunk_params import stage_chunks
    from ptdp.planner.memory.strategies import DEFAULT_BUCKET_ELEMENTS
    from ptdp.planner.memory.transients import rank_transients

    m, p = cfg.model, cfg.parallel
    layers = cfg.pipeline.stage_layers[pp_rank]
    v, microbatches = cfg.pipeline.virtual_stages, cfg.train.global_batch_size // (cfg.train.micro_batch_size * p.dp)
    return rank_transients(
        m,
        p.tp,
        p.pp,
        stage_chunks(m.num_layers, p.pp, v, pp_rank, layers),
        p.dp * p.cp,
        p.ddp_bucket_size or DEFAULT_BUCKET_ELEMENTS,
        overlap=p.overlap_grad_reduce,
        params_sharded=p.sharding_strategy == "optim_grads_params",
        reshard=p.reshard_after_forward,
        divisible_by=m.make_vocab_size_divisible_by,
        by_chunk=chunk_by_chunk(p.sharding_strategy, p.dp * p.cp, v, microbatches, p.pp),
        main_grad=m.params_dtype in ("bfloat16", "float16"),
        rounds=chunk_rounds(microbatches, p.pp),
    )


def planner_gathers(cfg: Config, pp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The planner's parameter all-gathers of one microbatch, (calls, elements) in forward and in
    backward, on a rank of pipeline stage ``pp_rank`` of run ``cfg`` (optim_grads_params,
    :func:`ptdp.planner.memory.transients.unit_gathers`)."""
    from ptdp.planner.memory.chunk_params import stage_chunks
    from ptdp.planner.memory.strategies import DEFAULT_BUCKET_ELEMENTS
    from ptdp.planner.memory.transients import unit_gathers

    m, p = cfg.model, cfg.parallel
    layers = cfg.pipeline.stage_layers[pp_rank]
    return unit_gathers(
        m,
        p.tp,
        p.pp,
        stage_chunks(m.num_layers, p.pp, cfg.pipeline.virtual_stages, pp_rank, layers),
        p.dp * p.cp,
        p.ddp_bucket_size or DEFAULT_BUCKET_ELEMENTS,
        divisible_by=m.make_vocab_size_divisible_by,
    )


def check_transients(results: list[dict], name: str, cfg: Config) -> None:
    """Every rank's measured peaks of variant ``name`` (``GradBuffer.peak_live_bytes``,
    ``ParamUnits.peak_live_bytes``) equal the planner's elements times the element size
    (gradients: float64, or float32 main gradients for bf16; parameters: the weights' dtype)."""
    bf16 = cfg.model.params_dtype == "bfloat16"
    grad_size, param_size = (4, 2) if bf16 else (8, 8)
    for res in results:
        m, pp_rank = res[name]["measured"], res[name]["coords"][2]
        params, grads = planner_transients(cfg, pp_rank)
        assert grads > 0 and m["grads_transient"] == grad_size * grads, (name, pp_rank, m, grads)
        assert m["params_transient"] == param_size * params, (name, pp_rank, m, params)


#: context parallelism (world 4): (tp, cp, pp, dp) and its variants (optim_grads, optim_grads_params);
#: the shards are over dp x cp
CP_LAYOUT, CP_VARIANT, CP_PARAMS_VARIANT = (1, 2, 1, 2), "grads_overlap", "params"


def cp_config(name: str) -> Config:
    """Variant ``name`` at :data:`CP_LAYOUT`: gradients summed over cp, averaged over dp."""
    tp, cp, pp, dp = CP_LAYOUT
    cfg = zero_config(name, tp, pp, dp)
    return resolve(
        dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_parallel_size=cp)),
        tp * cp * pp * dp,
    )


def zero_worker(rank: int, world: int) -> dict:
    """Every layout of this world size, each of its variants in turn: ``{layout: {variant: result}}``
    (the first variant's communication of step 0 recorded); at world 4 also :data:`CP_LAYOUT`."""
    out = {}
    for tp, pp, dp in LAYOUTS[world]:
        groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), PG_TIMEOUT)
        out[(tp, pp, dp)] = {name: collect(zero_config(name, tp, pp, dp), groups) for name in variants(tp, pp, dp)}
    if world == 4:
        tp, cp, pp, dp = CP_LAYOUT
        groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT)
        out[CP_LAYOUT] = {
            name: train_and_collect(cp_config(name), groups, 0) for name in (CP_VARIANT, CP_PARAMS_VARIANT)
        }
    if world == 8:
        groups = ParallelGroups.build(ParallelLayout(tp=2, pp=2, dp=2), PG_TIMEOUT)
        out["eval"] = {name: eval_case(zero_config(name, 2, 2, 2), groups) for name in EVAL_VARIANTS}
    return out


def collect(cfg: Config, groups: ParallelGroups) -> dict:
    """:func:`train_and_collect` (step 0's communication recorded) and, for a run reducing chunk
    by chunk, its stage's buckets as ``(chunk, padded elements)`` in bucket order (``buckets``)
    and the calls of a second first step (on a new stage) that would synchronise the host on a
    GPU (``syncs``, :mod:`helpers.host_sync`)."""
    out = train_and_collect(cfg, groups, 0)
    if is_chunk_by_chunk(cfg):
        from helpers.host_sync import count_host_syncs, label_check_on_device
        from helpers.layout_cases import rank_microbatches
        from ptdp.engine.stage import build_stage
        from ptdp.engine.step import train_step

        stage = build_stage(cfg, groups)
        out["buckets"] = [(b.chunk, b.numel) for b in stage.grads.buckets]
        microbatches = rank_microbatches(0, cfg, groups.dp.rank, groups.dp.size)
        with label_check_on_device(), count_host_syncs() as counted:
            train_step(stage, microbatches, 0)
        out["syncs"] = counted.calls
    return out


def is_chunk_by_chunk(cfg: Config) -> bool:
    """Whether run ``cfg`` reduces its gradients chunk by chunk (:func:`ptdp.layout.buckets.chunk_by_chunk`)."""
    from ptdp.layout.buckets import chunk_by_chunk

    p = cfg.parallel
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * p.dp)
    return chunk_by_chunk(p.sharding_strategy, p.dp * p.cp, cfg.pipeline.virtual_stages, m, p.pp)


#: optim_grads_params variants whose evaluation is checked at (2,2,2) (world 8)
EVAL_VARIANTS = ("params", "params_keep")


def eval_case(cfg: Config, groups: ParallelGroups) -> tuple[float, float]:
    """``eval_loss`` over two global batches before and after one training step."""
    from helpers.layout_cases import rank_microbatches
    from ptdp.engine.stage import build_stage
    from ptdp.engine.step import eval_loss, train_step

    stage = build_stage(cfg, groups)
    dp_rank, dp = groups.dp.rank, groups.dp.size
    batches = [rank_microbatches(10 + i, cfg, dp_rank, dp) for i in range(2)]
    before = eval_loss(stage, batches)
    train_step(stage, rank_microbatches(0, cfg, dp_rank, dp), 0).result()
    return before, eval_loss(stage, batches)


@functools.cache
def eval_reference(name: str) -> tuple[float, float]:
    """:func:`eval_case` of variant ``name`` in one process without sharding."""
    return eval_case(zero_config(name, 1, 1, 1), ParallelGroups.single_process())


@functools.cache
def world_results(world: int) -> list[dict]:
    """Every rank's results of the layouts of ``world`` (one job on the session's workers; cached)."""
    return run_in_pool(zero_worker, world)


@functools.cache
def reference(name: str) -> dict:
    """The single-process, unsharded run of variant ``name``."""
    return train_and_collect(zero_config(name, 1, 1, 1), ParallelGroups.single_process())


def with_strategy(cfg: Config, strategy: str) -> Config:
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, data_parallel_sharding_strategy=strategy)
    )


def full_state(stage, groups: ParallelGroups) -> dict:
    """Global parameters and Adam moments of this rank's stage, gathered over tp (every dp rank
    gets the whole of each; keys ``kind/name``)."""
    import torch

    from ptdp.engine.model.model_chunks import global_named_parameters
    from ptdp.engine.tensor_parallel.sharding import global_param, unshard
    from ptdp.run.checkpoint.optim_state import gather_local_state

    stage.wait_for_params()
    params = list(global_named_parameters(stage.model))
    moments = gather_local_state(stage.optimizer, [p for _, p in params], groups.dp_cp)
    out = {}
    for name, p in params:
        for kind, local in [("param", p.detach()), *moments[id(p)].items()]:
            shards = [local]
            if groups.tp.size > 1:
                shards = [torch.empty_like(local) for _ in range(groups.tp.size)]
                torch.distributed.all_gather(shards, local.contiguous(), group=groups.tp.group)
            full = unshard(shards, global_param(p))
            real = global_param(p).real_rows
            out[f"{kind}/{name}"] = full[:real] if real is not None else full
    return out


#: the checkpoint round trips (world 4), by name: saved with optim_grads (optim_grads_params) at
#: dp 4, loaded at dp 2 with no_shard (tp 2), saved again there, loaded at dp 4 with the first
#: strategy (another bucket size)
ROUND_TRIPS = {
    "optim_grads": [((1, 1, 4), "optim_grads", 901), ((2, 1, 2), "no_shard", None), ((1, 1, 4), "optim_grads", 1500)],
    "optim_grads_params": [
        ((1, 1, 4), "optim_grads_params", 901),
        ((2, 1, 2), "no_shard", None),
        ((1, 1, 4), "optim_grads_params", 1500),
    ],
}


def checkpoint_worker(rank: int, world: int, root: str) -> dict:
    """Every trip of :data:`ROUND_TRIPS`: ``{name: result}`` (:func:`round_trip`)."""
    return {name: round_trip(trip, f"{root}/{name}") for name, trip in ROUND_TRIPS.items()}


def round_trip(trip: list, root: str) -> dict:
    """Train 2 steps at the first layout of ``trip`` and save; load at each next layout (saving
    again after loading); the last layout then trains a third step, as the first one does without
    stopping. Returns each layout's state after loading and both third steps' losses."""
    from helpers.checkpoints import train_steps
    from ptdp.engine.stage import build_stage
    from ptdp.run.checkpoint.io import load_checkpoint, save_checkpoint

    def stage_at(layout, strategy, bucket):
        parallel = {"data_parallel_sharding_strategy": strategy, "ddp_bucket_size": bucket}
        cfg = tiny_config(*layout, "float64", train_overrides={"micro_batch_size": 1}, parallel_overrides=parallel)
        groups = ParallelGroups.build(ParallelLayout(tp=layout[0], pp=layout[1], dp=layout[2]), PG_TIMEOUT)
        return build_stage(cfg, groups), cfg, groups

    first, cfg, groups = stage_at(*trip[0])
    train_steps(first, cfg, groups, 0, 2)
    folder = save_checkpoint(first, f"{root}/0", 2, consumed_samples=2 * cfg.train.global_batch_size)
    states = [full_state(first, groups)]
    for i, case in enumerate(trip[1:], start=1):
        stage, cfg, groups = stage_at(*case)
        load_checkpoint(stage, folder)
        states.append(full_state(stage, groups))
        folder = save_checkpoint(stage, f"{root}/{i}", 2, consumed_samples=2 * cfg.train.global_batch_size)
    resumed = [r.loss for r in train_steps(stage, cfg, groups, 2, 3)]
    whole = [r.loss for r in train_steps(first, cfg, groups, 2, 3)]
    return {"states": states, "resumed": resumed, "whole": whole}


def check_against_reference(results: list[dict], name: str) -> None:
    """Every rank's run of variant ``name`` (``results``: one dict per rank, ``{name: run}``)
    against one process without sharding: float64 losses, norms and final parameters within 1e-9
    (clipping firing), bf16 within bf16 precision; replicas and tied copies bitwise equal."""
    import torch

    from helpers.layout_cases import full_parameters
    from helpers.moe_cases import check_like_one_process

    ref = reference(name)
    if VARIANTS[name][0] == "bfloat16":  # rounding differs with the summation order: bf16 precision
        for res in results:
            torch.testing.assert_close(
                torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0
            )
            torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), rtol=5e-2, atol=0)
        full_parameters(results, name)  # replicas and tied copies bitwise equal
        return
    check_like_one_process(results, name, ref, full_parameters(results, name))


#: the strategies the float16 overflow case runs (one job)
FP16_STRATEGIES = ("optim_grads", "optim_grads_params")


def fp16_worker(rank: int, world: int) -> dict:
    """:func:`fp16_case` with each of :data:`FP16_STRATEGIES`: ``{strategy: result}``."""
    return {strategy: fp16_case(strategy) for strategy in FP16_STRATEGIES}


def fp16_case(strategy: str) -> dict:
    """float16 with ``strategy`` at (1,1,4), 2 microbatches per step: an inf put into rank 3's
    gradient shard after the reduction (before unscaling) at step 0, then a good step counted for
    host synchronisations (:mod:`helpers.host_sync`)."""
    import torch

    import ptdp.engine.step as step_module
    from helpers.host_sync import count_host_syncs, label_check_on_device
    from helpers.layout_cases import rank_microbatches
    from ptdp.engine.stage import build_stage

    cfg = tiny_config(
        1,
        1,
        4,
        "float16",
        train_overrides={"micro_batch_size": 1},
        parallel_overrides={
            "data_parallel_sharding_strategy": strategy,
            "ddp_bucket_size": 901,
            "overlap_grad_reduce": True,
        },
    )
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=4), PG_TIMEOUT)
    stage = build_stage(cfg, groups)
    original = step_module.finalize_grads

    def poisoned(model, buffer, g):
        original(model, buffer, g)
        if g.global_rank == 3:
            buffer.shard_grads[5] = float("inf")

    stage.wait_for_params()
    before = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    scale_before = stage.scaler.scale.item()
    step_module.finalize_grads = poisoned
    try:
        bad = step_module.train_step(stage, rank_microbatches(0, cfg, groups.dp.rank, groups.dp.size), 0)
    finally:
        step_module.finalize_grads = original
    stage.wait_for_params()
    unchanged = all(torch.equal(before[n], p) for n, p in stage.model.named_parameters())
    scale_after = stage.scaler.scale.item()
    with label_check_on_device(), count_host_syncs() as counted:
        good = step_module.train_step(stage, rank_microbatches(1, cfg, groups.dp.rank, groups.dp.size), 1)
    stage.wait_for_params()
    changed = any(not torch.equal(before[n], p) for n, p in stage.model.named_parameters())
    return {
        "skipped": bad.skipped,
        "reason": bad.skip_reason,
        "used": bad.loss_scale,
        "unchanged": unchanged,
        "scales": (scale_before, scale_after),
        "good_skipped": good.skipped,
        "good_used": good.loss_scale,
        "changed_after_good": changed,
        "syncs": counted.calls,
        "loss": good.loss,
    }
