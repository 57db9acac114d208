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
from ptdp.planner.inputs.moe_model import MoEModel, moe_layer_share, moe_of
from ptdp.planner.time.collectives import Links
from ptdp.planner.time.constants import PerfConstants
from ptdp.planner.time.flops import (
    BACKWARD_TRAFFIC_RATIO,
    FFN_BYTES_GELU,
    FFN_BYTES_SWIGLU,
    FP8_CAST_BYTES,
    gemm_efficiency,
    gemm_flops,
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
    forward and backward, ``exchange_again`` those a recompute runs again and ``wgrad`` the routed and
    shared experts' weight-gradient GEMMs within ``backward`` (a zero-bubble schedule's W runs them)."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    exchange: float = 0.0
    exchange_again: float = 0.0
    wgrad: float = 0.0


def exchange_time(
    nbytes: float, group: int, links: Links, *, receive: float = 1.0, efficiency: float = 1.0, stride: int = 1
) -> float:
    """Seconds of an all-to-all in which each of ``group`` ranks, ``stride`` apart, sends ``nbytes``
    (spread evenly over the group) and receives ``receive`` times as much: the share for peers in
    its node over NVLink and the share for other nodes over its NIC at once (the slower decides), at
    ``efficiency`` of the links' bandwidth, one latency per peer node plus one."""
    if group <= 1:
        return 0.0
    per_node = group_per_node(group, stride, links.gpus_per_node)
    moved = nbytes * max(1.0, receive)
    inside = moved * (per_node - 1) / group / (links.nvlink_bandwidth * efficiency)
    outside = moved * (group - per_node) / group / (links.network_bandwidth * efficiency)
    nodes = -(-group // per_node)
    latency = links.nvlink_latency + (nodes - 1) * links.network_latency
    return max(inside, outside) + latency


def group_per_node(group: int, stride: int, gpus_per_node: int) -> int:
    """Ranks of a group of ``group`` ranks ``stride`` apart that share a node of ``gpus_per_node``."""
    return max(1, min(group, gpus_per_node // stride))


def parts_hit(experts: int, k: int, parts: int) -> float:
    """Expected number of ``parts`` equal shares of the ``experts`` holding at least one of a token's
    ``k`` experts, drawn uniformly without replacement (a balanced router)."""
    if parts <= 1:
        return 1.0
    per = experts // parts
    missed = 1.0
    for i in range(k):
        missed *= max(0.0, (experts - per - i) / (experts - i))
    return parts * (1.0 - missed)


def flex_exchange_time(
    tokens: int, row_bytes: float, moe, group: int, links: Links, *, receive: float, efficiency: float, stride: int = 1
) -> float:
    """Seconds of one deduplicating exchange (DeepEP / HybridEP, Megatron-Core's ``flex`` dispatcher)
    of ``tokens`` rows of ``row_bytes``: each token crosses the network once per other node holding
    one of its experts (at most the groups of node-limited routing, DeepSeek-V3 §2.1.2, when they
    are the nodes) and reaches each other GPU holding one over NVLink once (:func:`parts_hit`), both
    at once; the combine sums on the way back the same way (the group's ranks ``stride`` apart)."""
    per_node = group_per_node(group, stride, links.gpus_per_node)
    nodes = -(-group // per_node)
    k, experts = moe.moe_router_topk, moe.num_experts or 1
    node_hits = parts_hit(experts, k, nodes)
    if moe.moe_router_group_topk and moe.moe_router_num_groups == nodes:
        node_hits = min(node_hits, float(moe.moe_router_group_topk))
    gpu_hits = parts_hit(experts, k, group)
    moved = tokens * row_bytes * max(1.0, receive)
    inside = moved * gpu_hits * (group - 1) / group / (links.nvlink_bandwidth * efficiency)
    outside = moved * node_hits * (nodes - 1) / nodes / (links.network_bandwidth * efficiency)
    return max(inside, outside) + links.nvlink_latency + (nodes - 1) * links.network_latency


def moe_exchange_times(
    model: MoEModel,
    tokens: int,
    ep: int,
    etp: int,
    dispatcher: str,
    links: Links,
    elem: float,
    efficiency: float,
    flex: bool = False,
) -> float:
    """Seconds of one MoE layer's exchanges (forward and backward) for one micro-batch of a rank
    routing ``tokens``: four over ep (or four gathers / reduce-scatters over ``ep etp`` with the
    allgather dispatcher; with ``flex`` four deduplicating ones, :func:`flex_exchange_time`) and,
    with etp > 1, four over etp (module docstring). The ep ranks are etp apart (etp is the expert
    grid's fastest axis). With a capacity the rows kept (dropped ones are not sent), with padding
    the capacity's."""
    moe = model.moe
    rows = moe.moe_router_topk * tokens * model.kept_share
    one = elem * rows * model.hidden_size
    rho = model.busiest_load(ep) / model.kept_share  # what the busiest rank receives over what each sends
    if dispatcher == "allgather":
        group = ep * etp
        return 4.0 * exchange_time((group - 1) * one, group, links, efficiency=efficiency) if group > 1 else 0.0
    if flex and ep > 1:
        row = elem * model.hidden_size * model.kept_share
        out = 4.0 * flex_exchange_time(tokens, row, moe, ep, links, receive=rho, efficiency=efficiency, stride=etp)
    else:
        out = 4.0 * exchange_time(one, ep, links, receive=rho, efficiency=efficiency, stride=etp) if ep > 1 else 0.0
    if etp > 1:
        out += 4.0 * exchange_time(etp * one * rho, etp, links, efficiency=efficiency)
    return out


def experts_gemm_time(
    experts: int,
    rows: int,
    hidden: int,
    fc1_width: int,
    ffn: int,
    *,
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
    element: float,
    efficiency: float = 1.0,
) -> float:
    """Seconds of the forward GEMMs of a rank's ``experts`` experts, ``rows`` rows each, as two
    grouped GEMMs, fc1 ``(rows, fc1_width, hidden)`` and fc2 ``(rows, hidden, ffn)`` per expert: each
    grouped GEMM's FLOPs at the efficiency (:func:`~ptdp.planner.time.flops.gemm_efficiency`) of one
    ``(experts rows, n, k)`` GEMM (the groups fill the GPU together) times ``efficiency``
    (``moe_grouped_gemm_efficiency``), or reading every expert's operands of ``element`` bytes,
    whichever is longer."""

    def grouped(n: int, k: int) -> float:
        eff = gemm_efficiency(experts * rows, n, k, peak_fraction=peak_fraction, half_dim=half_dim)
        compute = gemm_flops(rows, n, k, experts) / (peak_flops * eff * efficiency)
        memory = experts * (rows * k + k * n + rows * n) * element / bandwidth
        return max(compute, memory)

    return grouped(fc1_width, hidden) + grouped(hidden, ffn)


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
    c: PerfConstants,
    links: Links,
    elem: float,
    fp8_peak: float = 0.0,
    experts_wgrad_fp8: bool = True,
) -> SublayerTimes:
    """:class:`SublayerTimes` of a planned MoE / MLA model on one rank (a mean over its layers);
    zeros for a dense model. ``modules``: the selective ``--recompute-modules``; ``full_recompute``:
    every layer's forward runs again (its exchanges too). ``fp8_peak``: the weight GEMMs' FP8 rate
    (0: none); ``experts_wgrad_fp8`` False: the experts' weight gradients at ``peak_flops`` instead
    (``ptdp train``'s FP8 experts, :mod:`ptdp.engine.moe.expert_linear`)."""
    if not isinstance(model, MoEModel):
        return SublayerTimes()
    weight_peak = fp8_peak or peak_flops
    weight_bytes = 1.0 if fp8_peak else elem
    timed = partial(gemm_time, bandwidth=bandwidth, peak_fraction=c.gemm_peak_fraction, half_dim=c.gemm_half_dim)
    gemms = partial(timed, peak_flops=weight_peak, bytes_per_element=weight_bytes)
    s = model.seq_length // cp
    tokens, h = micro_batch_size * s, model.hidden_size
    halves = 2 if model.swiglu else 1
    ffn_bytes = FFN_BYTES_SWIGLU if model.swiglu else FFN_BYTES_GELU
    forward = backward = recompute = exchange = again = wgrad = 0.0
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
        share = moe_layer_share(model)
        routed = tokens // (tp if sequence_parallel else 1)
        experts, k = moe.num_experts or 1, moe.moe_router_topk
        ffn = moe.expert_ffn(model.ffn)
        rows = model.busiest_load(ep) * k * routed * etp
        local = max(1, experts // ep)
        m = max(1, round(rows / local))
        grouped = partial(
            experts_gemm_time,
            local,
            m,
            h,
            halves * ffn // etp,
            ffn // etp,
            bandwidth=bandwidth,
            peak_fraction=c.gemm_peak_fraction,
            half_dim=c.gemm_half_dim,
            efficiency=c.moe_grouped_gemm_efficiency,
        )
        expert_gemms = grouped(peak_flops=weight_peak, element=weight_bytes)
        expert_wgrad = expert_gemms
        if fp8_peak and not experts_wgrad_fp8:
            expert_wgrad = grouped(peak_flops=peak_flops, element=elem)
        act = ffn_bytes * rows * ffn / etp / bandwidth
        casts_f = casts_b = 0.0
        if fp8_peak:  # each expert GEMM's input quantised (and transposed) on the way
            casts_f = FP8_CAST_BYTES * rows * (h + ffn / etp) / bandwidth
            casts_b = FP8_CAST_BYTES * rows * (h + halves * ffn / etp) / bandwidth
        router = timed(routed, experts, h, 1, peak_flops=peak_flops) + ROUTER_BYTES * routed * experts / bandwidth
        permute = PERMUTE_BYTES * elem / 2.0 * k * routed * h / bandwidth
        shared = shared_gemms = 0.0
        if moe.shared_ffn:
            shared_gemms = gemms(tokens, halves * moe.shared_ffn // tp, h, 1) + gemms(
                tokens, h, moe.shared_ffn // tp, 1
            )
            shared = shared_gemms + ffn_bytes * tokens * moe.shared_ffn / tp / bandwidth
        wgrad += share * (expert_wgrad + shared_gemms)  # each as long as its forward GEMM
        dense_gemms = gemms(tokens, halves * model.ffn // tp, h, 1) + gemms(tokens, h, model.ffn // tp, 1)
        dense_act = ffn_bytes * tokens * model.ffn / tp / bandwidth
        fixed = 0.0 if c.moe_cuda_graphs else c.moe_layer_overhead  # its many small kernels' launches
        moe_forward = expert_gemms + act + router + permute + shared + casts_f + fixed / 3.0
        moe_backward = expert_gemms + expert_wgrad + BACKWARD_TRAFFIC_RATIO * (act + permute) + 2.0 * router + casts_b
        moe_backward += 2.0 * fixed / 3.0
        moe_backward += 2.0 * shared
        forward += share * (moe_forward - dense_gemms - dense_act)
        backward += share * (moe_backward - 2.0 * dense_gemms - BACKWARD_TRAFFIC_RATIO * dense_act)
        flex = bool(c.moe_flex_dispatcher)
        efficiency = c.moe_flex_efficiency if flex else c.moe_exchange_efficiency
        one = moe_exchange_times(model, routed, ep, etp, dispatcher, links, elem, efficiency, flex)
        exchange += share * one
        if "moe" in modules or full_recompute:
            again += share * one / 2.0
        if "moe" in modules:
            recompute += share * moe_forward
        else:
            recompute += share * (
                (act if "moe_act" in modules else 0.0) + (shared if "shared_experts" in modules else 0.0)
            )
    return SublayerTimes(forward, backward, recompute, exchange, again, wgrad)


def _mla_weight_gemms(model: MoEModel, tokens: int, tp: int, *, up_only: bool = False) -> list[tuple[int, int, int]]:
    """``(M, N, K)`` of multi-head latent attention's weight GEMMs on one tp rank (the down
    projections replicated); ``up_only``: the up projections alone."""
    mla = model.mla
    assert mla is not None
    shapes = mla.weight_shapes(model.hidden_size, model.num_attention_heads, tp)
    names = ("q_up", "kv_up") if up_only else tuple(shapes)
    return [(tokens, shapes[n][0], shapes[n][1]) for n in names if n in shapes]
