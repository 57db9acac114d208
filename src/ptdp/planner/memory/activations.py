"""Activation memory of one GPU: the bytes a pipeline rank keeps for backward at its peak.

All results are bytes on ONE tensor-parallel (and context-parallel) rank of a pipeline stage.
Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473; [K22] Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", arXiv:2205.05198.

Per layer: [K22] §4 (16-bit activations, 1-byte dropout masks), generalised to grouped-query
attention, SwiGLU, no dropout and fused attention (:func:`layer_activation_bytes`); times the
microbatches (or model chunks) a pipeline rank holds at its peak (:func:`inflight_microbatches`).
"""

from __future__ import annotations

from functools import lru_cache, partial

from ptdp.config.model import ModelConfig
from ptdp.layout.pipeline.placement import placement_of, stage_owner
from ptdp.layout.pipeline.schedule import SPLIT_ORDERS
from ptdp.layout.vocab import keeps_logits, padded_vocab_size
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.moe_model import MoEModel, moe_layer_share, moe_of
from ptdp.planner.memory.cp_local import kv_buffer_bytes, local_model, unfused_score_bytes_missing
from ptdp.planner.memory.in_flight import held_points, peak_held
from ptdp.planner.memory.moe_activations import (
    dense_mlp_activation_bytes,
    mla_activation_change,
    moe_mlp_activation_bytes,
    shared_expert_activation_bytes,
)
from ptdp.planner.splits import chunk_layers, interleaved_peak

SCHEDULES = ("1f1b", "gpipe")


def activation_value_bytes(precision: str) -> tuple[int, int]:
    """(bytes of an activation value, bytes of a value kept in fp32) at ``precision``.

    bf16/fp16/fp8: 2 and 4 (fused-attention log-sum-exp and cross-entropy logits are fp32); fp32: 4 and 4.
    Dropout masks are 1 byte at every precision. Raises ValueError for another precision.
    """
    if precision in ("bf16", "fp16", "fp8"):
        return 2, 4
    if precision == "fp32":
        return 4, 4
    raise ValueError(f"precision={precision!r} must be one of bf16, fp16, fp8, fp32")


@lru_cache(maxsize=65536)
def layer_activation_bytes(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    *,
    sequence_parallel: bool,
    recompute: str,
    precision: str = "bf16",
    modules: tuple[str, ...] = ("core_attn",),
    etp: int = 1,
    ep: int = 1,
    fp8_recipe: str | None = None,
) -> float:
    """Activation bytes one transformer layer keeps for backward, per microbatch, on one tp rank.

    [K22] eq. (1)-(2) and §5 (s: sequence, b: micro batch, t = tp): no parallelism
    ``s b h (34 + 5 a s / h)``; TP ``s b h (10 + 24/t + 5 a s / (h t))``; TP + SP ``s b h / t (34 + 5 a s / h)``;
    selective recompute drops the ``5 a s / h`` term; full recompute keeps only the layer input ``2 s b h``
    (/t with SP); "op" (torchtitan's per-op checkpointing) keeps the layer input, the attention output
    and log-sum-exp and the odd-numbered matmul outputs of the layer (Q, V, fc1 and, with SwiGLU, fc2's
    ``h`` before its reduction; torchtitan ``_op_sac_save_list``: every second mm recomputed).
    Generalised per token for GQA (``4 a d + 4 kv d``; ``kv = a`` where the model repeats the heads
    before the kernel, ``model.kv_repeated``) and SwiGLU (``6 ffn`` instead of ``4 ffn``); ``d`` is
    ``model.head_dim``, and ``qk_layernorm`` keeps the norms' inputs, ``2 (a + kv) d``.
    With ``model.flash_attention`` (Dao et al. 2022, arXiv:2205.14135) no score is kept, only the fp32
    log-sum-exp, ``4 a`` bytes per token. FP8 GEMMs keep their four inputs in 1 byte
    (:func:`fp8_kept_bytes`): precision "fp8" alone as Transformer Engine does, with ``fp8_recipe``
    as ``ptdp train`` does (values of ``precision``'s dtype otherwise): under sequence parallelism
    QKV and fc1 keep their 16-bit input shard (gathered again in backward), and a flash kernel
    keeps the attention output besides the projection's FP8 copy.
    With "selective", ``modules`` are Megatron-Core's ``--recompute-modules``: ``core_attn`` drops the
    scores (above), ``layernorm`` the two norms' outputs (the QKV and fc1 inputs, recomputed from the
    norms' inputs), ``mlp`` everything the MLP keeps but its input (fc1's input and output, fc2's input).
    A planned MoE model (:class:`~ptdp.planner.inputs.moe_model.MoEModel`): the mean over its layers,
    each MoE layer's MLP as :mod:`ptdp.planner.memory.moe_activations` counts it (experts over
    ``etp``), and multi-head latent attention in place of the attention's terms.
    Raises ValueError for an unknown ``recompute``.
    """
    if recompute not in ("none", "selective", "full", "op"):
        raise ValueError(f"recompute={recompute!r} must be none, selective, full or op")
    e, e32 = activation_value_bytes(precision)
    h, a, s = model.hidden_size, model.num_attention_heads, model.seq_length
    t, tokens = tp, micro_batch_size * s
    # bytes of a kept input of a QKV / projection / fc1 / fc2 GEMM
    g = fp8_kept_bytes(fp8_recipe, tokens) if precision == "fp8" or fp8_recipe else e
    if recompute == "full":
        return e * tokens * h / (t if sequence_parallel else 1)
    d, kv = model.head_dim, model.kv_heads
    if recompute == "op":
        saved = a * d + kv * d + model.ffn + a * d  # Q, V, fc1 (SwiGLU: its gate half), attention output
        per_token = e * h / (t if sequence_parallel else 1) + e * saved / t + e32 * a / t
        return tokens * (per_token + (e * h if model.swiglu else 0.0))
    mask = 1 if model.has_dropout else 0
    kept = set(modules) if recompute == "selective" else set()
    gemm_inputs = 0 if "layernorm" in kept else (1 if "mlp" in kept else 2)  # of QKV and fc1
    # ptdp's FP8 column-parallel linears keep their 16-bit input shard under sequence parallelism
    column = e if fp8_recipe and sequence_parallel else g
    replicated = (2 * e + gemm_inputs * column + 2 * mask) * h
    mlp = (2 if model.swiglu else 1) * model.ffn  # fc1 output: GELU input, or SwiGLU's gate and up halves
    # the attention output, the projection's input: with ptdp's FP8 its copy is kept beside the
    # flash kernel's output (unless the kernel is recomputed)
    core_kept = recompute == "none" or "core_attn" not in kept
    attention_out = g + e if fp8_recipe and model.flash_attention and core_kept else g
    split = (
        e * (a * d + 2 * model.attended_kv_heads * d)
        + attention_out * a * d
        + (0 if "mlp" in kept else e * mlp + g * model.ffn)
    )
    if model.qk_layernorm:  # the query/key norms keep their inputs
        split += e * (a + kv) * d
    per_token = replicated / (t if sequence_parallel else 1) + split / t
    if model.flash_attention:
        per_token += e32 * a / t
    elif recompute == "none" or (recompute == "selective" and "core_attn" not in kept):
        per_token += (e + (mask + e) * mask) * a * s / t
    if isinstance(model, MoEModel):
        ptdp_fp8 = bool(fp8_recipe) and "layernorm" not in kept and "mlp" not in kept
        change = _sublayer_change(model, tp, tokens, sequence_parallel, e, g, kept, etp, ep, ptdp_fp8=ptdp_fp8)
        if "mlp" in kept and "layernorm" not in kept:  # mlp recomputes dense MLPs: an MoE layer keeps its input
            change += moe_layer_share(model) * tokens * column * h / (t if sequence_parallel else 1)
        return tokens * per_token + change
    return tokens * per_token


def fp8_kept_bytes(recipe: str | None, tokens: int) -> float:
    """Bytes per element of an FP8 GEMM input kept for backward (the transpose ``x^T [K, T]`` of a
    microbatch's ``T`` tokens): 1, plus its float32 scales: rowwise one per row (``4 / T``),
    blockwise one per 1x128 tile (``4 ceil(T / 128) / T``); tensorwise and delayed one per tensor
    and None (Transformer Engine's) nothing counted."""
    if recipe == "rowwise":
        return 1.0 + 4.0 / tokens
    if recipe == "blockwise":
        return 1.0 + 4.0 * -(-tokens // 128) / tokens
    return 1.0


def _sublayer_change(
    model: MoEModel,
    tp: int,
    tokens: int,
    sequence_parallel: bool,
    e: int,
    g: float,
    kept: set[str],
    etp: int,
    ep: int,
    *,
    ptdp_fp8: bool = False,
) -> float:
    """Bytes per layer (the mean over the model's layers) by which MoE layers and multi-head latent
    attention change :func:`layer_activation_bytes`' dense count (no full or per-op recompute).
    ``ptdp_fp8``: ``ptdp train``'s FP8 (:mod:`ptdp.engine.moe.expert_linear`): the experts keep
    their inputs in the activations' dtype, the router its input (counted as fc1's, ``g``), and
    without sequence parallelism the shared expert's fc1 its FP8 copy; the shared expert's fc2
    input is FP8 (``g``)."""
    modules = tuple(sorted(kept))
    out = 0.0
    if model.mla is not None:
        out += mla_activation_change(model, model.mla, tokens, tp, precision_bytes=e, gemm_bytes=g, modules=modules)
    moe = moe_of(model)
    if moe is not None:
        routed = tokens // (tp if sequence_parallel else 1)
        experts_g = e if ptdp_fp8 else g
        layer = moe_mlp_activation_bytes(
            model,
            moe,
            routed,
            precision_bytes=e,
            etp=etp,
            load=model.busiest_load(ep),
            modules=modules,
            gemm_bytes=experts_g,
        )
        layer += shared_expert_activation_bytes(model, moe, tokens, tp, precision_bytes=e, modules=modules)
        if ptdp_fp8 and not sequence_parallel:  # the router's input in its dtype, the shared fc1's FP8 copy
            layer += tokens * model.hidden_size * (e - g + (g if moe.shared_ffn else 0.0))
        if ptdp_fp8 and moe.shared_ffn and not {"shared_experts", "moe"} & kept:  # shared fc2's FP8 input
            layer -= tokens * (e - g) * moe.shared_ffn / tp
        if "mlp" not in kept:
            layer -= dense_mlp_activation_bytes(model, tokens, tp, precision_bytes=e, gemm_bytes=g)
        out += layer * moe_layer_share(model)
    return out


def inflight_microbatches(layout: Candidate, pp_rank: int, *, schedule: str = "1f1b") -> float:
    """Microbatches (in whole-stage equivalents) pipeline rank ``pp_rank`` holds at its peak.

    1F1B [N21 §2.2]: ``min(pp - r, m)``. GPipe: ``m``. Interleaved (v > 1): ``2 (pp - r - 1) + (v - 1) pp + 1``
    chunks, capped at ``m v``, divided by v; on rank 0 the factor ``pp (1 + (pp - 1)/(pp v))`` of [K22] §4.2.
    A layout whose schedule runs B and W apart (:func:`split_backward_kind`, whatever ``schedule``
    says): the most chunks between a forward and its B in its own order
    (:mod:`ptdp.planner.memory.in_flight`), divided by v.
    """
    pp, m, v = layout.pp, layout.num_microbatches, layout.virtual_stages
    kind = split_backward_kind(layout)
    if kind is not None:
        return peak_held(held_points(kind, pp, m, v, pp_rank), [1.0 / v] * v, [0.0] * v)
    if schedule == "gpipe":
        return float(m)
    if schedule != "1f1b":
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    if v == 1:
        return float(min(pp - pp_rank, m))
    return min(2 * (pp - pp_rank - 1) + (v - 1) * pp + 1, m * v) / v


def inflight_layer_microbatches(
    layout: Candidate, pp_rank: int, layers_on_stage: int, *, schedule: str = "1f1b", loss_weight: float = 0.0
) -> tuple[float, float | None]:
    """(layer-microbatches, loss-side microbatches) rank ``pp_rank`` holds at its peak; one
    layer-microbatch is one layer's activations for one microbatch.

    Usually :func:`inflight_microbatches` x ``layers_on_stage`` and None. For an interleaved split with
    unequal chunks, the peak of ``layers + loss_weight * losses`` along the interleaved 1F1B order
    (:func:`ptdp.planner.splits.interleaved_peak`).
    """
    mbs = inflight_microbatches(layout, pp_rank, schedule=schedule)
    v, split = layout.virtual_stages, layout.layer_split
    counts = chunk_layers(split, v, pp_rank) if v > 1 and split is not None and schedule == "1f1b" else None
    if counts is None or len(set(counts)) == 1:
        return mbs * layers_on_stage, None
    last = pp_rank == layout.pp - 1
    layers, losses = interleaved_peak(
        counts, layout.pp, layout.num_microbatches, pp_rank, last=last, loss_weight=loss_weight
    )
    return layers, (losses if last else None)


def _edge_activation_bytes(
    model: ModelConfig,
    layout: Candidate,
    *,
    first: bool,
    last: bool,
    inflight: float,
    last_inflight: int,
    divisible_by: int = 128,
) -> float:
    """Activations outside the transformer layers [K22] §4.3, on one tp rank.

    First stage: the embedding-dropout mask, ``s b h`` per microbatch in flight (/t with SP). Last stage,
    per microbatch whose loss is in flight: final-norm and output-layer inputs ``2 s b h`` values (/t with
    SP), an fp32 log-sum-exp and int64 label per token (``12 s b`` bytes), and the logits ``s b V_pad / t``
    when :func:`~ptdp.layout.vocab.keeps_logits` keeps them.
    """
    e, e32 = activation_value_bytes(layout.precision)
    t, tokens, h = layout.tp, layout.micro_batch_size * model.seq_length, model.hidden_size
    shard = t if layout.parallel.sequence_parallel else 1
    out = 0.0
    if first and model.has_dropout:
        out += inflight * tokens * h / shard
    if last:
        local_vocab = padded_vocab_size(model.vocab_size, divisible_by, t) // t
        logits = e * tokens * local_vocab if keeps_logits(tokens, local_vocab, e) else 0
        out += last_inflight * (2.0 * e * tokens * h / shard + (e32 + 8) * tokens + logits)
    return out


def stage_activation_bytes(
    model: ModelConfig,
    layout: Candidate,
    pp_rank: int,
    layers_on_stage: int,
    *,
    schedule: str = "1f1b",
    make_vocab_size_divisible_by: int = 128,
) -> float:
    """Peak activation bytes of pipeline rank ``pp_rank`` (one tp rank).

    Layer activations x layers x microbatches in flight, plus [K22] §4.3's embedding/output/loss terms
    (one microbatch's under 1F1B, all m under GPipe). Full recompute adds the recomputed layer's working
    set; on the last stage the larger of it and the loss-side tensors, which are never held together.
    A schedule running B and W apart: :func:`_split_backward_bytes` (``schedule`` not read).
    """
    b, sp, precision = layout.micro_batch_size, layout.parallel.sequence_parallel, layout.precision
    per_layer = layer_activation_bytes(
        model,
        layout.tp,
        b,
        sequence_parallel=sp,
        recompute=layout.recompute,
        precision=precision,
        modules=layout.modules,
        etp=layout.etp,
        ep=layout.ep,
        fp8_recipe=layout.fp8_recipe,
    )
    if split_backward_kind(layout) is not None:
        return _split_backward_bytes(model, layout, pp_rank, layers_on_stage, per_layer, make_vocab_size_divisible_by)
    mbs = inflight_microbatches(layout, pp_rank, schedule=schedule)
    last = pp_rank == layout.pp - 1
    last_inflight = layout.num_microbatches if schedule == "gpipe" else 1
    loss_side = (
        _edge_activation_bytes(
            model,
            layout,
            first=False,
            last=True,
            inflight=mbs,
            last_inflight=1,
            divisible_by=make_vocab_size_divisible_by,
        )
        if last
        else 0.0
    )
    layer_mbs, loss_mbs = inflight_layer_microbatches(
        layout, pp_rank, layers_on_stage, schedule=schedule, loss_weight=loss_side / per_layer if per_layer else 0.0
    )
    out = per_layer * layer_mbs
    out += _edge_activation_bytes(
        model, layout, first=pp_rank == 0, last=False, inflight=mbs, last_inflight=last_inflight
    )
    if layout.recompute == "full":
        working = (
            layer_activation_bytes(
                model,
                layout.tp,
                b,
                sequence_parallel=sp,
                recompute="none",
                precision=precision,
                etp=layout.etp,
                ep=layout.ep,
                fp8_recipe=layout.fp8_recipe,
            )
            - per_layer
        )
        return out + max(working, loss_side) + (last_inflight - 1) * loss_side
    return out + (last_inflight if loss_mbs is None else loss_mbs) * loss_side


def split_backward_kind(layout: Candidate) -> str | None:
    """The layout's pipeline schedule when it runs B and W apart (zb-h1, zb-h2, zb-v, dualpipev:
    :data:`ptdp.layout.pipeline.schedule.SPLIT_ORDERS`), else None."""
    kind = layout.parallel.schedule
    return kind if kind in SPLIT_ORDERS else None


@lru_cache(maxsize=65536)
def wgrad_kept_bytes(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    *,
    precision: str = "bf16",
    fp8_recipe: str | None = None,
    ep: int = 1,
    etp: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """Bytes one layer keeps on one tp rank from a microbatch's B to its W (a zero-bubble
    schedule's), as ``ptdp train``'s linear layers hand their weight gradients ``dW = dyᵀ x`` to W:
    per linear its input ``x`` and output gradient ``dy``, all ``T = b s`` tokens, QKV ``h`` and
    ``(a + 2 kv) d / t``, the projection ``a d / t`` and ``h``, fc1 ``h`` and ``n ffn / t`` (n = 2 for
    SwiGLU), fc2 ``ffn / t`` and ``h`` (with sequence parallelism the inputs of QKV and fc1 and the
    output gradients of the projection and fc2 as gathered for the GEMM, not their shards). Each
    value in the activations' dtype, or with FP8 GEMMs as the GEMM's FP8 operand
    (:func:`fp8_kept_bytes`). What else B used is freed by then; the inputs were part of the
    forward's activations until B. A planned MoE model: the dense MLP's in its dense layers; in its
    MoE layers the shared expert's (a dense MLP of width ``S``) and the routed experts' fc1 and fc2
    on each of the ``R = etp load k T / t`` rows the rank's experts receive (``load``:
    :meth:`~ptdp.planner.inputs.moe_model.MoEModel.busiest_load` at ep; ``/ t`` with sequence
    parallelism): ``h``, ``n F / etp``, ``F / etp`` and ``h`` (fc2's output gradient a view of
    ``R + 1`` rows: the zero row the combine's gather appends)."""
    e, _ = activation_value_bytes(precision)
    h, a, t = model.hidden_size, model.num_attention_heads, tp
    d, kv, ffn, tokens = model.head_dim, model.kv_heads, model.ffn, micro_batch_size * model.seq_length
    g = fp8_kept_bytes(fp8_recipe, tokens) if precision == "fp8" or fp8_recipe else e
    halves = 2 if model.swiglu else 1
    attention = h + (a + 2 * kv) * d / t + a * d / t + h
    mlp = h + halves * ffn / t + ffn / t + h
    share, moe = moe_layer_share(model), moe_of(model)
    out = g * tokens * (attention + (1.0 - share) * mlp)
    if moe is not None and isinstance(model, MoEModel):
        f, shared = moe.expert_ffn(ffn), moe.shared_ffn or 0
        rows = etp * model.busiest_load(ep) * moe.moe_router_topk * tokens / (t if sequence_parallel else 1)
        experts = rows * (h + halves * f / etp + f / etp + h) + h  # + the combine's zero row in fc2's dy
        dense = tokens * (h + halves * shared / t + shared / t + h) if shared else 0.0
        out += g * share * (experts + dense)
    return out


def _split_backward_bytes(
    model: ModelConfig, layout: Candidate, pp_rank: int, layers_on_stage: int, per_layer: float, divisible_by: int
) -> float:
    """Peak activation bytes of rank ``pp_rank`` under a schedule running B and W apart, from its
    own order (:mod:`ptdp.planner.memory.in_flight`): each chunk's microbatches from forward to B
    keep ``per_layer`` per layer (the first stage's chunk also its embedding-dropout mask, the last
    stage's its loss side), those from B to W :func:`wgrad_kept_bytes` per layer; the chunks hold
    ``layers_on_stage / v`` layers each. Full recompute adds the recomputed layer's working set,
    never held with the loss side."""
    kind = split_backward_kind(layout)
    assert kind is not None
    pp, v, m = layout.pp, layout.virtual_stages, layout.num_microbatches
    placement = placement_of(kind)
    points = held_points(kind, pp, m, v, pp_rank)
    layers = layers_on_stage / v
    full = [per_layer * layers] * v
    if stage_owner(0, pp, placement)[0] == pp_rank:
        full[0] += _edge_activation_bytes(model, layout, first=True, last=False, inflight=1, last_inflight=0)
    loss = [0.0] * v
    loss_owner, loss_chunk = stage_owner(pp * v - 1, pp, placement)
    if loss_owner == pp_rank:
        loss[loss_chunk] = _edge_activation_bytes(
            model, layout, first=False, last=True, inflight=0, last_inflight=1, divisible_by=divisible_by
        )
    kept = layers * wgrad_kept_bytes(
        model,
        layout.tp,
        layout.micro_batch_size,
        precision=layout.precision,
        fp8_recipe=layout.fp8_recipe,
        ep=layout.ep,
        etp=layout.etp,
        sequence_parallel=layout.parallel.sequence_parallel,
    )
    peak = peak_held(points, [f + x for f, x in zip(full, loss)], [kept] * v)
    if layout.recompute != "full":
        return peak
    working = (
        layer_activation_bytes(
            model,
            layout.tp,
            layout.micro_batch_size,
            sequence_parallel=layout.parallel.sequence_parallel,
            recompute="none",
            precision=layout.precision,
            etp=layout.etp,
            ep=layout.ep,
            fp8_recipe=layout.fp8_recipe,
        )
        - per_layer
    )
    return max(peak, peak_held(points, full, [kept] * v) + working)


def rank_activation_bytes(
    model: ModelConfig,
    layout: Candidate,
    pp_rank: int,
    layers_on_stage: int,
    *,
    schedule: str = "1f1b",
    make_vocab_size_divisible_by: int = 128,
) -> float:
    """Peak activation bytes of one cp rank of pipeline rank ``pp_rank`` (one tp rank).

    :func:`stage_activation_bytes` of the ``s / cp``-token model (:func:`ptdp.planner.memory.cp_local.local_model`),
    plus, with cp > 1, an unfused kernel's missing ``(cp - 1)`` score parts and the running layer's
    key/value exchange buffers (:func:`ptdp.planner.memory.cp_local.kv_buffer_bytes`).
    """
    cp = layout.cp
    if cp == 1:
        return stage_activation_bytes(
            model,
            layout,
            pp_rank,
            layers_on_stage,
            schedule=schedule,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        )
    local = local_model(model, cp)
    out = stage_activation_bytes(
        local,
        layout,
        pp_rank,
        layers_on_stage,
        schedule=schedule,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    b = layout.micro_batch_size
    activations = partial(
        layer_activation_bytes,
        local,
        layout.tp,
        b,
        sequence_parallel=layout.parallel.sequence_parallel,
        precision=layout.precision,
        fp8_recipe=layout.fp8_recipe,
    )
    none, selective = activations(recompute="none"), activations(recompute="selective")
    missing = unfused_score_bytes_missing(none, selective, cp, model.flash_attention)
    if layout.recompute == "none" or (layout.recompute == "selective" and "core_attn" not in layout.modules):
        out += missing * layers_on_stage * inflight_microbatches(layout, pp_rank, schedule=schedule)
    elif layout.recompute == "full":
        out += missing  # the one layer recomputed at a time
    e, _ = activation_value_bytes(layout.precision)
    return out + kv_buffer_bytes(model, layout.tp, cp, b, layout.parallel.cp_comm_type, e)


_ACTIVATIONS: dict[tuple, float] = {}


def cached_rank_activation_bytes(
    model: ModelConfig, layout: Candidate, rank: int, n_layers: int, schedule: str, div: int
) -> float:
    """:func:`rank_activation_bytes`, memoised on every field of ``layout`` that activations depend
    on (not the sharding strategy: a search predicts the same layout under several)."""
    key = (
        model,
        layout.tp,
        layout.cp,
        layout.pp,
        layout.dp,
        layout.micro_batch_size,
        layout.global_batch_size,
        layout.virtual_stages,
        layout.recompute,
        layout.recompute_modules,
        layout.parallel.sequence_parallel,
        layout.precision,
        layout.fp8_recipe,
        layout.layer_split,
        layout.parallel.cp_comm_type,
        layout.etp,
        layout.ep,
        layout.parallel.schedule,
        rank,
        n_layers,
        schedule,
        div,
    )
    act = _ACTIVATIONS.get(key)
    if act is None:
        if len(_ACTIVATIONS) >= 65536:
            _ACTIVATIONS.clear()
        act = _ACTIVATIONS[key] = rank_activation_bytes(
            model, layout, rank, n_layers, schedule=schedule, make_vocab_size_divisible_by=div
        )
    return act
