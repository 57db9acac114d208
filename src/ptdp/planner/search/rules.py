"""Why a layout cannot run: the rules of ``ptdp train``'s config plus the planner's own.

Each broken rule is a :class:`~ptdp.errors.Violation` with a short ``rule`` key (for grouping in
reports) and a message naming the numbers, e.g. ``tp=16 crosses nodes (8 GPUs per node)``.
"""

from __future__ import annotations

import functools

from ptdp.config.axis_rules import (
    context_parallel_model_violations,
    context_parallel_violations,
    sequence_parallel_violations,
)
from ptdp.config.fields import CP_COMM_TYPES, SHARDING_STRATEGIES
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.rules import layout_violations, schedule_violations
from ptdp.errors import Violation
from ptdp.planner.candidate import PRECISIONS, RECOMPUTE, Candidate
from ptdp.planner.inputs.hardware import Cluster
from ptdp.planner.splits import accounting_of


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


def schedule_rejections(model: ModelConfig, layout: Candidate) -> list[Violation]:
    """Rules of the interleaved schedule, of sequence parallelism and of the option values."""
    out = []
    v, pp, m = layout.virtual_stages, layout.pp, layout.num_microbatches
    counted = accounting_of(layout.layer_split, v) if v > 1 and layout.layer_split is not None else None
    if v > 1 and layout.layer_split is not None and counted is None:
        out.append(
            Violation(
                "interleaving",
                f"layers per rank {','.join(map(str, layout.layer_split))} at v={v}: ptdp's interleaved "
                f"schedule splits the layers evenly over pp*v model chunks, with the "
                f"embedding and/or loss counted as layers at most",
            )
        )
    elif counted is not None:  # the schedule's rules for the units per chunk, as ptdp train checks them
        per_chunk = (model.num_layers + sum(counted)) // (pp * v)
        parallel = ParallelConfig(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=pp,
            data_parallel_size=layout.dp,
            pipeline_schedule="interleaved-1f1b",
            num_layers_per_virtual_pipeline_stage=per_chunk,
            account_for_embedding_in_pipeline_split=counted[0],
            account_for_loss_in_pipeline_split=counted[1],
        )
        out += [Violation("interleaving", v.message) for v in schedule_violations(parallel, model.num_layers, m)]
    elif v > 1:
        if model.num_layers % (pp * v):
            out.append(
                Violation(
                    "interleaving", f"num_layers={model.num_layers} is not divisible by pp*v = {pp}*{v} = {pp * v}"
                )
            )
        else:  # the interleaved schedule's own rules, as ptdp train checks them
            parallel = ParallelConfig(
                tensor_model_parallel_size=layout.tp,
                pipeline_model_parallel_size=pp,
                data_parallel_size=layout.dp,
                pipeline_schedule="interleaved-1f1b",
                num_layers_per_virtual_pipeline_stage=model.num_layers // (pp * v),
            )
            out += [Violation("interleaving", v.message) for v in schedule_violations(parallel, model.num_layers, m)]
    out += sequence_parallel_violations(model, layout.tp, layout.parallel.sequence_parallel)
    # sequence parallelism inside each cp rank's s / cp positions
    out += context_parallel_model_violations(model, layout.cp, layout.tp, layout.parallel.sequence_parallel)
    if layout.recompute not in RECOMPUTE:
        out.append(Violation("option", f"recompute={layout.recompute!r} not in {RECOMPUTE}"))
    if layout.sharding_strategy not in SHARDING_STRATEGIES:
        out.append(Violation("option", f"sharding={layout.sharding_strategy!r} not in {SHARDING_STRATEGIES}"))
    if layout.parallel.cp_comm_type not in CP_COMM_TYPES:
        out.append(Violation("option", f"cp_comm_type={layout.parallel.cp_comm_type!r} not in {CP_COMM_TYPES}"))
    if layout.precision not in PRECISIONS:
        out.append(Violation("option", f"precision={layout.precision!r} not in {PRECISIONS}"))
    return out


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
    return out
