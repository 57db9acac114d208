"""What an MoE layer's MLP and multi-head latent attention keep for backward, per micro-batch on one
rank, beside the dense layer of :func:`ptdp.planner.memory.activations.layer_activation_bytes`.

An MoE layer routes the ``T'`` tokens its rank holds (``b s / (cp t)`` with sequence parallelism,
which MoE needs at tp > 1), sends its ``k T'`` assignments to their experts and receives ``rho k T'``
rows (``rho``: the load on the busiest rank over the mean, ``--moe-load-imbalance``, at most the
capacity factor when one is given, and exactly it when inputs are padded to the capacity); with
etp > 1 each rank gathers its etp peers' rows and runs its ``F / etp`` columns on them.
"""

from __future__ import annotations

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.planner.inputs.moe_model import MLA


def moe_mlp_activation_bytes(
    model: ModelConfig,
    moe: MoEConfig,
    tokens: int,
    *,
    precision_bytes: int,
    router_bytes: int = 4,
    etp: int = 1,
    load: float = 1.0,
    modules: tuple[str, ...] = (),
    gemm_bytes: float | None = None,
) -> float:
    """Bytes an MoE layer's MLP keeps for backward (``ptdp train``'s MoE layer, one micro-batch) on a
    rank routing ``tokens``, dropless or within the capacity, ``A = k tokens`` assignments sent and
    ``load A`` rows received. Its input is the norm's output, counted with the attention.

    Per token, in the router's dtype (``router_bytes``): the logits and scores (sigmoid: the scores and their two sums), the
    balancing loss's counts, the z-loss's log-sum-exp (and with sigmoid scores the logits). Per
    assignment: its top-k index and weight (and a copy in the activation dtype when another or
    renormalised), the combined output ``h`` and the two int64 indices that place the rows. Per
    received row: the expert's input (``etp h``: the etp peers' rows gathered), fc1's output of its
    ``F`` columns (the activation's input: ``F``, SwiGLU's gate and up ``2 F``) and fc2's input
    (``F``). ``gemm_bytes`` (default ``precision_bytes``; 1 with FP8 GEMMs): bytes of a kept GEMM
    input. ``modules`` (Megatron-Core's ``--recompute-modules``): ``moe_act`` drops fc2's input,
    ``moe`` everything (the layer runs again). The shared expert is
    :func:`shared_expert_activation_bytes`.
    """
    if "moe" in modules:
        return 0.0
    e, r, h = precision_bytes, router_bytes, model.hidden_size
    k, experts = moe.moe_router_topk, moe.num_experts or 0
    ffn, halves = moe.expert_ffn(model.ffn), 2 if model.swiglu else 1
    other = e != r
    sigmoid = moe.moe_router_score_function == "sigmoid"
    per_token = r * experts + 2 * r if sigmoid else 2 * r * experts
    per_token += r * experts if moe.moe_aux_loss_coeff else 0
    per_token += (r + (r * experts if sigmoid else 0)) if moe.moe_z_loss_coeff else 0  # sigmoid: the logits too
    copied = other or sigmoid or moe.moe_router_topk_scaling_factor is not None
    per_assignment = 8 + r + (e if copied else 0) + 2 * 8 + e * h
    g = precision_bytes if gemm_bytes is None else gemm_bytes
    per_row = g * etp * h + e * halves * ffn + (0 if "moe_act" in modules else g * ffn)
    return tokens * per_token + k * tokens * (per_assignment + load * per_row)


def shared_expert_activation_bytes(
    model: ModelConfig, moe: MoEConfig, tokens: int, tp: int, *, precision_bytes: int, modules: tuple[str, ...] = ()
) -> float:
    """Bytes the shared expert keeps (a dense MLP of width ``S`` over tp on the ``tokens`` of the
    micro-batch's sequence): fc1's output (SwiGLU: both halves) and fc2's input, ``/ tp``; nothing
    with ``shared_experts`` or ``moe`` recomputed."""
    if not moe.shared_ffn or {"shared_experts", "moe"} & set(modules):
        return 0.0
    halves = 2 if model.swiglu else 1
    return precision_bytes * tokens * (halves + 1) * moe.shared_ffn / tp


def dense_mlp_activation_bytes(
    model: ModelConfig, tokens: int, tp: int, *, precision_bytes: int, gemm_bytes: float
) -> float:
    """The dense MLP's share of :func:`~ptdp.planner.memory.activations.layer_activation_bytes` without
    recompute (fc1's output, fc2's input), what an MoE layer does not keep."""
    halves = 2 if model.swiglu else 1
    return tokens * (precision_bytes * halves * model.ffn + gemm_bytes * model.ffn) / tp


def mla_activation_change(
    model: ModelConfig,
    mla: MLA,
    tokens: int,
    tp: int,
    *,
    precision_bytes: int,
    gemm_bytes: float,
    modules: tuple[str, ...] = (),
) -> float:
    """Bytes by which multi-head latent attention keeps more (or less) than the grouped-query
    attention of ``model``'s shape, per micro-batch of ``tokens`` on one tp rank: the latents (not
    split over tp) and the heads of :meth:`MLA.saved_widths` in place of Q, K, V and the projection's
    input. ``mla_up_proj`` recomputed: the heads are not kept (the latents are)."""
    a, d, kv = model.num_attention_heads, model.head_dim, model.attended_kv_heads
    dense = (precision_bytes * (a * d + 2 * kv * d) + gemm_bytes * a * d) / tp
    latents = 2 * ((mla.q_lora_rank or 0) + mla.kv_lora_rank) + mla.qk_rope_head_dim
    heads = 0 if "mla_up_proj" in modules else a * (2 * mla.qk_head_dim + 2 * mla.v_head_dim) / tp
    return tokens * (precision_bytes * (latents + heads) - dense)
