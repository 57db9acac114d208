"""Parameters of mixture-of-experts layers, exactly as ``ptdp train`` creates them
(:class:`ptdp.engine.moe.layer.MoELayer`): per rank of the expert grid, and total and active per
token.

An MoE layer is a transformer layer whose MLP is the router ``[E, h]`` (replicated), ``E`` routed
experts each an MLP of width ``F`` (GELU: fc1 ``[F, h]``, fc2 ``[h, F]``; SwiGLU: fc1 ``[2F, h]``;
biases ``[F]`` or ``[2F]`` and ``[h]`` when the model has linear biases), split ``E / ep`` per rank
and each over ``etp`` ranks, and an optional shared expert, a dense MLP of width ``S`` split over
tp as the dense MLP. A token passes through ``k`` routed experts and the shared one.
"""

from __future__ import annotations

from functools import lru_cache

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.layout.pipeline.partition import PipelineSplit
from ptdp.layout.pipeline.placement import placement_of
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.moe_model import MoEModel, moe_of
from ptdp.planner.memory.params import layer_param_count, loss_rank, stage_param_counts
from ptdp.planner.memory.strategies import strategy_bytes_per_param


def mlp_param_count(model: ModelConfig, width: int, tp: int = 1, biases: tuple[str, ...] | None = None) -> int:
    """One MLP of inner width ``width`` on one of ``tp`` ranks: its weights, and the biases of those
    of ``fc1``/``fc2`` in ``biases`` (default: both when the model has linear biases, as
    ``ptdp train``'s MLPs and experts)."""
    biases = ("fc1", "fc2") if biases is None and model.add_bias_linear else biases or ()
    halves = 2 if model.swiglu else 1
    weights = (halves + 1) * width * model.hidden_size // tp
    return weights + (halves * width // tp if "fc1" in biases else 0) + (model.hidden_size if "fc2" in biases else 0)


def expert_param_count(model: ModelConfig, moe: MoEConfig, etp: int = 1) -> int:
    """One routed expert on one of ``etp`` ranks (its biases: fc1's split, fc2's on every rank)."""
    return mlp_param_count(model, moe.expert_ffn(model.ffn), etp)


def moe_layer_param_counts(
    model: ModelConfig, moe: MoEConfig, tp: int = 1, ep: int = 1, etp: int = 1
) -> tuple[int, int]:
    """``(dense, experts)`` parameters of one MoE layer on one rank: the attention, norms, router
    and shared expert (over tp), and the rank's ``E / ep`` routed experts (each over etp)."""
    dense_mlp = mlp_param_count(model, model.ffn, tp, model.linears_with_bias)  # as layer_param_count
    attention_and_norms = layer_param_count(model, tp) - dense_mlp
    shared = mlp_param_count(model, moe.shared_ffn, tp) if moe.shared_ffn else 0
    router = (moe.num_experts or 0) * model.hidden_size
    experts = (moe.num_experts or 0) // ep * expert_param_count(model, moe, etp)
    return attention_and_norms + router + shared, experts


def model_param_counts(model: ModelConfig, moe: MoEConfig) -> tuple[int, int]:
    """``(total, active)`` parameters of the whole model (one process): every weight, and those a
    token passes through (``k`` routed experts per MoE layer, the rest whole). The word embedding
    (padded vocabulary, ``make_vocab_size_divisible_by``) counts in both, the untied output layer
    too, as ``ptdp train`` holds them."""
    h = model.hidden_size
    v_pad = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, 1)
    outside = v_pad * h + (model.seq_length * h if model.has_position_table else 0)
    outside += (h if model.uses_rmsnorm else 2 * h) + (0 if model.tied else v_pad * h)
    dense_layer = layer_param_count(model, 1)
    total = active = outside + mtp_extra_params(model)
    expert = expert_param_count(model, moe) if moe.enabled else 0
    for is_moe in moe.moe_layers(model.num_layers):
        if not is_moe:
            total += dense_layer
            active += dense_layer
            continue
        rest, experts = moe_layer_param_counts(model, moe)
        total += rest + experts
        active += rest + moe.moe_router_topk * expert
    return total, active


def stage_moe_params(
    model: ModelConfig, moe: MoEConfig, layer_ids: list[int], tp: int = 1, ep: int = 1, etp: int = 1
) -> tuple[int, int]:
    """``(change, experts)`` for one rank of a stage holding the layers ``layer_ids``: what its
    MoE layers' attention, router and shared expert add to the dense count of
    :func:`~ptdp.planner.memory.params.stage_param_counts` (their dense MLPs replaced; may be
    negative), and the routed experts it holds."""
    moe_layers = moe.moe_layers(model.num_layers)
    n = sum(moe_layers[i] for i in layer_ids)
    rest, experts = moe_layer_param_counts(model, moe, tp, ep, etp)
    return n * (rest - layer_param_count(model, tp)), n * experts


def mtp_extra_params(model: ModelConfig, tp: int = 1, pp: int = 1, divisible_by: int = 128) -> int:
    """Parameters of a planned model's multi-token-prediction modules beyond their layers (counted as
    layers), on one rank of the last stage: each a ``[h, 2h]`` projection split over tp and two
    RMSNorms of h, and with pp > 1 a copy of the word embedding the modules look their tokens up in
    (Megatron-Core builds one on the MTP stage; the output layer is the model's)."""
    n = model.mtp_layers if isinstance(model, MoEModel) else 0
    if not n:
        return 0
    h = model.hidden_size
    embedding = padded_vocab_size(model.vocab_size, divisible_by, tp) // tp * h if pp > 1 else 0
    return n * (2 * h * h // tp + 2 * h) + embedding


@lru_cache(maxsize=65536)
def stage_counts(
    model: ModelConfig,
    tp: int,
    pp: int,
    ep: int = 1,
    etp: int = 1,
    layer_split: tuple[int, ...] | None = None,
    divisible_by: int = 128,
    v: int = 1,
    counted: tuple[bool, bool] = (False, False),
    placement: str = "looped",
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per pipeline stage, one rank's ``(parameters in the dense gradient buffer, routed experts in
    their own buffer)``: :func:`~ptdp.planner.memory.params.stage_param_counts` with each MoE layer's
    MLP counted as :func:`moe_layer_param_counts` (the experts in the dense buffer at ep = etp = 1,
    as ``ptdp train`` keeps them) and what the multi-token-prediction modules add on the last stage
    (:func:`mtp_extra_params`). A stage's layers are those of its ``v`` model chunks
    (:class:`~ptdp.layout.pipeline.partition.PipelineSplit` of ``layer_split``, the embedding and
    the loss ``counted`` as layers or not, on the chunks' ``placement``)."""
    dense = stage_param_counts(
        model, tp, pp, make_vocab_size_divisible_by=divisible_by, layer_split=layer_split, placement=placement
    )
    dense[loss_rank(pp, placement)] += mtp_extra_params(model, tp, pp, divisible_by)
    moe = moe_of(model)
    if moe is None:
        return tuple(dense), (0,) * pp
    split = PipelineSplit(model.num_layers, pp, v, layer_split, *counted, placement=placement)
    own = [0] * pp
    folded = ep * etp == 1
    for stage in range(pp):
        ids = [i for c in range(v) for i in split.chunk_layer_ids(stage, c)]
        change, experts = stage_moe_params(model, moe, ids, tp, ep, etp)
        dense[stage] += change + (experts if folded else 0)
        own[stage] = 0 if folded else experts
    return tuple(dense), tuple(own)


def layout_stage_counts(
    model: ModelConfig, layout: Candidate, layer_split: tuple[int, ...] | None, divisible_by: int = 128
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`stage_counts` of ``layout``'s pipeline (its v chunks, the embedding and the loss
    counted as layers as it says) with ``layer_split`` as the split."""
    p = layout.parallel
    counted = (p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
    return stage_counts(
        model,
        p.tp,
        p.pp,
        p.ep,
        p.etp,
        layer_split,
        divisible_by,
        layout.virtual_stages,
        counted,
        placement_of(p.schedule),
    )


def expert_bytes_per_param(precision: str, parallel: ParallelConfig) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter of the experts' own buffer (ep or etp > 1):
    weights and gradients whole on the rank, Adam state over the edp ranks with any sharding
    strategy (ZeRO-1)."""
    p = parallel
    edp = p.tp * p.cp * p.dp // (p.ep * p.etp)
    strategy = "optim" if p.sharding_strategy != "no_shard" else "no_shard"
    return strategy_bytes_per_param(precision, strategy, edp, bf16_grads=p.grad_reduce_in_bf16)
