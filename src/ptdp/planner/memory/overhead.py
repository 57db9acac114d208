"""GPU memory of one training process outside the tensors the planner counts: the CUDA context,
cuBLAS workspaces and NCCL's communication buffers (bytes, one rank).

Sources: CUDA context with PyTorch's lazy module loading (its default since 1.13) 287 MB
(pytorch/pytorch PR 86509) to 426 MiB (torch 2.10, RTX 6000 Ada, unslothai/unsloth-zoo issue 1053);
cuBLAS workspace 32 MiB per handle and stream on Hopper (PyTorch ``CublasHandlePool.cpp``, PR
89027) and cuBLASLt's 1 MiB; NCCL (NVIDIA/nccl ``src/init.cc``, ``src/include/device.h``,
``src/transport/p2p.cc``, ``net.cc``): per connection a Simple buffer of 4 MiB, LL128 4,915,200 B
and LL 512 KiB, the receiver holding all three, over the network the sender also Simple and LL128;
24 ring channels inside an 8-GPU H100 node, 16 across nodes (NCCL's log on 8 x H100,
aws-samples/aws-do-eks ``nccl-test/README.md``); send/recv over the network through shared buffers of
2 channels per peer x 16 steps x 128 KiB. The caching allocator's own slack is taken as none
(``expandable_segments``, which NeMo, Megatron-Bridge and torchtitan set).
"""

from __future__ import annotations

from functools import lru_cache

from ptdp.planner.candidate import Candidate

MiB = 2**20

#: CUDA context and the kernels a training step loads (lazy loading), rounded up from the sources
CUDA_CONTEXT_BYTES = 512 * MiB
#: one cuBLAS workspace (the compute stream) and cuBLASLt's
CUBLAS_WORKSPACE_BYTES = 32 * MiB + 1 * MiB
#: NCCL buffers of one connection, receiving side: Simple + LL128 + LL
NCCL_RECV_CONNECTION_BYTES = 4 * MiB + 4_915_200 + 512 * 1024
#: the sending side over the network: Simple + LL128 (LL in host memory)
NCCL_NET_SEND_CONNECTION_BYTES = 4 * MiB + 4_915_200
#: ring channels of a collective inside one node and across nodes
INTRA_NODE_CHANNELS, INTER_NODE_CHANNELS = 24, 16
#: send/recv buffers per pipeline peer: 2 channels x 16 steps x 128 KiB
NCCL_P2P_PEER_BYTES = 2 * 16 * 128 * 1024


def ring_buffer_bytes(spans_nodes: bool) -> int:
    """NCCL ring buffers of one communicator on one rank: one receiving connection per channel (and
    across nodes one sending connection, whose buffers the network transport keeps on the GPU)."""
    if spans_nodes:
        return INTER_NODE_CHANNELS * (NCCL_RECV_CONNECTION_BYTES + NCCL_NET_SEND_CONNECTION_BYTES)
    return INTRA_NODE_CHANNELS * NCCL_RECV_CONNECTION_BYTES


def runtime_overhead_bytes(layout: Candidate, gpus_per_node: int, tied: bool = False) -> float:
    """Bytes one rank holds outside its tensors under ``layout`` on nodes of ``gpus_per_node``: the CUDA
    context, cuBLAS workspaces, a ring of NCCL buffers for each collective group of more than one rank
    (tp, cp, the dp x cp gradient group and, ``tied`` with pp > 1, the embedding group of the first and
    last stage), spanning nodes when its ranks do (ranks ordered tp-cp-dp-pp), and the pipeline's
    send/recv buffers for its two neighbours; with experts over ep or etp > 1 a ring for the etp and
    the expert-data-parallel groups and the all-to-all's send/recv buffers for each other ep rank."""
    sizes = (layout.tp, layout.cp, layout.dp, layout.pp, layout.ep, layout.etp, layout.edp)
    return _overhead_bytes(*sizes, gpus_per_node, tied)


@lru_cache(maxsize=4096)
def _overhead_bytes(
    tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, edp: int, gpus_per_node: int, tied: bool
) -> float:
    """:func:`runtime_overhead_bytes` of these sizes (cached: a search asks for each many times)."""
    total = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES
    # (group size, stride in ranks) of each collective group; the dp x cp gradient group: cp ranks
    # fastest, then dp. A group's ranks fill an aligned block of size x stride ranks: in one node
    # only if the block fits a node and nodes hold whole blocks.
    for size, stride in ((tp, 1), (cp, tp), (dp * cp, tp)):
        block = size * stride
        if size > 1:
            total += ring_buffer_bytes(block > gpus_per_node or gpus_per_node % block != 0)
    if ep * etp > 1:  # the expert grid: etp fastest, then ep, then edp
        for size, stride in ((etp, 1), (edp, ep * etp)):
            block = size * stride
            if size > 1:
                total += ring_buffer_bytes(block > gpus_per_node or gpus_per_node % block != 0)
        total += (ep - 1) * NCCL_P2P_PEER_BYTES
    if pp > 1:
        total += 2 * NCCL_P2P_PEER_BYTES
        if tied:  # rank r of the first stage with rank r + (pp - 1) x stage of the last
            stage = tp * cp * dp
            apart = stage * (pp - 1)
            total += ring_buffer_bytes(min(stage, gpus_per_node) - 1 + apart >= gpus_per_node)
    return float(total)
