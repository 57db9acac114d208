"""The GPU memory of a training process outside its tensors (``ptdp.planner.memory.overhead``):
the CUDA context, cuBLAS workspaces and NCCL's buffers of the groups a rank communicates on."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, GiB
from ptdp.planner.inputs.models import gpt
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.overhead import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    INTER_NODE_CHANNELS,
    INTRA_NODE_CHANNELS,
    NCCL_P2P_PEER_BYTES,
    ring_buffer_bytes,
    runtime_overhead_bytes,
)

BASE = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES


def test_nccl_buffers_follow_nccls_defaults():
    """Per connection 4 MiB Simple + 4,915,200 B LL128 + 512 KiB LL on the receiving side; over the
    network the sender keeps Simple and LL128 too; 24 ring channels in a node, 16 across nodes."""
    assert ring_buffer_bytes(False) == INTRA_NODE_CHANNELS * (4 * 2**20 + 4_915_200 + 2**19) == 231_211_008
    assert ring_buffer_bytes(True) == INTER_NODE_CHANNELS * (2 * (4 * 2**20 + 4_915_200) + 2**19)
    assert NCCL_P2P_PEER_BYTES == 4 * 2**20


@pytest.mark.parametrize(
    "tp, cp, pp, dp, tied, rings",
    [
        (1, 1, 1, 1, False, []),  # one GPU: no communicator
        (8, 1, 1, 1, False, [False]),  # tp inside the node
        (8, 1, 1, 4, False, [False, True]),  # dp strides over nodes
        (2, 2, 1, 2, False, [False, False, False]),  # tp, cp and the dp x cp group, all in one node
        (4, 1, 2, 1, True, [False, False]),  # tp, the embedding group of two stages in the node
        (8, 1, 2, 1, True, [False, True]),  # the last stage on the next node
    ],
)
def test_a_ring_per_collective_group_and_the_pipelines_peers(tp, cp, pp, dp, tied, rings):
    layout = Candidate.of(tp, pp, dp, 1, pp * dp, cp=cp)
    expected = BASE + sum(ring_buffer_bytes(spans) for spans in rings) + (2 * NCCL_P2P_PEER_BYTES if pp > 1 else 0)
    assert runtime_overhead_bytes(layout, 8, tied) == expected


def test_the_breakdown_counts_it_unless_given_and_ptdp_plan_prints_it(capsys):
    """memory_breakdown's overhead is the process's own on the GPU's nodes (about 1 GiB for tp 8 in
    a node and dp across nodes) unless ``overhead_bytes`` is given (``--memory-overhead-gib``)."""
    model = gpt(8, 1024, 8, vocab_size=32000, seq_length=1024)
    layout = Candidate.of(8, 1, 4, 1, 4, sequence_parallel=True)
    mem = memory_breakdown(model, layout, CATALOG["h100-sxm"])
    assert mem.overhead == runtime_overhead_bytes(layout, 8, model.tied) and 0.9 * GiB < mem.overhead < 1.1 * GiB
    assert memory_breakdown(model, layout, CATALOG["h100-sxm"], overhead_bytes=2 * GiB).overhead == 2 * GiB
    assert memory_breakdown(model, layout, CATALOG["h100-sxm"], gpus_per_node=32).overhead < mem.overhead
    base = ["plan", "--model", "llama3-8b", "--gpus", "32", "--gpu", "h100-sxm", "--global-batch-size", "32"]
    fixed = ["--tp", "8", "--pp", "1", "--micro-batch-size", "1", "--top", "1", "--json"]
    assert main([*base, *fixed]) == 0
    plan = json.loads(capsys.readouterr().out)[0]
    layout = Candidate.of(8, 1, plan["dp"], 1, 32, sequence_parallel=True)
    assert plan["memory_bytes"]["overhead"] == runtime_overhead_bytes(layout, 8, False)
    assert main([*base, *fixed, "--memory-overhead-gib", "3"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["memory_bytes"]["overhead"] == 3 * GiB


def test_groups_that_straddle_a_node_boundary_span_nodes():
    """tp 1, dp 3, pp 3 on 8-GPU nodes: the dp groups (blocks of 3) straddle nodes, and so does the
    embedding group of ranks 2 and 8; the pipeline's neighbours use send/recv buffers."""
    layout = Candidate.of(1, 3, 3, 1, 3)
    expected = BASE + ring_buffer_bytes(True) + ring_buffer_bytes(True) + 2 * NCCL_P2P_PEER_BYTES
    assert runtime_overhead_bytes(layout, 8, True) == expected
    assert runtime_overhead_bytes(Candidate.of(1, 2, 2, 1, 2), 8, True) == (
        BASE + 2 * ring_buffer_bytes(False) + 2 * NCCL_P2P_PEER_BYTES
    )
