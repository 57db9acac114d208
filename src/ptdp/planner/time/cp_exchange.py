"""Context parallelism's time: one cp rank's attention over ``cp`` key/value blocks and the exchange
of the blocks (Megatron-Core's ``--cp-comm-type``; ring attention, Liu et al. 2023, arXiv:2310.01889;
Llama 3, Dubey et al. 2024, arXiv:2407.21783, §3.3.2).

A block is ``B = (s / cp) b kv d / t`` elements of ``e`` bytes, gradients fp32 (``g = 4``). ``p2p``:
``cp - 1`` ring steps of K, V (``2 B e``) forward and K, V, dK, dV (``2 B e + 2 B g``) backward, each
behind one block's attention, then dK, dV home (``2 B g``, exposed). ``all_gather``: ``2 cp B e``
forward; again plus a reduce-scatter of ``2 cp B g`` backward, not overlapped. The group is in a
node while ``tp * cp <= gpus_per_node``.

Implementations (``--cp-implementation``): ``te`` (Transformer Engine's, Megatron-Core's) merges
each step's block output and accumulates the gradients in fused kernels, not counted; ``torch``
(PyTorch's experimental ``context_parallel``, torchtitan's) does it with out-of-place float32
tensor ops whose memory traffic :func:`torch_merge_times` counts.
"""

from __future__ import annotations

from ptdp.config.model import ModelConfig
from ptdp.planner.memory.cp_local import kv_block_elements
from ptdp.planner.time import flops
from ptdp.planner.time.collectives import Links, hierarchical_all_reduce_time


def block_attention_times(
    local: ModelConfig,
    tp: int,
    micro_batch_size: int,
    core: float,
    *,
    peak_flops: float,
    peak_fraction: float,
    half_dim: float,
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention of one ``(s/cp) x (s/cp)`` block: a flash
    kernel's (:func:`ptdp.planner.time.flops.flash_attention_time`, backward ``FLASH_BACKWARD_RATIO``
    x), else the unfused core ``core`` of the local model and twice that backward (its GEMMs and
    score traffic are twice the forward's, :func:`ptdp.planner.time.flops.layer_compute_times`)."""
    if not local.flash_attention:
        return core, 2.0 * core
    fwd = flops.flash_attention_time(
        local, tp, micro_batch_size, peak_flops=peak_flops, peak_fraction=peak_fraction, half_dim=half_dim
    )
    return fwd, flops.FLASH_BACKWARD_RATIO * fwd


def layer_times(
    local_times: tuple[float, float, float], block: tuple[float, float], cp: int
) -> tuple[float, float, float]:
    """(forward, backward, attention core) seconds of one layer on one cp rank from the local model's
    (:func:`ptdp.planner.time.flops.layer_compute_times`), which attends one block: forward and backward
    add ``(cp - 1)`` times ``block`` (:func:`block_attention_times`); the core (0 with a flash kernel) is
    ``cp x``. The load-balanced split gives every rank the same causal share.
    """
    fwd, bwd, core = local_times
    return fwd + (cp - 1) * block[0], bwd + (cp - 1) * block[1], cp * core


def cp_link(tp: int, cp: int, links: Links) -> tuple[float, float]:
    """(bandwidth, latency) of the cp group's ring: NVLink when ``tp * cp <= gpus_per_node``."""
    if tp * cp <= links.gpus_per_node:
        return links.nvlink_bandwidth, links.nvlink_latency
    return links.network_bandwidth, links.network_latency


def kv_exchange_times(
    model: ModelConfig,
    tp: int,
    cp: int,
    micro_batch_size: int,
    comm_type: str,
    block_attention: float,
    links: Links,
    bytes_per_value: float = 2.0,
    block_attention_backward: float | None = None,
    grad_bytes_per_value: float = 4.0,
) -> tuple[float, float]:
    """Exposed seconds of one layer's key/value exchange for one microbatch: ``(forward, backward)``
    (module docstring). p2p steps hide behind ``block_attention`` forward and
    ``block_attention_backward`` (default twice the forward) backward; ``g`` = ``grad_bytes_per_value``.
    Raises ValueError for an unknown ``comm_type``.
    """
    if cp <= 1:
        return 0.0, 0.0
    elements = kv_block_elements(model, tp, cp, micro_batch_size)
    block, grad_block = elements * bytes_per_value, elements * grad_bytes_per_value
    if comm_type == "p2p":
        bw, lat = cp_link(tp, cp, links)
        hide_backward = 2.0 * block_attention if block_attention_backward is None else block_attention_backward
        fwd = (cp - 1) * max(0.0, 2.0 * block / bw + lat - block_attention)
        bwd = (
            (cp - 1) * max(0.0, (2.0 * block + 2.0 * grad_block) / bw + lat - hide_backward)
            + 2.0 * grad_block / bw
            + lat
        )
        return fwd, bwd
    if comm_type == "all_gather":
        per_node = min(cp, max(1, links.gpus_per_node // tp)) if tp < links.gpus_per_node else 1
        gather = 0.5 * hierarchical_all_reduce_time(2.0 * cp * block, cp, per_node, links)
        scatter = 0.5 * hierarchical_all_reduce_time(2.0 * cp * grad_block, cp, per_node, links)
        return gather, gather + scatter
    raise ValueError(f"cp_comm_type={comm_type!r} must be p2p or all_gather")


#: Bytes moved per element of a block output (``O``) and of a key block as the kernel receives it
#: (``K``) by PyTorch's experimental ring attention (torch/distributed/tensor/experimental/_attention.py,
#: ``_templated_ring_attention`` and its backward, with its ``convert_to_f32`` and load balance on;
#: bf16 inputs), as (per ``O``, per ``K``). Forward, each step after the first: the block output
#: cast to float32 and merged by ``out - sigmoid(...) * (out - block)`` (38 per ``O``, or 27 when
#: only the second half of the queries attends and ``_partial_update`` concatenates: 32.5 on
#: average) and K, V concatenated for the exchange (8); once per call the first cast and the cast
#: back (12). Backward, each step: K, V concatenated (8, but the last), the float32 dK, dV
#: accumulated (20, or 26 with ``_partial_update``: 23), concatenated for the float32 ring (16), dQ
#: accumulated (10, or 13: 11.5); once: the zeroed float32 gradients (4 and 8), dQ cast back (6)
#: and dK, dV cast (12), less the last step's concatenation (-8).
TORCH_MERGE_STEP_FORWARD = (32.5, 8.0)
TORCH_MERGE_CALL_FORWARD = (12.0, 0.0)
TORCH_MERGE_STEP_BACKWARD = (11.5, 47.0)
TORCH_MERGE_CALL_BACKWARD = (10.0, 12.0)


def torch_merge_times(
    model: ModelConfig, tp: int, cp: int, micro_batch_size: int, bandwidth: float
) -> tuple[float, float]:
    """(forward, backward) seconds of PyTorch's ring-attention merge and gradient accumulation for
    one layer and microbatch on one cp rank: the bytes of ``TORCH_MERGE_*`` (``O = (s / cp) b a d / t``
    output elements, ``K`` of :func:`~ptdp.planner.memory.cp_local.kv_block_elements`) over the
    achieved HBM ``bandwidth`` (bytes/s); 0 when cp = 1."""
    if cp <= 1:
        return 0.0, 0.0
    d = model.head_dim
    out = model.seq_length / cp * micro_batch_size * model.num_attention_heads * d / tp
    key = kv_block_elements(model, tp, cp, micro_batch_size)

    def traffic(per_element: tuple[float, float]) -> float:
        return per_element[0] * out + per_element[1] * key

    forward = (cp - 1) * traffic(TORCH_MERGE_STEP_FORWARD) + traffic(TORCH_MERGE_CALL_FORWARD)
    backward = cp * traffic(TORCH_MERGE_STEP_BACKWARD) + traffic(TORCH_MERGE_CALL_BACKWARD)
    return forward / bandwidth, backward / bandwidth
