"""Time of a mixture-of-experts layer's MLP and of multi-head latent attention, per micro-batch on one
rank, as changes to the dense layer of :func:`ptdp.planner.time.flops.layer_compute_times`.

An MoE layer (the tokens and rows of :mod:`ptdp.planner.memory.moe_activations`): the router GEMM
``(T', E, h)`` and its scores, the permutation of the ``k T'`` assignments into expert order and back
(memory-bound), the experts' GEMMs on the ``rho k T' etp`` rows the rank computes, ``E / ep`` groups
of ``m = rho k T' ep etp / E`` rows each, fc1 ``(m, n F / etp, h)`` and fc2 ``(m, h, F / etp)`` at the
roofline of :func:`~ptdp.planner.time.flops.gemm_time` times ``moe_grouped_gemm_efficiency`` (a grouped
GEMM of many small groups loses to one large GEMM; the roofline's ``half_dim`` already slows thin
groups), their activation, and the shared expert, a dense MLP over tp. Backward: 2 x the GEMMs and
:data:`~ptdp.planner.time.flops.BACKWARD_TRAFFIC_RATIO` x the memory-bound bytes.

The exchange (:mod:`ptdp.planner.time.moe_exchange`'s bytes): four all-to-alls of ``k T' h`` elements
over ep per layer and micro-batch (dispatch and combine, forward and backward; six when the forward
runs again in a recompute), each rank receiving ``rho`` times its share; with etp > 1 four more over
etp of ``etp`` times that; the allgather dispatcher gathers and reduce-scatters ``ep etp k T' h``
instead. An exchange inside a node runs over NVLink; a group spanning nodes sends the share of its
peers in other nodes over the network at the same time (:func:`exchange_time`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

from ptdp.config.model import ModelConfig
from ptdp.planner.inputs.moe_model import MoEModel, moe_of
from ptdp.planner.time.collectives import Links
from ptdp.planner.time.flops import (
    BACKWARD_TRAFFIC_RATIO,
    FFN_BYTES_GELU,
    FFN_BYTES_SWIGLU,
    gemm_time,
)

#: Bytes per element of an assignment's ``h``-wide row moved by the permutation in the forward: the
#: dispatch's gather (read 2, write 2), the combine's scatter and weighted sum (read 2 and 2, write 2),
#: about 10; the router's scores, top-k and softmax read and write ``E`` fp32 values per token about
#: four times, :data:`ROUTER_BYTES` per score.
PERMUTE_BYTES = 10.0
ROUTER_BYTES = 16.0


@dataclass(frozen=True)
class SublayerTimes:
    """Seconds one layer's sub-layers add to the dense layer's, per micro-batch on one rank (a mean
    over the model's layers): ``forward`` / ``backward`` compute, ``recompute`` the compute the
    selective ``--recompute-modules`` of MoE and MLA run again, ``exchange`` the all-to-alls of the
    forward and backward and ``exchange_again`` those a recompute runs again."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    exchange: float = 0.0
    exchange_again: float = 0.0


def exchange_time(nbytes: float, group: int, links: Links, *, receive: float = 1.0, efficiency: float = 1.0) -> float:
    """Seconds of an all-to-all in which each of ``group`` consecutive ranks sends ``nbytes`` (spread
    evenly over the group) and receives ``receive`` times as much: the share for peers in its node
    over NVLink and the share for other nodes over its NIC at once (the slower decides), at
    ``efficiency`` of the links' bandwidth, one latency per peer node plus one."""
    if group <= 1:
        return 0.0
    per_node = min(group, links.gpus_per_node)
    moved = nbytes * max(1.0, receive)
    inside = moved * (per_node - 1) / group / (links.nvlink_bandwidth * efficiency)
    outside = moved * (group - per_node) / group / (links.network_bandwidth * efficiency)
    nodes = -(-group // per_node)
    latency = links.nvlink_latency + (nodes - 1) * links.network_latency
    return max(inside, outside) + latency


def experts_gemm_time(experts: int, rows: int, hidden: int, fc1_width: int, ffn: int, gemms) -> float:
    """Seconds of the forward GEMMs of a rank's ``experts`` experts, ``rows`` rows each, one GEMM per
    expert at the roofline: fc1 ``(rows, fc1_width, hidden)`` and fc2 ``(rows, hidden, ffn)``;
    ``gemms(m, n, k, batch)`` is :func:`~ptdp.planner.time.flops.gemm_time` with the device's
    rates. The grouped GEMM runs at ``moe_grouped_gemm_efficiency`` of this."""
    return experts * (gemms(rows, fc1_width, hidden, 1) + gemms(rows, hidden, ffn, 1))


def moe_exchange_times(
    model: MoEModel, tokens: int, ep: int, etp: int, dispatcher: str, links: Links, elem: float, efficiency: float
) -> float:
    """Seconds of one MoE layer's exchanges (forward and backward) for one micro-batch of a rank
    routing ``tokens``: four over ep (or four gathers / reduce-scatters over ``ep etp`` with the
    allgather dispatcher) and, with etp > 1, four over etp (module docstring)."""
    moe = model.moe
    rows = moe.moe_router_topk * tokens
    if moe.moe_pad_expert_input_to_capacity and moe.moe_expert_capacity_factor:
        rows = int(moe.moe_expert_capacity_factor * rows)
    one = elem * rows * model.hidden_size
    rho = model.expert_load
    if dispatcher == "allgather":
        group = ep * etp
        return 4.0 * exchange_time((group - 1) * one, group, links, efficiency=efficiency) if group > 1 else 0.0
    out = 4.0 * exchange_time(one, ep, links, receive=rho, efficiency=efficiency) if ep > 1 else 0.0
    if etp > 1:
        out += 4.0 * exchange_time(etp * one * rho, etp, links, efficiency=efficiency)
    return out


@lru_cache(maxsize=65536)
def sublayer_times(
    model: ModelConfig,
    tp: int,
    cp: int,
    ep: int,
    etp: int,
    micro_batch_size: int,
    sequence_parallel: bool,
    dispatcher: str,
    modules: tuple[str, ...],
    full_recompute: bool,
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
    grouped_efficiency: float,
    exchange_efficiency: float,
    links: Links,
    elem: float,
    fp8_peak: float = 0.0,
) -> SublayerTimes:
    """:class:`SublayerTimes` of a planned MoE / MLA model on one rank (a mean over its layers);
    zeros for a dense model. ``modules``: the selective ``--recompute-modules``; ``full_recompute``:
    every layer's forward runs again (its exchanges too)."""
    if not isinstance(model, MoEModel):
        return SublayerTimes()
    weight_peak = fp8_peak or peak_flops
    weight_bytes = 1.0 if fp8_peak else elem
    timed = partial(gemm_time, bandwidth=bandwidth, peak_fraction=peak_fraction, half_dim=half_dim)
    gemms = partial(timed, peak_flops=weight_peak, bytes_per_element=weight_bytes)
    s = model.seq_length // cp
    tokens, h = micro_batch_size * s, model.hidden_size
    halves = 2 if model.swiglu else 1
    ffn_bytes = FFN_BYTES_SWIGLU if model.swiglu else FFN_BYTES_GELU
    forward = backward = recompute = exchange = again = 0.0
    if model.mla is not None:
        d, a, kv = model.head_dim, model.num_attention_heads, model.kv_heads
        dense = gemms(tokens, (a + 2 * kv) * d // tp, h, 1) + gemms(tokens, h, a * d // tp, 1)
        mla = sum(gemms(m, n, k, 1) for m, n, k in _mla_weight_gemms(model, tokens, tp))
        up = sum(gemms(m, n, k, 1) for m, n, k in _mla_weight_gemms(model, tokens, tp, up_only=True))
        forward += mla - dense
        backward += 2.0 * (mla - dense)
        if "mla_up_proj" in modules:
            recompute += up
    moe = moe_of(model)
    if moe is not None:
        share = len(model.moe_layer_ids) / model.num_layers
        routed = tokens // (tp if sequence_parallel else 1)
        experts, k = moe.num_experts or 1, moe.moe_router_topk
        ffn = moe.expert_ffn(model.ffn)
        rows = model.expert_load * k * routed * etp
        if moe.moe_pad_expert_input_to_capacity and moe.moe_expert_capacity_factor:
            rows = moe.moe_expert_capacity_factor * k * routed * etp
        local = max(1, experts // ep)
        m = max(1, round(rows / local))
        expert_gemms = experts_gemm_time(local, m, h, halves * ffn // etp, ffn // etp, gemms) / grouped_efficiency
        act = ffn_bytes * rows * ffn / etp / bandwidth
        router = timed(routed, experts, h, 1, peak_flops=peak_flops) + ROUTER_BYTES * routed * experts / bandwidth
        permute = PERMUTE_BYTES * elem / 2.0 * k * routed * h / bandwidth
        shared = 0.0
        if moe.shared_ffn:
            shared = gemms(tokens, halves * moe.shared_ffn // tp, h, 1) + gemms(tokens, h, moe.shared_ffn // tp, 1)
            shared += ffn_bytes * tokens * moe.shared_ffn / tp / bandwidth
        dense_gemms = gemms(tokens, halves * model.ffn // tp, h, 1) + gemms(tokens, h, model.ffn // tp, 1)
        dense_act = ffn_bytes * tokens * model.ffn / tp / bandwidth
        moe_forward = expert_gemms + act + router + permute + shared
        moe_backward = 2.0 * expert_gemms + BACKWARD_TRAFFIC_RATIO * (act + permute) + 2.0 * router
        moe_backward += 2.0 * shared
        forward += share * (moe_forward - dense_gemms - dense_act)
        backward += share * (moe_backward - 2.0 * dense_gemms - BACKWARD_TRAFFIC_RATIO * dense_act)
        one = moe_exchange_times(model, routed, ep, etp, dispatcher, links, elem, exchange_efficiency)
        exchange += share * one
        if "moe" in modules or full_recompute:
            again += share * one / 2.0
        if "moe" in modules:
            recompute += share * moe_forward
        else:
            recompute += share * (
                (act if "moe_act" in modules else 0.0) + (shared if "shared_experts" in modules else 0.0)
            )
    return SublayerTimes(forward, backward, recompute, exchange, again)


def _mla_weight_gemms(model: MoEModel, tokens: int, tp: int, *, up_only: bool = False) -> list[tuple[int, int, int]]:
    """``(M, N, K)`` of multi-head latent attention's weight GEMMs on one tp rank (the down
    projections replicated); ``up_only``: the up projections alone."""
    mla = model.mla
    assert mla is not None
    shapes = mla.weight_shapes(model.hidden_size, model.num_attention_heads, tp)
    names = ("q_up", "kv_up") if up_only else tuple(shapes)
    return [(tokens, shapes[n][0], shapes[n][1]) for n in names if n in shapes]
