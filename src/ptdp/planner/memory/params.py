"""Parameters and their state on one GPU: parameter counts per stage, bytes per parameter, and the
params / grads / optimizer bytes of a rank under its sharding strategy.

All results are for ONE tensor-parallel rank of a pipeline stage. Parameters are counted exactly
from the shapes ptdp's :class:`ptdp.engine.model.gpt.GPTModel` creates. Sources: [N21] Narayanan et
al., SC21, arXiv:2104.04473; [K22] Korthikanti et al., arXiv:2205.05198; Micikevicius et al. 2018
(mixed precision).
"""

from __future__ import annotations

from functools import lru_cache

from ptdp.config.model import ModelConfig
from ptdp.layout.buckets import chunk_by_chunk, chunk_rounds
from ptdp.layout.pipeline.partition import stage_layer_counts
from ptdp.layout.pipeline.placement import placement_of, stage_owner
from ptdp.layout.pipeline.schedule import SPLIT_ORDERS
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.moe_model import MoEModel
from ptdp.planner.memory.chunk_params import stage_chunks
from ptdp.planner.memory.strategies import DEFAULT_BUCKET_ELEMENTS, stage_state_bytes
from ptdp.planner.memory.transients import rank_transients


@lru_cache(maxsize=4096)
def layer_param_count(model: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one tp rank.

    GPT: 2 LayerNorms (4h, replicated), QKV ``[3h/tp, h]`` + bias, proj ``[h, h/tp]`` + bias ``[h]``,
    fc1 ``[ffn/tp, h]`` + bias, fc2 ``[h, ffn/tp]`` + bias ``[h]``. Llama-style: 2 RMSNorm weights (2h),
    QKV ``[(a + 2 kv) d / tp, h]``, proj ``[h, a d / tp]``, SwiGLU ``3 * [ffn/tp, h]``, no biases
    (``d``: ``kv_channels``, else h / a). ``qk_layernorm``: 2 norms of d (replicated). Mixed models
    add each part on its own; a bias is as wide as its layer's output on this rank. A planned model
    with multi-head latent attention counts it (:class:`~ptdp.planner.inputs.moe_model.MLA`) instead
    of QKV and the projection. A dense layer: MoE layers are :mod:`ptdp.planner.memory.moe_params`'.
    """
    h, a, d = model.hidden_size, model.num_attention_heads, model.head_dim
    q, kv, ffn = a * d, model.kv_heads * d, model.ffn
    mats = 3 if model.swiglu else 2
    weights = (q + 2 * kv) * h // tp + q * h // tp + mats * ffn * h // tp
    per_norm = 1 if model.uses_rmsnorm else 2  # weight, and LayerNorm's bias
    norms = per_norm * (2 * h + (2 * d if model.qk_layernorm else 0))
    widths = {"qkv": (q + 2 * kv) // tp, "proj": h, "fc1": (mats - 1) * ffn // tp, "fc2": h}
    biases = sum(widths[name] for name in model.linears_with_bias)
    mla = model.mla if isinstance(model, MoEModel) else None
    if mla is not None:  # multi-head latent attention in place of QKV and the projection
        weights += mla.param_count(h, a, tp) - ((q + 2 * kv) * h // tp + q * h // tp)
    return weights + biases + norms


def stage_param_counts(
    model: ModelConfig,
    tp: int,
    pp: int,
    *,
    make_vocab_size_divisible_by: int = 128,
    layer_split: tuple[int, ...] | None = None,
    placement: str = "looped",
) -> list[int]:
    """Parameters held by one tp rank of each of the ``pp`` pipeline ranks (exact).

    First stage: word embedding ``[V_pad/tp, h]`` (V rounded up to a multiple of
    ``make_vocab_size_divisible_by * tp``) and, for GPT, positions ``[s, h]``. Last stage: the final norm
    and the output weight ``[V_pad/tp, h]`` (untied, or tied on another rank than the first stage's).
    ``layer_split`` lists layers per stage (None: even). The last stage is on rank pp - 1, or with
    the V ``placement`` on rank 0 beside the first (:mod:`ptdp.layout.pipeline.placement`), where a
    tied output weight is the embedding itself (one parameter of both chunks). Raises
    ``ConfigError`` for an impossible split.
    """
    counts = stage_layer_counts(model.num_layers, pp, layer_split)
    h = model.hidden_size
    v_pad = padded_vocab_size(model.vocab_size, make_vocab_size_divisible_by, tp)
    embedding = v_pad // tp * h
    per_layer = layer_param_count(model, tp)
    first = embedding + (model.seq_length * h if model.has_position_table else 0)
    at = loss_rank(pp, placement)
    last = (h if model.uses_rmsnorm else 2 * h) + (embedding if (not model.tied or at != 0) else 0)
    out = [n * per_layer for n in counts]
    out[0] += first
    out[at] += last
    return out


def loss_rank(pp: int, placement: str = "looped") -> int:
    """The pipeline rank holding the last stage (the output layer and the loss): pp - 1, or 0 on
    the V placement."""
    return stage_owner(2 * pp - 1, pp, placement)[0]


def bytes_per_param(precision: str, dp: int = 1, distributed_optimizer: bool = False) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter with Adam.

    bf16/fp16/fp8 [N21, K22; Micikevicius et al. 2018]: 2 (weights) + 4 (fp32 main gradients) + 12 (fp32
    main weights, Adam m and v) = 18; distributed optimizer (ZeRO-1): 6 + 12/dp. fp32: 4 + 4 + 8 = 16;
    distributed: 8 + 8/dp. Raises ValueError for another precision.
    """
    if precision in ("bf16", "fp16", "fp8"):
        weights, grads, state = 2.0, 4.0, 12.0
    elif precision == "fp32":
        weights, grads, state = 4.0, 4.0, 8.0
    else:
        raise ValueError(f"precision={precision!r} must be one of bf16, fp16, fp8, fp32")
    return weights, grads, (state / dp if distributed_optimizer else state)  # sharding strategies: rank_state_bytes


def rank_state_bytes(
    model: ModelConfig,
    layout: Candidate,
    n_params: int,
    n_layers: int,
    per_param: tuple[float, float, float] | None = None,
    *,
    stage: int,
    divisible_by: int = 128,
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of one rank of pipeline stage ``stage`` holding ``n_params``
    parameters and ``n_layers`` layers under ``layout``'s sharding strategy over ``dp * cp`` ranks
    (:func:`ptdp.planner.memory.strategies.stage_state_bytes`), with the peak transients of
    ``optim_grads`` / ``optim_grads_params`` (:func:`ptdp.planner.memory.transients.rank_transients`).
    ``divisible_by``: the vocabulary padding; ``per_param``: the strategy's bytes per parameter, if known.
    """
    strategy, shard = layout.sharding_strategy, layout.shard_size
    if shard == 1 or strategy in ("no_shard", "optim"):  # no transients
        if per_param is not None:
            return n_params * per_param[0], n_params * per_param[1], n_params * per_param[2]
        return stage_state_bytes(
            n_params, layout.precision, strategy, shard, bf16_grads=layout.bf16_grads, optimizer=layout.optimizer_state
        )
    params, grads = stage_transients(model, layout, stage, n_layers, divisible_by)
    return stage_state_bytes(
        n_params,
        layout.precision,
        strategy,
        shard,
        params_transient=params,
        grads_transient=grads,
        bf16_grads=layout.bf16_grads,
        optimizer=layout.optimizer_state,
    )


def stage_transients(
    model: ModelConfig, layout: Candidate, stage: int, n_layers: int, divisible_by: int = 128
) -> tuple[int, int]:
    """(gathered parameter elements, gradient bucket elements) at their peaks on a rank of pipeline
    stage ``stage`` under ``layout``'s ``optim_grads`` / ``optim_grads_params`` sharding
    (:func:`ptdp.planner.memory.transients.rank_transients`); (0, 0) for the other strategies or
    ``dp * cp`` = 1. ``divisible_by``: the vocabulary padding.
    """
    strategy, shard = layout.sharding_strategy, layout.shard_size
    if shard == 1 or strategy not in ("optim_grads", "optim_grads_params"):
        return 0, 0
    return _stage_transients(
        model,
        layout.tp,
        layout.pp,
        layout.virtual_stages,
        stage,
        n_layers,
        shard,
        layout.parallel.ddp_bucket_size or DEFAULT_BUCKET_ELEMENTS,
        layout.parallel.overlap_grad_reduce,
        strategy == "optim_grads_params",
        layout.parallel.reshard_after_forward,
        divisible_by,
        chunk_by_chunk(strategy, shard, layout.virtual_stages, layout.num_microbatches, layout.pp),
        layout.precision != "fp32",  # 16-bit weights: float32 main gradients
        chunk_rounds(layout.num_microbatches, layout.pp),
        layout.parallel.schedule in SPLIT_ORDERS,
        placement_of(layout.parallel.schedule),
        layout.ep * layout.etp == 1,  # the routed experts in this buffer (else their own)
    )


@lru_cache(maxsize=65536)
def _stage_transients(
    model: ModelConfig,
    tp: int,
    pp: int,
    v: int,
    stage: int,
    n_layers: int,
    shard: int,
    bucket: int,
    overlap: bool,
    params_sharded: bool,
    reshard: bool,
    divisible_by: int,
    by_chunk: bool,
    main_grad: bool,
    rounds: int = 1,
    whole_step: bool = False,
    placement: str = "looped",
    experts: bool = False,
) -> tuple[int, int]:
    """:func:`~ptdp.planner.memory.transients.rank_transients` of pipeline rank ``stage`` (its ``v``
    model chunks sharing its ``n_layers`` layers, placed by ``placement``); cached on plain numbers
    for the search. ``whole_step``: B and W apart, every bucket kept from its first B to the W
    completing its chunk (``GradBuffer.begin_backwards`` with ``split``); ``experts``: an MoE
    layer's routed experts in the dense buffer (ep = etp = 1)."""
    chunks = stage_chunks(model.num_layers, pp, v, stage, n_layers, placement)
    return rank_transients(
        model,
        tp,
        pp,
        chunks,
        shard,
        bucket,
        overlap=overlap,
        params_sharded=params_sharded,
        reshard=reshard,
        divisible_by=divisible_by,
        by_chunk=by_chunk,
        main_grad=main_grad,
        rounds=rounds,
        whole_step=whole_step,
        experts=experts,
    )


@lru_cache(maxsize=4096)
def mean_stage_params(model: ModelConfig, tp: int, pp: int, divisible_by: int = 128) -> float:
    """Mean parameters per pipeline stage on one tp rank, the same for every split of the layers
    (their sum is; the tied embedding's copy counted with pp > 1): a lower bound of the most
    loaded stage's, whatever the split. ``pp > num_layers``: 0 (no split exists)."""
    layers, rest = divmod(model.num_layers, pp)
    if layers == 0:
        return 0.0
    split = tuple(layers + (rank < rest) for rank in range(pp))
    counts = stage_param_counts(model, tp, pp, make_vocab_size_divisible_by=divisible_by, layer_split=split)
    return sum(counts) / pp


@lru_cache(maxsize=65536)
def even_stage_params(
    model: ModelConfig, tp: int, pp: int, divisible_by: int, placement: str = "looped"
) -> tuple[int, int, int]:
    """(rank 0's, rank pp - 1's, layers-per-stage) params for an even split; cached per (model, tp, pp)."""
    counts = stage_param_counts(model, tp, pp, make_vocab_size_divisible_by=divisible_by, placement=placement)
    return counts[0], counts[-1], model.num_layers // pp
