"""Why a layout cannot run: the rules of ``ptdp train``'s config plus the planner's own.

Each broken rule is a :class:`~ptdp.errors.Violation` with a short ``rule`` key (for grouping in
reports) and a message naming the numbers, e.g. ``tp=16 crosses nodes (8 GPUs per node)``.
"""

from __future__ import annotations

import functools

from ptdp.config.fields import CP_COMM_TYPES, SHARDING_STRATEGIES
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.rules.axes import (
    context_parallel_model_violations,
    context_parallel_violations,
    sequence_parallel_violations,
)
from ptdp.config.rules.layout import layout_violations, schedule_violations, untrained_schedule_violations
from ptdp.config.rules.moe import moe_violations
from ptdp.errors import Violation
from ptdp.planner.candidate import FP8_RECIPES, OP_SAC, PRECISIONS, RECOMPUTE, Candidate
from ptdp.planner.inputs.hardware import Cluster
from ptdp.planner.inputs.moe_model import MoEModel


@functools.lru_cache(maxsize=65536)
def structural_rejections(
    model: ModelConfig,
    tp: int,
    pp: int,
    dp: int,
    b: int,
    big_b: int,
    gpus_per_node: int,
    layer_split: tuple[int, ...] | None = None,
) -> tuple[Violation, ...]:
    """Rules on (tp, pp, dp, b) and an explicit pipeline layer split alone: ptdp's config rules,
    grouped-query heads, node boundary."""
    out = []
    for v in layout_violations(
        model, tp=tp, pp=pp, dp=dp, micro_batch_size=b, global_batch_size=big_b, split=layer_split
    ):  # the rules of ptdp train
        rule = "config" if v.rule == "option" else v.rule
        out.append(
            Violation(rule, v.message.replace("; give an explicit --pipeline-layer-split to split unevenly", ""))
        )
    out += kv_head_rejections(model, tp)
    if tp > gpus_per_node:
        out.append(
            Violation(
                "tp crosses nodes",
                f"tp={tp} crosses nodes ({gpus_per_node} GPUs per node); tensor parallelism needs NVLink",
            )
        )
    elif gpus_per_node % tp:
        out.append(
            Violation(
                "tp crosses nodes",
                f"tp={tp} does not divide the {gpus_per_node} GPUs of a node: "
                f"some tensor-parallel groups would span two nodes",
            )
        )
    return tuple(out)


def kv_head_rejections(model: ModelConfig, tp: int) -> list[Violation]:
    """Grouped-query attention splits whole key/value heads over tp: ``kv_heads % tp == 0``."""
    if model.num_query_groups is not None and model.kv_heads % tp != 0:
        return [
            Violation(
                "kv heads % tp",
                f"num_query_groups={model.kv_heads} is not divisible by tp={tp} (rule: key/value heads % tp == 0)",
            )
        ]
    return []


@functools.lru_cache(maxsize=4096)
def context_rejections(model: ModelConfig, tp: int, cp: int) -> tuple[Violation, ...]:
    """Rules of context parallelism (``ptdp.config``'s: ``cp >= 1``, ``seq_length % (2 cp) == 0``).
    A cp group may leave the node (``tp * cp > gpus_per_node``): allowed, its key/value ring then
    runs at network speed (:func:`ptdp.planner.time.cp_exchange.cp_link`)."""
    return tuple(context_parallel_violations(model.seq_length, cp))


def untrained_schedule_rejections(parallel: ParallelConfig, model: ModelConfig) -> list[Violation]:
    """What ``ptdp train`` refuses of a parallel config's pipeline schedule before it starts
    (:func:`ptdp.config.rules.layout.untrained_schedule_violations`, its own check)."""
    return [Violation("schedule", v.message) for v in untrained_schedule_violations(parallel, model.tied)]


@functools.lru_cache(maxsize=256)
def trains_schedule(kind: str, strategy: str, tied: bool) -> bool:
    """Whether ``ptdp train`` runs schedule ``kind`` under sharding ``strategy``: no
    :func:`untrained_schedule_rejections` of a config setting only these (the rule reads the
    schedule, the strategy and whether the model ties its embedding); cached for the search."""
    parallel = ParallelConfig(
        pipeline_schedule=kind,  # type: ignore[arg-type]
        data_parallel_sharding_strategy=strategy,  # type: ignore[arg-type]
        use_distributed_optimizer=strategy != "no_shard",
    )
    return not untrained_schedule_violations(parallel, tied)


def schedule_rejections(model: ModelConfig, layout: Candidate) -> list[Violation]:
    """Rules of the pipeline schedule (the config's, on the candidate's parallel config, and what
    ``ptdp train`` does not run yet: :func:`untrained_schedule_rejections`), of sequence
    parallelism and of the option values."""
    m = layout.num_microbatches
    out = [Violation("interleaving", v.message) for v in schedule_violations(layout.parallel, model.num_layers, m)]
    out += untrained_schedule_rejections(layout.parallel, model)
    out += sequence_parallel_violations(model, layout.tp, layout.parallel.sequence_parallel)
    # sequence parallelism inside each cp rank's s / cp positions
    out += context_parallel_model_violations(model, layout.cp, layout.tp, layout.parallel.sequence_parallel)
    if layout.recompute not in (*RECOMPUTE, OP_SAC):
        out.append(Violation("option", f"recompute={layout.recompute!r} not in {(*RECOMPUTE, OP_SAC)}"))
    if layout.sharding_strategy not in SHARDING_STRATEGIES:
        out.append(Violation("option", f"sharding={layout.sharding_strategy!r} not in {SHARDING_STRATEGIES}"))
    if layout.parallel.cp_comm_type not in CP_COMM_TYPES:
        out.append(Violation("option", f"cp_comm_type={layout.parallel.cp_comm_type!r} not in {CP_COMM_TYPES}"))
    if layout.precision not in PRECISIONS:
        out.append(Violation("option", f"precision={layout.precision!r} not in {PRECISIONS}"))
    if layout.fp8_recipe not in (None, *FP8_RECIPES):
        out.append(Violation("option", f"fp8_recipe={layout.fp8_recipe!r} not in {FP8_RECIPES}"))
    return out


@functools.lru_cache(maxsize=65536)
def expert_rejections(
    model: ModelConfig, tp: int, pp: int, world: int, ep: int, etp: int, sequence_parallel: bool, dispatcher: str
) -> tuple[Violation, ...]:
    """The mixture-of-experts rules of ``ptdp train`` (:func:`ptdp.config.rules.moe.moe_violations`:
    ``E % ep``, the expert grid ``etp x ep x pp`` dividing the world, ``F % etp``, sequence
    parallelism with tp > 1, ...) on the layout's ep and etp; a dense model refuses ep or etp > 1."""
    moe = model.moe if isinstance(model, MoEModel) else MoEConfig()
    return tuple(
        Violation("experts", v.message)
        for v in moe_violations(
            moe,
            num_layers=model.num_layers,
            ffn=model.ffn,
            tp=tp,
            pp=pp,
            ep=ep,
            etp=etp,
            world_size=world,
            sequence_parallel=sequence_parallel,
            dispatcher=dispatcher,
            linear_biases=model.add_bias_linear,
        )
    )


def all_rejections(model: ModelConfig, layout: Candidate, cluster: Cluster) -> list[Violation]:
    """Every rule ``layout`` breaks on ``cluster`` (memory excluded)."""
    out = []
    if layout.num_gpus != cluster.num_gpus:
        sizes = (
            (("tp", "pp", "dp"), (layout.tp, layout.pp, layout.dp))
            if layout.cp == 1
            else (("tp", "cp", "pp", "dp"), (layout.tp, layout.cp, layout.pp, layout.dp))
        )
        out.append(
            Violation(
                "gpus",
                f"{'*'.join(sizes[0])} = {'*'.join(map(str, sizes[1]))} = {layout.num_gpus} != {cluster.num_gpus} GPUs",
            )
        )
    out += structural_rejections(
        model,
        layout.tp,
        layout.pp,
        layout.dp,
        layout.micro_batch_size,
        layout.global_batch_size,
        cluster.gpus_per_node,
        layout.layer_split,
    )
    out += context_rejections(model, layout.tp, layout.cp)
    out += schedule_rejections(model, layout)
    p = layout.parallel
    out += expert_rejections(
        model, layout.tp, layout.pp, layout.num_gpus, p.ep, p.etp, p.sequence_parallel, p.moe_token_dispatcher_type
    )
    return out
