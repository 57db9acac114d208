"""Memory model of one GPU: parameters, gradients, optimizer state, activations, fixed overhead.

All results are bytes on ONE tensor-parallel rank of a pipeline stage (the unit that the GPU of
that stage holds). Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473; [K22] Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198.

Parameters are counted exactly from the shapes ptdp's :class:`ptdp.engine.model.gpt.GPTModel` creates
(``tests/test_planner_model_memory.py`` checks the count against the real ``numel``).

Activations follow [K22] §4 (16-bit activations, 1-byte dropout masks), generalised
term by term to grouped-query attention, SwiGLU, models without dropout and fused (flash)
attention (see :func:`layer_activation_bytes`), times the microbatches (or model chunks) a
pipeline rank holds at its peak (:func:`inflight_microbatches`). For ptdp's own GPT
(:func:`ptdp.planner.models.spec_from_model_config`) ``tests/test_planner_activations.py`` checks
the peak against the bytes autograd really saves (:mod:`ptdp.engine.activation_meter`).
"""

from __future__ import annotations

from functools import lru_cache, partial

from ptdp.planner.context import kv_buffer_bytes, local_model, unfused_score_bytes_missing
from ptdp.planner.fp8 import fp8_weight_copy_bytes
from ptdp.planner.hardware import GiB, GPUSpec
from ptdp.planner.models import ModelSpec
from ptdp.planner.plan import Layout, MemoryBreakdown
from ptdp.planner.sharding import chunk_by_chunk, stage_state_bytes, strategy_bytes_per_param
from ptdp.planner.splits import chunk_layers, interleaved_peak
from ptdp.spec import keeps_logits, padded_vocab_size, stage_layer_counts

#: Default fixed overhead per GPU (bytes): CUDA context and kernel images (~0.5 GiB on A100/H100),
#: NCCL buffers of the 3-5 communicators a rank joins (tp, pp, dp, embedding, world; a few hundred
#: MiB each at default NCCL_BUFFSIZE and channel counts), cuBLAS workspaces, and caching-allocator
#: fragmentation at the activation peak. 2 GiB is deliberately round: large enough that a plan
#: listed as fitting is not at the edge, small next to the 40-141 GiB of current GPUs.
DEFAULT_OVERHEAD_BYTES = 2 * GiB

SCHEDULES = ("1f1b", "gpipe")


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def layer_param_count(model: ModelSpec, tp: int) -> int:
    """Parameters of one transformer layer on one tp rank.

    GPT (ptdp's ``TransformerLayer``): 2 LayerNorms (weight + bias, replicated, 4h), QKV
    ``[3h/tp, h]`` + bias ``[3h/tp]``, proj ``[h, h/tp]`` + bias ``[h]`` (replicated), fc1
    ``[ffn/tp, h]`` + bias ``[ffn/tp]``, fc2 ``[h, ffn/tp]`` + bias ``[h]`` (replicated).
    Llama-style: 2 RMSNorm weights (2h), QKV ``[(a + 2 kv) d / tp, h]``, proj ``[h, a d / tp]``,
    SwiGLU (or a 2-matrix MLP if ``swiglu`` is False) ``n * [ffn/tp, h]``, no biases. Mixed
    models (``ModelSpec.rmsnorm`` / ``linear_bias`` / ``biased_linears`` set one by one) add each
    part on its own; a bias is as wide as its layer's output on this rank.
    """
    h, a, d = model.hidden_size, model.num_attention_heads, model.hidden_size // model.num_attention_heads
    q, kv, ffn = a * d, model.kv_heads * d, model.ffn
    mats = 3 if model.swiglu else 2
    weights = (q + 2 * kv) * h // tp + q * h // tp + mats * ffn * h // tp
    norms = 2 * (h if model.uses_rmsnorm else 2 * h)
    widths = {"qkv": (q + 2 * kv) // tp, "proj": h, "fc1": (mats - 1) * ffn // tp, "fc2": h}
    biases = sum(widths[name] for name in model.linears_with_bias)
    return weights + biases + norms


def stage_param_counts(
    model: ModelSpec,
    tp: int,
    pp: int,
    *,
    make_vocab_size_divisible_by: int = 128,
    layer_split: tuple[int, ...] | None = None,
) -> list[int]:
    """Parameters held by one tp rank of each of the ``pp`` pipeline stages (exact).

    First stage: word embedding ``[V_pad/tp, h]`` (V_pad: V rounded up to a multiple of
    ``make_vocab_size_divisible_by * tp``) and, for GPT, learned positions ``[s, h]``. Last stage:
    the final norm (weight + bias; RMSNorm: weight) and the output weight ``[V_pad/tp, h]`` when
    untied, or, when tied and pp > 1, a copy of the word embedding. With pp = 1 one stage holds
    everything. ``layer_split`` lists layers per stage (None: even, ``l % pp == 0`` required).
    Raises ``ConfigError`` for an impossible split.
    """
    counts = stage_layer_counts(model.num_layers, pp, layer_split)
    h = model.hidden_size
    v_pad = padded_vocab_size(model.vocab_size, make_vocab_size_divisible_by, tp)
    embedding = v_pad // tp * h
    per_layer = layer_param_count(model, tp)
    first = embedding + (model.seq_length * h if model.has_position_table else 0)
    last = (h if model.uses_rmsnorm else 2 * h) + (embedding if (not model.tied or pp > 1) else 0)
    out = [n * per_layer for n in counts]
    out[0] += first
    out[-1] += last
    return out


def bytes_per_param(precision: str, dp: int = 1, distributed_optimizer: bool = False) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter with Adam.

    bf16/fp16 mixed precision [N21, K22; Micikevicius et al. 2018]: 2-byte weights, 4-byte fp32
    main gradients, 12 bytes of optimizer state (fp32 main weights, Adam m and v): 2 + 4 + 12 = 18;
    with the distributed optimizer (ZeRO-1) the 12 bytes are split over dp: 6 + 12/dp.
    fp32: 4 + 4 + 8 (m, v) = 16; distributed: 8 + 8/dp. fp8 (bf16 training with FP8 GEMMs): as
    bf16; the FP8 weight copies are :func:`ptdp.planner.fp8.fp8_weight_copy_bytes`.
    """
    if precision in ("bf16", "fp16", "fp8"):
        weights, grads, state = 2.0, 4.0, 12.0
    elif precision == "fp32":
        weights, grads, state = 4.0, 4.0, 8.0
    else:
        raise ValueError(f"precision={precision!r} must be one of bf16, fp16, fp8, fp32")
    return weights, grads, (state / dp if distributed_optimizer else state)  # sharding strategies: rank_state_bytes


def rank_state_bytes(
    model: ModelSpec, layout: Layout, n_params: int, n_layers: int, per_param: tuple[float, float, float] | None = None
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of one rank of a stage holding ``n_params`` parameters and
    ``n_layers`` layers under ``layout``'s sharding strategy over ``dp * cp`` ranks
    (:func:`ptdp.planner.sharding.stage_state_bytes`; a gathered unit is one layer, or the
    stage's embedding / output parameters when larger; reduced chunk by chunk, the largest chunk's
    gradient is the transient). ``per_param``: the strategy's
    :func:`~ptdp.planner.sharding.strategy_bytes_per_param` when the caller has it."""
    strategy, shard = layout.sharding_strategy, layout.shard_size
    if per_param is not None and (shard == 1 or strategy in ("no_shard", "optim")):  # no transients
        return n_params * per_param[0], n_params * per_param[1], n_params * per_param[2]
    unit, chunk = 0, 0
    per_layer = layer_param_count(model, layout.tp)
    edge = max(0, n_params - n_layers * per_layer)  # the embedding / output layer and final norm
    if strategy == "optim_grads_params":  # the only strategy with gathered units
        unit = max(per_layer, edge)
    v = layout.virtual_stages
    if chunk_by_chunk(strategy, shard, v, layout.num_microbatches, layout.pp):
        chunk = per_layer * -(-n_layers // v) + edge  # the largest chunk, at most (its layers + the edge)
    return stage_state_bytes(n_params, unit, layout.precision, strategy, shard, chunk_params=chunk)


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------
def activation_value_bytes(precision: str) -> tuple[int, int]:
    """(bytes of an activation value, bytes of a value kept in fp32) at ``precision``.

    bf16/fp16 mixed precision: 2-byte activations; the log-sum-exp of a fused attention kernel and
    the logits of the cross entropy are fp32 (4). fp32: 4 and 4 (nothing is doubled twice).
    fp8 (bf16 training with FP8 GEMMs): 2 and 4, like bf16; the 1-byte inputs of the FP8 GEMMs are
    counted by :func:`layer_activation_bytes`. Dropout masks are 1 byte at every precision.
    """
    if precision in ("bf16", "fp16", "fp8"):
        return 2, 4
    if precision == "fp32":
        return 4, 4
    raise ValueError(f"precision={precision!r} must be one of bf16, fp16, fp8, fp32")


@lru_cache(maxsize=65536)
def layer_activation_bytes(
    model: ModelSpec,
    tp: int,
    micro_batch_size: int,
    *,
    sequence_parallel: bool,
    recompute: str,
    precision: str = "bf16",
) -> float:
    """Activation bytes one transformer layer keeps for backward, per microbatch, on one tp rank.

    [K22] eq. (1)-(2) and §5 for GPT, per layer (s: sequence, b: micro batch, h, a, t = tp):
      no parallelism ``s b h (34 + 5 a s / h)``; TP ``s b h (10 + 24/t + 5 a s / (h t))``;
      TP + SP ``s b h / t (34 + 5 a s / h)``; selective recompute drops the ``5 a s / h`` term;
      full recompute keeps only the layer input, ``2 s b h`` (``2 s b h / t`` with SP).
    Generalisation used for GQA and SwiGLU (same accounting, per token, 2 bytes per value):
      replicated over tp (divided by t with SP): 2 norm inputs (4h), QKV and fc1 inputs (4h),
      2 dropout masks (2h, 1 byte each; 0 when ``model.dropout`` is False);
      split over tp: q and k for the scores, v, attention context (``4 a d + 4 kv d``), MLP
      ``4 ffn`` (GELU input and output) or ``6 ffn`` (SwiGLU: the fused ``2 ffn`` fc1 output and
      the gated product); scores ``5 a s`` per token (softmax output 2, dropout mask 1, dropout
      output 2; without dropout: 2), dropped by selective recompute.
    With ``model.flash_attention`` (FlashAttention, Dao et al. 2022, arXiv:2205.14135) no score is
    kept, only the kernel's fp32 log-sum-exp, ``4 a`` bytes per token (its dropout mask is
    regenerated from the seed, not kept): GPT is ``s b h (34 + 16 a / h)`` without parallelism,
    ``s b h (10 + 24/t) + 4 a s b / t`` with TP, ``s b h / t (34 + 16 a / h)`` with TP + SP. Selective
    recompute then keeps the same bytes (Megatron checkpoints the attention core only with the
    unfused kernel; a flash kernel keeps nothing worth recomputing).
    With a = kv, d = h/a, ffn = 4h this is exactly [K22]'s ``10 h + 24 h / t + 5 a s / t``.
    ``precision`` "fp32" makes every value 4 bytes (masks stay 1 byte; see
    :func:`activation_value_bytes`). "fp8" (Transformer Engine's FP8 training,
    :mod:`ptdp.planner.fp8`): the inputs of the four FP8 GEMMs are kept in FP8, 1 byte each (the
    QKV input h, the attention-projection input ``a d``, the fc1 input h, the fc2 input ``ffn``);
    everything else stays 16-bit.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r} must be none, selective or full")
    e, e32 = activation_value_bytes(precision)
    g = 1 if precision == "fp8" else e  # bytes of a kept input of a QKV / projection / fc1 / fc2 GEMM
    h, a, s = model.hidden_size, model.num_attention_heads, model.seq_length
    t, tokens = tp, micro_batch_size * s
    if recompute == "full":
        return e * tokens * h / (t if sequence_parallel else 1)
    d, kv = h // a, model.kv_heads
    mask = 1 if model.dropout else 0
    replicated = (2 * e + 2 * g + 2 * mask) * h
    mlp = (2 if model.swiglu else 1) * model.ffn  # fc1 output: GELU input, or SwiGLU's gate and up halves
    split = e * (a * d + 2 * kv * d + mlp) + g * (a * d + model.ffn)
    per_token = replicated / (t if sequence_parallel else 1) + split / t
    if model.flash_attention:
        per_token += e32 * a / t
    elif recompute == "none":
        per_token += (e + (mask + e) * mask) * a * s / t
    return tokens * per_token


def inflight_microbatches(layout: Layout, pp_rank: int, *, schedule: str = "1f1b") -> float:
    """Microbatches (in whole-stage equivalents) pipeline rank ``pp_rank`` holds at its peak.

    1F1B [N21 §2.2]: rank r holds ``min(pp - r, m)``. GPipe: ``m``. Interleaved 1F1B (v > 1 model
    chunks per rank): rank r runs ``2 (pp - r - 1) + (v - 1) pp`` warm-up chunk forwards and holds
    one more chunk, capped at ``m v``; divided by v (a chunk is 1/v of the stage). On rank 0 that is
    ``pp (1 + (pp - 1)/(pp v))``, the factor of [K22] §4.2.
    """
    pp, m, v = layout.pp, layout.num_microbatches, layout.virtual_stages
    if schedule == "gpipe":
        return float(m)
    if schedule != "1f1b":
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    if v == 1:
        return float(min(pp - pp_rank, m))
    return min(2 * (pp - pp_rank - 1) + (v - 1) * pp + 1, m * v) / v


def inflight_layer_microbatches(
    layout: Layout, pp_rank: int, layers_on_stage: int, *, schedule: str = "1f1b", loss_weight: float = 0.0
) -> tuple[float, float | None]:
    """(layer-microbatches, loss-side microbatches) rank ``pp_rank`` holds at its peak; one
    layer-microbatch is one layer's activations for one microbatch.

    Usually :func:`inflight_microbatches` x ``layers_on_stage`` and None (the caller's rule for the
    loss side). For an interleaved split whose chunks hold different numbers of layers (the
    embedding and/or loss counted as layers, :func:`ptdp.planner.splits.chunk_layers`) the peak of
    ``layers + loss_weight * losses`` along the interleaved 1F1B order
    (:func:`ptdp.planner.splits.interleaved_peak`; ``loss_weight``: the loss side's bytes over one
    layer-microbatch's). With equal chunks both give the same number.
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
    model: ModelSpec,
    layout: Layout,
    *,
    first: bool,
    last: bool,
    inflight: float,
    last_inflight: int,
    divisible_by: int = 128,
) -> float:
    """Activations outside the transformer layers [K22] §4.3, on one tp rank.

    First stage: the embedding-dropout mask, ``s b h`` per microbatch in flight (/t with SP; none
    without dropout). Last stage, per microbatch whose loss is in flight (``last_inflight``: 1 for
    1F1B, m for GPipe): final-norm input and output-layer input, ``2 s b h`` values (/t with SP),
    and what the chunked output layer + cross entropy keeps besides its input
    (:mod:`ptdp.engine.tensor_parallel.linear_cross_entropy`): one fp32 log-sum-exp and one int64
    label per token, ``12 s b`` bytes, and the logits ``s b V_pad / t`` in the activation dtype
    when they take at most 256 MiB (:func:`~ptdp.engine.tensor_parallel.vocab.keeps_logits`, the
    rule the loss follows; larger, they are recomputed in backward and not kept).
    """
    e, e32 = activation_value_bytes(layout.precision)
    t, tokens, h = layout.tp, layout.micro_batch_size * model.seq_length, model.hidden_size
    shard = t if layout.sequence_parallel else 1
    out = 0.0
    if first and model.dropout:
        out += inflight * tokens * h / shard
    if last:
        local_vocab = padded_vocab_size(model.vocab_size, divisible_by, t) // t
        logits = e * tokens * local_vocab if keeps_logits(tokens, local_vocab, e) else 0
        out += last_inflight * (2.0 * e * tokens * h / shard + (e32 + 8) * tokens + logits)
    return out


def stage_activation_bytes(
    model: ModelSpec,
    layout: Layout,
    pp_rank: int,
    layers_on_stage: int,
    *,
    schedule: str = "1f1b",
    make_vocab_size_divisible_by: int = 128,
) -> float:
    """Peak activation bytes of pipeline rank ``pp_rank`` (one tp rank).

    Stored layer activations x layers on the stage x microbatches in flight
    (:func:`inflight_microbatches`), plus [K22] §4.3's embedding/output/loss terms (the last
    stage's for one microbatch under 1F1B, for all m under GPipe, which runs every forward first).
    With full recompute, the working set of the layer being recomputed and back-propagated is
    added: its activations without recompute minus its input (already among the kept inputs).
    On the last stage that working set and the microbatch's loss-side tensors are not held at
    the same time (the output layer's backward frees the latter before any layer is recomputed),
    so the larger of the two counts. ``make_vocab_size_divisible_by`` sets the padded vocabulary
    whose logits the last stage keeps when they are small enough.
    """
    b, sp, precision = layout.micro_batch_size, layout.sequence_parallel, layout.precision
    per_layer = layer_activation_bytes(
        model, layout.tp, b, sequence_parallel=sp, recompute=layout.recompute, precision=precision
    )
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
            layer_activation_bytes(model, layout.tp, b, sequence_parallel=sp, recompute="none", precision=precision)
            - per_layer
        )
        return out + max(working, loss_side) + (last_inflight - 1) * loss_side
    return out + (last_inflight if loss_mbs is None else loss_mbs) * loss_side


def rank_activation_bytes(
    model: ModelSpec,
    layout: Layout,
    pp_rank: int,
    layers_on_stage: int,
    *,
    schedule: str = "1f1b",
    make_vocab_size_divisible_by: int = 128,
) -> float:
    """Peak activation bytes of one cp rank of pipeline rank ``pp_rank`` (one tp rank).

    :func:`stage_activation_bytes` of the ``s / cp``-token model
    (:func:`ptdp.planner.context.local_model`: every per-token term divided by cp), plus, with
    cp > 1, the kept attention scores' missing ``(cp - 1)`` parts of an unfused kernel (the rank's
    queries see all ``s`` keys) and the key/value exchange buffers of the running layer
    (:func:`ptdp.planner.context.kv_buffer_bytes`). cp = 1 is :func:`stage_activation_bytes`.
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
        sequence_parallel=layout.sequence_parallel,
        precision=layout.precision,
    )
    none, selective = activations(recompute="none"), activations(recompute="selective")
    missing = unfused_score_bytes_missing(none, selective, cp, model.flash_attention)
    if layout.recompute == "none":
        out += missing * layers_on_stage * inflight_microbatches(layout, pp_rank, schedule=schedule)
    elif layout.recompute == "full":
        out += missing  # the one layer recomputed at a time
    e, _ = activation_value_bytes(layout.precision)
    return out + kv_buffer_bytes(model, layout.tp, cp, b, layout.cp_comm_type, e)


# --------------------------------------------------------------------------------------------
# The most loaded GPU
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def mean_stage_params(model: ModelSpec, tp: int, pp: int, divisible_by: int = 128) -> float:
    """Mean parameters per pipeline stage on one tp rank, the same for every split of the layers
    (their sum is; the tied embedding's copy counted with pp > 1): a lower bound of the most
    loaded stage's, whatever the split. ``pp > num_layers``: 0 (no split exists)."""
    layers, rest = divmod(model.num_layers, pp)
    if layers == 0:
        return 0.0
    split = tuple(layers + (rank < rest) for rank in range(pp))
    counts = stage_param_counts(model, tp, pp, make_vocab_size_divisible_by=divisible_by, layer_split=split)
    return sum(counts) / pp


_ACTIVATIONS: dict[tuple, float] = {}


def _rank_activations(model: ModelSpec, layout: Layout, rank: int, n_layers: int, schedule: str, div: int) -> float:
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
        layout.sequence_parallel,
        layout.precision,
        layout.layer_split,
        layout.cp_comm_type,
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


@lru_cache(maxsize=65536)
def _even_stage_params(model: ModelSpec, tp: int, pp: int, divisible_by: int) -> tuple[int, int, int]:
    """(first, last, layers-per-stage) params for an even split; cached per (model, tp, pp)."""
    counts = stage_param_counts(model, tp, pp, make_vocab_size_divisible_by=divisible_by)
    return counts[0], counts[-1], model.num_layers // pp


def memory_breakdown(
    model: ModelSpec,
    layout: Layout,
    gpu: GPUSpec,
    *,
    overhead_bytes: float = DEFAULT_OVERHEAD_BYTES,
    schedule: str = "1f1b",
    make_vocab_size_divisible_by: int = 128,
    layer_split: tuple[int, ...] | None = None,
) -> MemoryBreakdown:
    """Bytes on the most loaded GPU: the pipeline stage with the largest total (``stage``).

    params/grads/optimizer: exact stage parameter count under the sharding strategy over
    ``dp * cp`` ranks, transients included (:func:`rank_state_bytes`; params with
    precision "fp8" also hold the FP8 weight copies, :func:`ptdp.planner.fp8.fp8_weight_copy_bytes`); activations:
    :func:`rank_activation_bytes` (one cp rank); overhead: ``overhead_bytes`` (default
    :data:`DEFAULT_OVERHEAD_BYTES`). ``gpu`` does not change the bytes (it is part of the call for
    symmetry with the time model); the capacity check ``total <= gpu.memory_bytes`` is the
    caller's. ``schedule``: "1f1b" (interleaved when ``layout.virtual_stages > 1``) or "gpipe".

    With an even split only the first and the last stage can be the maximum (the first holds the
    most microbatches in flight and the embedding, the last the output layer and logits; middle
    stages hold no more than the first), so the cost is O(1) in pp. With ``layer_split`` (default:
    ``layout.layer_split``) the first, the last and, for each distinct layer count of the middle
    stages, the lowest-ranked of them are evaluated (a middle stage holds no more microbatches in
    flight than the ones before it, and its parameters depend only on its layers).
    """
    layer_split = layer_split if layer_split is not None else layout.layer_split
    if layer_split is None:
        first_params, last_params, per_stage = _even_stage_params(
            model, layout.tp, layout.pp, make_vocab_size_divisible_by
        )
        candidates = [(0, first_params, per_stage)]
        if layout.pp > 1:
            candidates.append((layout.pp - 1, last_params, per_stage))
    else:
        stage_params = stage_param_counts(
            model,
            layout.tp,
            layout.pp,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            layer_split=layer_split,
        )
        candidates, counts_seen = [], set()
        for rank, (n_params, n_layers) in enumerate(zip(stage_params, layer_split)):
            middle = 0 < rank < layout.pp - 1
            if not middle or n_layers not in counts_seen:
                candidates.append((rank, n_params, n_layers))
            if middle:
                counts_seen.add(n_layers)
    rows = []
    per_param = strategy_bytes_per_param(layout.precision, layout.sharding_strategy, layout.shard_size)
    per_param_total = sum(per_param)
    transients = layout.shard_size > 1 and layout.sharding_strategy in ("optim_grads", "optim_grads_params")
    for rank, n_params, n_layers in candidates:
        act = _rank_activations(model, layout, rank, n_layers, schedule, make_vocab_size_divisible_by)
        fp8_copies = fp8_weight_copy_bytes(model, layout.tp, n_layers, layout.precision)
        state = sum(rank_state_bytes(model, layout, n_params, n_layers)) if transients else n_params * per_param_total
        rows.append((state + fp8_copies + act, rank, n_params, n_layers, act, fp8_copies))
    _, rank, n_params, n_layers, act, fp8_copies = max(rows, key=lambda row: row[0])  # the first largest
    params, grads, optimizer = rank_state_bytes(model, layout, n_params, n_layers, per_param)
    return MemoryBreakdown(
        params=params + fp8_copies,
        grads=grads,
        optimizer=optimizer,
        activations=act,
        overhead=float(overhead_bytes),
        stage=rank,
    )
