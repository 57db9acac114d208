"""Checks of a ``ptdp plan`` request before any search: every number the user gave must be usable,
and the fixed choices must be able to fill the cluster. Raises ``ConfigError`` naming the values."""

from __future__ import annotations

import math
import os
from pathlib import Path

from ptdp.config import fields
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.rules.layout import schedule_violations
from ptdp.config.rules.shape import heads_violations, llama_option_violations
from ptdp.errors import ConfigError
from ptdp.layout.pipeline.partition import layer_split
from ptdp.layout.pipeline.schedule import SPLIT_ORDERS
from ptdp.planner.inputs.hardware import Cluster
from ptdp.planner.search.layouts import Fixed
from ptdp.planner.search.rules import context_rejections, kv_head_rejections
from ptdp.planner.splits import ACCOUNTING


def check_model(model: ModelConfig) -> None:
    errors = [
        f"{name}={value} must be a positive integer"
        for name, value in (
            ("num_layers", model.num_layers),
            ("hidden_size", model.hidden_size),
            ("num_attention_heads", model.num_attention_heads),
            ("ffn_hidden_size", model.ffn),
            ("vocab_size", model.vocab_size),
            ("seq_length", model.seq_length),
            ("num_query_groups", model.kv_heads),
        )
        if not isinstance(value, int) or value < 1
    ]
    if not errors:
        errors += [v.message for v in llama_option_violations(model, 1)]  # ptdp train's head-size rules
        if model.hidden_size % model.num_attention_heads and model.kv_channels is None:
            errors.append(
                f"hidden_size={model.hidden_size} is not divisible by num_attention_heads={model.num_attention_heads}"
            )
        if model.num_attention_heads % model.kv_heads:
            errors.append(
                f"num_attention_heads={model.num_attention_heads} is not divisible by "
                f"num_query_groups={model.kv_heads} (each key/value head serves a whole group)"
            )
    if errors:
        raise ConfigError("invalid model:\n  " + "\n  ".join(errors))


#: the largest cluster and global batch a search takes (beyond them the layouts to enumerate grow
#: with the divisors of numbers no run has)
MAX_GPUS = 1 << 20
MAX_GLOBAL_BATCH = 1 << 24


def check_request(
    cluster: Cluster, global_batch_size: int, fixed: Fixed, *, top: int, overhead_bytes: float | None
) -> None:
    """Positive sizes, and fixed tp/cp/pp/dp that can make up the cluster's GPU count."""
    n = cluster.num_gpus
    cp = fixed.cp
    given = {
        "global_batch_size": global_batch_size,
        "top": top,
        "tp": fixed.tp,
        "cp": cp,
        "pp": fixed.pp,
        "dp": fixed.dp,
        "micro_batch_size": fixed.micro_batch_size,
        "virtual_pipeline_stages": fixed.virtual_pipeline_model_parallel_size,
        "num_layers_per_virtual_pipeline_stage": fixed.num_layers_per_virtual_pipeline_stage,
        "ddp_bucket_size": fixed.ddp_bucket_size,
    }
    given["expert_model_parallel_size"] = fixed.expert_model_parallel_size
    given["expert_tensor_parallel_size"] = fixed.expert_tensor_parallel_size
    errors = [
        f"{name}={value} must be a positive integer" for name, value in given.items() if value is not None and value < 1
    ]
    if n > MAX_GPUS:
        errors.append(f"--gpus {n:,} is more than ptdp plan searches (at most {MAX_GPUS:,} GPUs)")
    if global_batch_size > MAX_GLOBAL_BATCH:
        errors.append(
            f"--global-batch-size {global_batch_size:,} is more than ptdp plan searches (at most {MAX_GLOBAL_BATCH:,})"
        )
    if overhead_bytes is not None and not (math.isfinite(overhead_bytes) and overhead_bytes >= 0):
        errors.append(f"memory overhead {overhead_bytes / 2**30:g} GiB must be a finite number >= 0")
    split = fixed.pipeline_layer_split
    if split is not None and fixed.pp is not None and fixed.pp != len(split):
        errors.append(f"--pipeline-layer-split {','.join(map(str, split))} has {len(split)} stages but --pp {fixed.pp}")
    if split is not None and fixed.interleaved:
        errors.append(
            "--pipeline-layer-split cannot be combined with virtual pipeline stages (--virtual-pipeline-stages, "
            "--num-layers-per-virtual-pipeline-stage)"
        )
    if not errors:
        product = 1
        pp = len(split) if split is not None else fixed.pp
        for value in (fixed.tp, cp, pp, fixed.dp):
            if value is not None:
                product *= value
        rule = "tp * pp * dp = GPUs" if cp in (None, 1) else "tp * cp * pp * dp = GPUs"
        if n % product:
            sizes = {"tp": fixed.tp, "cp": cp, "pp": pp, "dp": fixed.dp}
            parts = [f"{k}={v}" for k, v in sizes.items() if v]
            text = " * ".join(parts) + (f" = {product}" if len(parts) > 1 else "")
            errors.append(f"{text} does not divide the {n} GPUs (rule: {rule})")
        elif None not in (fixed.tp, pp, fixed.dp) and cp in (None, 1) and product != n:
            errors.append(
                f"tp*pp*dp = {fixed.tp}*{pp}*{fixed.dp} = {product} != {n} GPUs"
                + (" (with context parallelism give --cp: tp*cp*pp*dp = GPUs)" if cp is None else "")
            )
        elif None not in (fixed.tp, cp, pp, fixed.dp) and product != n:
            errors.append(f"tp*cp*pp*dp = {fixed.tp}*{cp}*{pp}*{fixed.dp} = {product} != {n} GPUs")
    if errors:
        raise ConfigError("invalid plan request:\n  " + "\n  ".join(errors))


def check_stage_layers(num_layers: int, fixed: Fixed) -> None:
    """Fixed first/last pipeline stage layer counts (``--decoder-first/last-pipeline-num-layers``):
    not with ``--pipeline-layer-split`` nor interleaving, each >= 1, and with a fixed pp they must
    split ``num_layers`` (:func:`ptdp.config.first_last_split`). Raises ``ConfigError`` naming them."""
    first, last = fixed.decoder_first_pipeline_num_layers, fixed.decoder_last_pipeline_num_layers
    counted = fixed.accounting
    if counted is not None and any(counted):
        _check_accounting(num_layers, fixed, counted)
    if first is None and last is None:
        return
    given = " / ".join(
        f"decoder_{k}_pipeline_num_layers={n}" for k, n in (("first", first), ("last", last)) if n is not None
    )
    if fixed.interleaved:
        raise ConfigError(
            f"invalid plan request:\n  {given} cannot be combined with virtual pipeline stages (ptdp's "
            f"interleaved schedule gives every model chunk num_layers / (pp * v) layers)"
        )
    pp = len(fixed.pipeline_layer_split) if fixed.pipeline_layer_split is not None else fixed.pp
    try:
        if pp is not None:  # given, or the split's length
            layer_split(num_layers, pp, fixed.pipeline_layer_split, first, last)
        elif any(n is not None and n < 1 for n in (first, last)):
            raise ConfigError(f"{given}: each must be an integer >= 1 (layers on that stage)")
    except ConfigError as e:
        raise ConfigError(f"invalid plan request:\n  {e}") from None


def _check_accounting(num_layers: int, fixed: Fixed, counted: tuple[bool, bool]) -> None:
    """The embedding / loss counted as layers: not with the explicit split flags, v given as
    ``--virtual-pipeline-stages`` (or searched), and with a fixed pp a split that exists."""
    pp = len(fixed.pipeline_layer_split) if fixed.pipeline_layer_split is not None else fixed.pp
    try:
        if fixed.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(
                "with account_for_embedding/loss_in_pipeline_split give ptdp plan v as "
                "--virtual-pipeline-stages V (or leave it to the search), not "
                "--num-layers-per-virtual-pipeline-stage"
            )
        layer_split(
            num_layers,
            pp or 1,
            fixed.pipeline_layer_split,
            fixed.decoder_first_pipeline_num_layers,
            fixed.decoder_last_pipeline_num_layers,
            embedding=counted[0],
            loss=counted[1],
            v=fixed.virtual_pipeline_model_parallel_size or 1,
        )
    except ConfigError as e:
        if pp is not None or "cannot be combined" in str(e) or "virtual-pipeline" in str(e):
            raise ConfigError(f"invalid plan request:\n  {e}") from None


def ineffective_flag_notes(model: ModelConfig, fixed: Fixed) -> list[str]:
    """Notes on flags given that change nothing in the plan, each saying why: ``--cp-comm-type``
    with ``--cp 1`` and ``--recompute-granularity selective`` with flash attention."""
    notes = []
    if fixed.cp == 1 and fixed.cp_comm_type is not None:
        notes.append(
            f"note: --cp-comm-type {fixed.cp_comm_type} changes nothing with --cp 1: without context "
            "parallelism no keys and values are exchanged"
        )
    core_only = set(fixed.recompute_modules or ("core_attn",)) == {"core_attn"}
    if fixed.recompute_granularity == "selective" and model.flash_attention and core_only:
        notes.append(
            "note: --recompute-granularity selective changes nothing with flash attention: the kernel "
            "keeps no s x s attention scores, so recomputing the attention core saves no memory (planned "
            "as none; --no-use-flash-attn plans the unfused kernel)"
        )
    return notes


def check_output_path(path: str, flag: str, suffixes: tuple[str, ...] = ()) -> None:
    """The file ``path`` can be written (its folder exists and is writable; a known suffix)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; give a file name")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: folder {folder} does not exist or is not writable")
    if suffixes and p.suffix.lower() not in suffixes:
        raise ConfigError(f"{flag} {path}: use one of {', '.join(suffixes)}")


def check_fixed_choices(model: ModelConfig, global_batch_size: int, fixed: Fixed) -> None:
    """Fixed choices that no layout can satisfy, whatever the search tries, are a bad request
    (exit 2) rather than "no layout fits": a fixed tp that does not divide the attention heads or
    the key/value heads, a fixed cp whose ``2 cp`` chunks do not divide the sequence (the rules
    every layout is checked by), a fixed micro batch that does not divide the global batch, a fixed
    pipeline schedule ``ptdp train`` does not run yet (:data:`ptdp.config.fields.SCHEDULES_NOT_TRAINED`,
    read at each call) or the planner does not model (``auto``), fixed model chunks at a fixed pp
    that ``ptdp train``'s schedule rules refuse whatever the number of microbatches. Raises
    ``ConfigError`` naming the numbers."""
    errors = []
    tp, cp, b = fixed.tp, fixed.cp, fixed.micro_batch_size
    if tp is not None:
        heads = heads_violations(model.num_attention_heads, tp)
        errors += [v.message for v in heads] or [r.message for r in kv_head_rejections(model, tp)]
    if cp is not None:
        errors += [r.message for r in context_rejections(model, tp or 1, cp)]
    kind = fixed.pipeline_schedule
    trained = [k for k in fields.SCHEDULES if k not in fields.SCHEDULES_NOT_TRAINED]
    modelled = ("gpipe", "1f1b", "interleaved-1f1b", *SPLIT_ORDERS)
    if kind is not None and (kind not in trained or kind not in modelled):
        why = "ptdp train does not run it yet" if kind not in trained else "ptdp plan does not model it"
        planned = ", ".join(k for k in trained if k in modelled)
        errors.append(f"--pipeline-schedule {kind}: {why} (ptdp plan plans {planned})")
    chunks = (fixed.virtual_pipeline_model_parallel_size, fixed.num_layers_per_virtual_pipeline_stage)
    if fixed.pp is not None and chunks != (None, None):  # ptdp train's rules of the chunks, whatever m
        # the embedding and the loss counted as layers as given, else each way the search tries
        counted = [fixed.accounting] if fixed.accounting is not None else [(False, False), *ACCOUNTING]
        broken = [
            [
                v.message
                for v in schedule_violations(
                    ParallelConfig(
                        pipeline_model_parallel_size=fixed.pp,
                        pipeline_schedule=kind,  # type: ignore[arg-type]
                        virtual_pipeline_model_parallel_size=chunks[0],
                        num_layers_per_virtual_pipeline_stage=chunks[1],
                        account_for_embedding_in_pipeline_split=embedding,
                        account_for_loss_in_pipeline_split=loss,
                    ),
                    model.num_layers,
                    1,
                )
                if "num_microbatches" not in v.values
            ]
            for embedding, loss in counted
        ]
        if all(broken):
            errors += broken[0]
    if b is not None and global_batch_size % b:
        errors.append(
            f"global_batch_size={global_batch_size} is not divisible by micro_batch_size={b} (rule: B % (b * dp) == 0)"
        )
    if errors:
        raise ConfigError("invalid plan request:\n  " + "\n  ".join(errors))
