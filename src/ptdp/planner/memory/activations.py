"""Activation memory of one GPU: the bytes a pipeline rank keeps for backward at its peak.

All results are bytes on ONE tensor-parallel (and context-parallel) rank of a pipeline stage.
Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473; [K22] Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", arXiv:2205.05198.

Activations follow [K22] §4 (16-bit activations, 1-byte dropout masks), generalised
term by term to grouped-query attention, SwiGLU, models without dropout and fused (flash)
attention (see :func:`layer_activation_bytes`), times the microbatches (or model chunks) a
pipeline rank holds at its peak (:func:`inflight_microbatches`). For ptdp's own GPT
(:func:`ptdp.planner.inputs.models.spec_from_model_config`) ``tests/dist/test_planner_activations.py`` checks
the peak against the bytes autograd really saves (:mod:`ptdp.engine.activation_meter`). The whole
memory model is :mod:`ptdp.planner.memory.breakdown`.
"""

from __future__ import annotations

from functools import lru_cache, partial

from ptdp.config.model import ModelConfig
from ptdp.layout.vocab import keeps_logits, padded_vocab_size
from ptdp.planner.candidate import Candidate
from ptdp.planner.memory.cp_local import kv_buffer_bytes, local_model, unfused_score_bytes_missing
from ptdp.planner.splits import chunk_layers, interleaved_peak

SCHEDULES = ("1f1b", "gpipe")


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
    model: ModelConfig,
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
      2 dropout masks (2h, 1 byte each; 0 when ``model.has_dropout`` is False);
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
    :mod:`ptdp.planner.memory.fp8`): the inputs of the four FP8 GEMMs are kept in FP8, 1 byte each (the
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
    mask = 1 if model.has_dropout else 0
    replicated = (2 * e + 2 * g + 2 * mask) * h
    mlp = (2 if model.swiglu else 1) * model.ffn  # fc1 output: GELU input, or SwiGLU's gate and up halves
    split = e * (a * d + 2 * kv * d + mlp) + g * (a * d + model.ffn)
    per_token = replicated / (t if sequence_parallel else 1) + split / t
    if model.flash_attention:
        per_token += e32 * a / t
    elif recompute == "none":
        per_token += (e + (mask + e) * mask) * a * s / t
    return tokens * per_token


def inflight_microbatches(layout: Candidate, pp_rank: int, *, schedule: str = "1f1b") -> float:
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
    layout: Candidate, pp_rank: int, layers_on_stage: int, *, schedule: str = "1f1b", loss_weight: float = 0.0
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

    First stage: the embedding-dropout mask, ``s b h`` per microbatch in flight (/t with SP; none
    without dropout). Last stage, per microbatch whose loss is in flight (``last_inflight``: 1 for
    1F1B, m for GPipe): final-norm input and output-layer input, ``2 s b h`` values (/t with SP),
    and what the chunked output layer + cross entropy keeps besides its input
    (:mod:`ptdp.engine.tensor_parallel.linear_cross_entropy`): one fp32 log-sum-exp and one int64
    label per token, ``12 s b`` bytes, and the logits ``s b V_pad / t`` in the activation dtype
    when they take at most 256 MiB (:func:`~ptdp.layout.vocab.keeps_logits`, the
    rule the loss follows; larger, they are recomputed in backward and not kept).
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
    b, sp, precision = layout.micro_batch_size, layout.parallel.sequence_parallel, layout.precision
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
    model: ModelConfig,
    layout: Candidate,
    pp_rank: int,
    layers_on_stage: int,
    *,
    schedule: str = "1f1b",
    make_vocab_size_divisible_by: int = 128,
) -> float:
    """Peak activation bytes of one cp rank of pipeline rank ``pp_rank`` (one tp rank).

    :func:`stage_activation_bytes` of the ``s / cp``-token model
    (:func:`ptdp.planner.memory.cp_local.local_model`: every per-token term divided by cp), plus, with
    cp > 1, the kept attention scores' missing ``(cp - 1)`` parts of an unfused kernel (the rank's
    queries see all ``s`` keys) and the key/value exchange buffers of the running layer
    (:func:`ptdp.planner.memory.cp_local.kv_buffer_bytes`). cp = 1 is :func:`stage_activation_bytes`.
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
    )
    none, selective = activations(recompute="none"), activations(recompute="selective")
    missing = unfused_score_bytes_missing(none, selective, cp, model.flash_attention)
    if layout.recompute == "none":
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
        layout.parallel.sequence_parallel,
        layout.precision,
        layout.layer_split,
        layout.parallel.cp_comm_type,
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
