"""Context parallelism in the planner: what one of ``cp`` ranks computes, keeps and exchanges.

Context parallelism (Megatron-Core's ``--context-parallel-size``; Llama 3, Dubey et al. 2024,
arXiv:2407.21783, §3.3.2; ring attention, Liu et al. 2023, arXiv:2310.01889) cuts each sequence
of ``s`` tokens into ``2 cp`` chunks; cp rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (so
every rank has the same share of the causal mask), ``s / cp`` tokens. Everything per token
(GEMMs, norms, MLP, stored activations, tp and pp transfers, the logits) is that of a sequence
of ``s / cp`` tokens: :func:`local_model`. Attention is not: the rank's ``s / cp`` queries see
keys of the whole sequence, so its score work is ``(s / cp) x s``, ``cp`` blocks of
``(s / cp) x (s / cp)`` (the planner counts the full square, like the rest of its attention
FLOPs): :func:`layer_times`. Parameters are replicated over cp, so gradients are reduced over
``dp x cp`` and sharded state is split over ``dp x cp`` (:mod:`ptdp.planner.sharding`).

Key/value exchange per layer and microbatch, one tp rank; a block is one chunk pair's keys or
values, ``B = (s / cp) b kv d / t`` elements of ``e`` bytes (kv: key/value heads, d: head size):

* ``p2p`` (ring): forward ``cp - 1`` steps, each sending and receiving K and V (``2 B e`` bytes per
  direction), each overlapped with the attention of the block already there; backward the same
  ``cp - 1`` steps with K, V and their gradient accumulators travelling (``2 B e + 2 B g``),
  overlapped with one block's backward attention, then one more step carrying dK and dV home
  (``2 B g``, exposed). The gradient blocks travel in float32, ``g = 4`` bytes (ptdp's
  :func:`ptdp.engine.context_parallel.cp_attention_comm`: partial sums are not rounded to 16 bits
  between hops). Exposed: per step, what the transfer exceeds that block's attention. Buffers:
  two blocks in flight of each travelling tensor, peak in backward ``8 B e`` bytes.
* ``all_gather``: forward one all-gather of K and V (the full tensors ``2 cp B e`` bytes); backward
  an all-gather again and a reduce-scatter of their gradients (``2 cp B g`` bytes, float32);
  not overlapped. Buffers: the gathered K, V and the full-length dK, dV of one layer,
  ``4 cp B e`` bytes.

Links: ranks are ordered tp-cp-dp-pp, so a cp group is ``cp`` ranks at stride tp; with
``tp * cp <= gpus_per_node`` it is inside a node (NVLink), else its ring crosses the network,
whose bandwidth paces every step.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from ptdp.planner import flops
from ptdp.planner.comm import Links, hierarchical_all_reduce_time
from ptdp.planner.models import ModelSpec

#: Search cp > 1 only from this sequence length on (or when no layout fits without it): shorter
#: sequences split into 2 cp chunks make GEMMs thinner and add key/value traffic for activation
#: memory that recompute or more tp/pp can save instead. Llama 3 (§3.3.2) used cp only for its
#: long-context stage; 16K is a round threshold, not fitted.
CP_MIN_SEQ_LENGTH = 16384
#: Search cp only while each rank keeps at least this many tokens (``s / cp``): a ring step's
#: attention work falls with the square of the block length, its transfer only linearly, so
#: ever smaller blocks cannot hide their exchange. A pruning bound, not fitted.
CP_MIN_LOCAL_TOKENS = 1024


@lru_cache(maxsize=4096)
def local_model(model: ModelSpec, cp: int) -> ModelSpec:
    """``model`` seen by one cp rank for everything per token: ``seq_length = s / cp`` (exact: the
    rule ``s % (2 cp) == 0`` holds). ``cp = 1`` returns ``model``. Not for parameter counts (a
    learned position table is ``[s, h]`` on every rank)."""
    if cp == 1:
        return model
    return dataclasses.replace(model, seq_length=model.seq_length // cp)


def kv_block_elements(model: ModelSpec, tp: int, cp: int, micro_batch_size: int) -> float:
    """Elements of one key (or value) block on one tp rank: ``(s / cp) b kv d / t``."""
    d = model.hidden_size // model.num_attention_heads
    return model.seq_length / cp * micro_batch_size * model.kv_heads * d / tp


def kv_buffer_bytes(
    model: ModelSpec, tp: int, cp: int, micro_batch_size: int, comm_type: str, bytes_per_value: float = 2.0
) -> float:
    """Peak bytes of the key/value exchange of the one layer running (transient; once per stage):
    p2p ``8 B e`` (K, V, dK, dV, two blocks each), all_gather ``4 cp B e``; 0 when cp = 1."""
    if cp <= 1:
        return 0.0
    block = kv_block_elements(model, tp, cp, micro_batch_size) * bytes_per_value
    if comm_type == "p2p":
        return 8.0 * block
    if comm_type == "all_gather":
        return 4.0 * cp * block
    raise ValueError(f"cp_comm_type={comm_type!r} must be p2p or all_gather")


def unfused_score_bytes_missing(local_none: float, local_selective: float, cp: int, flash: bool) -> float:
    """What :func:`ptdp.planner.activation_memory.layer_activation_bytes` of :func:`local_model` leaves out
    without a fused kernel: the kept scores are ``(s/cp) x s`` per head, the local model counts
    ``(s/cp) x (s/cp)``; the score part (no recompute minus selective) times ``cp - 1``. A fused
    kernel keeps a per-query log-sum-exp only, already right."""
    if cp <= 1 or flash:
        return 0.0
    return (cp - 1) * (local_none - local_selective)


def block_attention_times(
    local: ModelSpec,
    tp: int,
    micro_batch_size: int,
    core: float,
    *,
    peak_flops: float,
    peak_fraction: float,
    half_dim: float,
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention of one ``(s/cp) x (s/cp)`` block: a flash
    kernel's (:func:`ptdp.planner.flops.flash_attention_time`, backward ``FLASH_BACKWARD_RATIO``
    x), else the unfused core ``core`` of the local model and twice that backward (its GEMMs and
    score traffic are twice the forward's, :func:`ptdp.planner.flops.layer_compute_times`)."""
    if not local.flash_attention:
        return core, 2.0 * core
    fwd = flops.flash_attention_time(
        local, tp, micro_batch_size, peak_flops=peak_flops, peak_fraction=peak_fraction, half_dim=half_dim
    )
    return fwd, flops.FLASH_BACKWARD_RATIO * fwd


def layer_times(
    local_times: tuple[float, float, float], block: tuple[float, float], cp: int
) -> tuple[float, float, float]:
    """(forward, backward, attention core) seconds of one layer on one cp rank from the local
    model's (:func:`ptdp.planner.flops.layer_compute_times` of :func:`local_model`), which
    attends one block: the rank attends ``cp`` blocks, forward ``+ (cp - 1)`` and backward
    ``+ (cp - 1)`` times ``block`` (:func:`block_attention_times`); the core (what selective
    recompute repeats; 0 with a flash kernel) ``cp x``. A causal kernel's skipped half is the
    same share of every rank's blocks under the load-balanced split."""
    fwd, bwd, core = local_times
    return fwd + (cp - 1) * block[0], bwd + (cp - 1) * block[1], cp * core


def cp_link(tp: int, cp: int, links: Links) -> tuple[float, float]:
    """(bandwidth, latency) of the cp group's ring: NVLink when ``tp * cp <= gpus_per_node``."""
    if tp * cp <= links.gpus_per_node:
        return links.nvlink_bandwidth, links.nvlink_latency
    return links.network_bandwidth, links.network_latency


def kv_exchange_times(
    model: ModelSpec,
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
    """Exposed seconds of one layer's key/value exchange for one microbatch: ``(forward,
    backward)`` (module docstring). p2p: ``cp - 1`` ring steps each way, a forward step (K, V:
    ``2 B e`` bytes + one latency) hidden behind ``block_attention`` (one block's forward
    attention), a backward step (K, V and the dK, dV accumulators: ``2 B e + 2 B g``) behind
    ``block_attention_backward`` (default twice the forward), and the last hop of dK, dV to their
    owner (``2 B g``) exposed. all_gather: the gather (``2 cp B e``) in forward, the gather again
    and the reduce-scatter of dK, dV (``2 cp B g``) in backward. ``g`` =
    ``grad_bytes_per_value`` (float32, as ptdp sends them)."""
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
