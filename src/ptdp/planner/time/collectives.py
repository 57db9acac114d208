"""Communication model: time of the tensor-, pipeline- and data-parallel transfers of one step.

Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473, §3.2 and §4; [S20] Shoeybi et al.,
arXiv:1909.08053 (2 all-reduces per layer forward, 2 backward); [K22] Korthikanti et al.,
arXiv:2205.05198, §4.2.2 (sequence parallelism); Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms", JPDC 2009 (ring all-reduce ``2 (n-1)/n`` bytes per rank).

Bandwidths are achieved bytes/s per GPU per direction; latencies are seconds per ring step. Ranks
are laid out ``tp-dp-pp`` (TP fastest, ``ptdp.layout.grid``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """Achieved bandwidths (bytes/s per GPU per direction) and per-step latencies (s).

    ``gpus_per_node`` GPUs share one NVLink domain; across nodes each GPU uses its own NIC.
    """

    nvlink_bandwidth: float
    network_bandwidth: float
    nvlink_latency: float
    network_latency: float
    gpus_per_node: int


def ring_all_reduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: ``2 (n-1)/n * nbytes / bw + 2 (n-1) lat``."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


def ring_all_gather_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather (or reduce-scatter) whose full tensor is ``nbytes``: ``(n-1)/n * nbytes / bw
    + (n-1) lat``, half an all-reduce."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def hierarchical_all_reduce_time(nbytes: float, n: int, per_node: int, links: Links) -> float:
    """All-reduce of ``nbytes`` over ``n`` ranks of which ``per_node`` share each node: reduce-scatter in
    the node over NVLink, all-reduce of the ``1/per_node`` shard across nodes (one NIC per GPU), all-gather
    in the node. ``per_node >= n``: the group is inside one node.
    """
    if n <= 1:
        return 0.0
    per_node = max(1, min(per_node, n))
    nodes = -(-n // per_node)  # a group that straddles nodes still crosses the network
    intra = ring_all_reduce_time(nbytes, per_node, links.nvlink_bandwidth, links.nvlink_latency)
    inter = ring_all_reduce_time(nbytes / per_node, nodes, links.network_bandwidth, links.network_latency)
    return intra + inter


def tp_layer_comm_times(
    tokens: int, hidden: int, tp: int, *, sequence_parallel: bool, links: Links, bytes_per_element: float = 2.0
) -> tuple[float, float]:
    """Seconds of TP communication of one layer, one microbatch: ``(forward, backward)``.

    Without sequence parallelism [S20]: 2 all-reduces of ``T h`` elements forward and 2 backward. With
    it [K22 §4.2.2]: forward 2 all-gathers + 2 reduce-scatters (2 all-reduces' bytes); backward adds
    the re-gather of the QKV and fc1 inputs, 3 all-reduce times, none taken as hidden. A group larger
    than a node uses :func:`hierarchical_all_reduce_time`; full recompute's repeat is the caller's.
    """
    if tp <= 1:
        return 0.0, 0.0
    nbytes = bytes_per_element * tokens * hidden
    one = hierarchical_all_reduce_time(nbytes, tp, links.gpus_per_node, links)
    return 2.0 * one, (3.0 if sequence_parallel else 2.0) * one


def pp_transfer_time(
    tokens: int,
    hidden: int,
    tp: int,
    dp: int,
    pp: int,
    *,
    sequence_parallel: bool,
    links: Links,
    bytes_per_element: float = 2.0,
    scatter_gather: bool = True,
) -> float:
    """Seconds of one stage-to-stage transfer (activation or its gradient) of one microbatch.

    ``T h`` elements [N21 §3.2]. With scatter/gather each tp rank sends ``T h / t`` and the receiver
    all-gathers over NVLink; with sequence parallelism the activation is already split (no all-gather).
    Stages are in different nodes when the ``tp * dp * pp`` GPUs span more than one node.
    """
    if pp <= 1:
        return 0.0
    cross_node = tp * dp * pp > links.gpus_per_node
    bandwidth = links.network_bandwidth if cross_node else links.nvlink_bandwidth
    latency = links.network_latency if cross_node else links.nvlink_latency
    nbytes = bytes_per_element * tokens * hidden
    if sequence_parallel or (scatter_gather and tp > 1):
        send = nbytes / tp / bandwidth + latency
        if not sequence_parallel:
            send += ring_all_gather_time(nbytes, tp, links.nvlink_bandwidth, links.nvlink_latency)
        return send
    return nbytes / bandwidth + latency


def dp_group_per_node(tp: int, dp: int, gpus_per_node: int) -> int:
    """Members of one DP group inside a node under the tp-dp-pp order: ``min(dp, gpn // tp)``."""
    return max(1, min(dp, gpus_per_node // tp)) if tp < gpus_per_node else 1


def dp_grad_sync_time(
    grad_bytes: float, param_bytes: float, tp: int, dp: int, *, distributed_optimizer: bool, links: Links
) -> float:
    """Seconds of the once-per-step gradient synchronisation over dp (before overlap).

    Plain data parallelism: a hierarchical all-reduce of the stage's ``grad_bytes``. Distributed
    optimizer (ZeRO-1): reduce-scatter of the gradients + all-gather of the updated ``param_bytes``
    (each half an all-reduce), [N21 §3.2; Rajbhandari et al., ZeRO, arXiv:1910.02054].
    """
    if dp <= 1:
        return 0.0
    per_node = dp_group_per_node(tp, dp, links.gpus_per_node)
    if distributed_optimizer:
        return 0.5 * (
            hierarchical_all_reduce_time(grad_bytes, dp, per_node, links)
            + hierarchical_all_reduce_time(param_bytes, dp, per_node, links)
        )
    return hierarchical_all_reduce_time(grad_bytes, dp, per_node, links)


def embedding_sync_time(nbytes: float, pp: int, tp: int, dp: int, links: Links) -> float:
    """Seconds of the all-reduce of the tied embedding's gradient between the first and the last
    stage (pp > 1, tied): 2 ranks, across nodes unless the whole pipeline fits in one node."""
    if pp <= 1:
        return 0.0
    cross_node = tp * dp * pp > links.gpus_per_node
    bw = links.network_bandwidth if cross_node else links.nvlink_bandwidth
    lat = links.network_latency if cross_node else links.nvlink_latency
    return ring_all_reduce_time(nbytes, 2, bw, lat)
