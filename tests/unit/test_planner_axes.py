"""Context parallelism and data-parallel sharding strategies in the planner: bytes per rank and
communication time per the formulas of :mod:`ptdp.planner.time.cp_exchange` and
:mod:`ptdp.planner.memory.strategies`, hand-computed here; the search over cp and strategies; the 128K stage
of Llama 3 405B planned as fitting (pure, no processes)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ptdp import cli
from ptdp.layout.buckets import chunk_by_chunk
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster, get_gpu
from ptdp.planner.inputs.models import get_model, gpt
from ptdp.planner.memory.activations import rank_activation_bytes
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.cp_local import kv_buffer_bytes
from ptdp.planner.memory.params import layer_param_count, stage_param_counts
from ptdp.planner.search.layouts import Fixed, search
from ptdp.planner.time.collectives import Links, hierarchical_all_reduce_time
from ptdp.planner.time.cp_exchange import kv_exchange_times
from ptdp.planner.time.data_parallel import sharded_dp_times
from ptdp.planner.time.step_time import evaluate_performance

H100 = CATALOG["h100-sxm"]
LINKS = Links(
    nvlink_bandwidth=400e9, network_bandwidth=40e9, nvlink_latency=5e-6, network_latency=10e-6, gpus_per_node=8
)
# a small Llama-like model: grouped-query attention, SwiGLU, no dropout; s divisible by 2 * 8
LLAMA = gpt(
    4,
    256,
    8,
    num_query_groups=2,
    ffn_hidden_size=512,
    vocab_size=1000,
    seq_length=1024,
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("recompute,sp", [("none", False), ("none", True), ("selective", True)])
def test_activations_per_rank_are_divided_by_cp_plus_the_kv_buffers(flash, recompute, sp):
    """Every kept tensor is per token of the rank's s/cp tokens; an unfused kernel's scores are
    (s/cp) x s per rank, 1/cp of s x s too. On top: the key/value buffers of the running layer."""
    model = dataclasses.replace(LLAMA, use_flash_attn=flash)
    base = Candidate.of(
        tp=2, pp=2, dp=1, micro_batch_size=2, global_batch_size=8, recompute=recompute, sequence_parallel=sp
    )
    for pp_rank in (0, 1):
        one = rank_activation_bytes(model, base, pp_rank, 2)
        for cp, comm in ((2, "p2p"), (4, "p2p"), (8, "all_gather")):
            layout = base.replace(cp=cp, cp_comm_type=comm)
            d, kv, t, b, s = 256 // 8, 2, 2, 2, 1024
            block = (s / cp) * b * kv * d / t  # one K (or V) block of a rank, elements
            buffers = 2 * (8 * block if comm == "p2p" else 4 * cp * block)  # 2-byte values
            assert kv_buffer_bytes(model, 2, cp, b, comm) == buffers
            assert rank_activation_bytes(model, layout, pp_rank, 2) == pytest.approx(one / cp + buffers, rel=1e-12)


def test_memory_breakdown_counts_the_cp_rank():
    layout = Candidate.of(tp=2, pp=1, dp=1, micro_batch_size=1, global_batch_size=4, cp=4)
    mem = memory_breakdown(LLAMA, layout, H100)
    assert mem.activations == rank_activation_bytes(LLAMA, layout, 0, 4)
    assert mem.params == 2 * stage_param_counts(LLAMA, 2, 1)[0]  # parameters are replicated over cp


def test_ring_exchange_bytes_and_overlap():
    """p2p: cp - 1 steps of K and V blocks (2 B e bytes each way) per layer forward, exposed by what
    a step exceeds one block's attention; backward the same steps with the float32 dK, dV
    accumulators too, and their last hop home exposed (what ptdp's ring sends,
    cp_attention_comm); NVLink only while tp * cp fits a node."""
    b, cp, tp, e = 1, 4, 2, 2
    block_bytes = (1024 / cp) * b * 2 * 32 / tp * e
    step_nvlink = 2 * block_bytes / 400e9 + 5e-6
    fwd, bwd = kv_exchange_times(LLAMA, tp, cp, b, "p2p", 0.0, LINKS)
    assert fwd == pytest.approx((cp - 1) * step_nvlink, rel=1e-12)
    grad_block = block_bytes / e * 4  # dK, dV accumulators travel in float32
    last_hop = 2 * grad_block / 400e9 + 5e-6  # dK, dV home, after the last block's backward
    assert bwd == pytest.approx(
        (cp - 1) * ((2 * block_bytes + 2 * grad_block) / 400e9 + 5e-6) + last_hop, rel=1e-12
    )  # K, V, dK, dV per step
    hidden_backward = kv_exchange_times(LLAMA, tp, cp, b, "p2p", 0.0, LINKS, 2, block_attention_backward=1.0)
    assert hidden_backward == pytest.approx(((cp - 1) * step_nvlink, last_hop))
    assert kv_exchange_times(LLAMA, tp, cp, b, "p2p", 1.0, LINKS) == pytest.approx((0.0, last_hop))  # hidden
    half = kv_exchange_times(LLAMA, tp, cp, b, "p2p", step_nvlink / 2, LINKS)[0]
    assert half == pytest.approx((cp - 1) * step_nvlink / 2, rel=1e-12)
    # tp 4 x cp 4 = 16 > 8 GPUs per node: the ring crosses the network
    block4 = (1024 / cp) * b * 2 * 32 / 4 * e
    assert kv_exchange_times(LLAMA, 4, cp, b, "p2p", 0.0, LINKS)[0] == pytest.approx(
        (cp - 1) * (2 * block4 / 40e9 + 10e-6), rel=1e-12
    )
    # all-gather of K and V (2 cp blocks) once forward, gather + reduce-scatter backward, not hidden
    gather = 0.5 * hierarchical_all_reduce_time(2 * cp * block_bytes, cp, 4, LINKS)
    scatter = 0.5 * hierarchical_all_reduce_time(2 * cp * grad_block, cp, 4, LINKS)  # float32 dK, dV
    assert kv_exchange_times(LLAMA, tp, cp, b, "all_gather", 1.0, LINKS) == pytest.approx((gather, gather + scatter))
    assert kv_exchange_times(LLAMA, tp, 1, b, "p2p", 0.0, LINKS) == (0.0, 0.0)


def test_each_strategy_bytes_per_rank_hand_computed():
    """bf16: no_shard 2+4+12, optim 2+4+12/d, optim_grads 2+4/d+12/d + the fp32 gradient buckets
    alive at once, optim_grads_params (2+4+12)/d + the gathered 16-bit units + those buckets;
    d = dp*cp (ptdp.planner.memory.transients)."""
    model = dataclasses.replace(LLAMA, num_layers=2, vocab_size=5000)
    n = stage_param_counts(model, 1, 1)[0]
    layer = layer_param_count(model, 1)
    assert layer == (256 + 2 * 64) * 256 + 256 * 256 + 3 * 512 * 256 + 2 * 256  # QKV (GQA), proj, SwiGLU, norms
    embedding, head = 5120 * 256, 5120 * 256 + 256  # V padded to 5120; untied output and RMSNorm weight
    assert n == embedding + 2 * layer + head and n % 8 == layer % 8 == head % 8 == 0  # no padding
    d = 2 * 4
    # optim_grads: one 40 M bucket holds the stage (allocated when backward starts: it holds the
    # output layer). optim_grads_params: a bucket per unit (embeddings, layer 0, layer 1, head);
    # gathered at most the last layer and the head (the largest neighbours); gradient buckets at
    # most the head's (in flight) and both layers' (the head's lands when layer 0's starts)
    expect = {
        "no_shard": (2 * n, 4 * n, 12 * n),
        "optim": (2 * n, 4 * n, 12 * n / d),
        "optim_grads": (2 * n, 4 * n / d + 4 * n, 12 * n / d),
        # the float32 shard is the main copy: 4 + 4 + 8 bytes per parameter over d, bf16 gathered units
        "optim_grads_params": (4 * n / d + 2 * (layer + head), 4 * n / d + 4 * (2 * layer + head), 8 * n / d),
    }
    for strategy, (params, grads, optimizer) in expect.items():
        layout = Candidate.of(tp=1, pp=1, dp=2, micro_batch_size=1, global_batch_size=2, cp=4, sharding=strategy)
        assert layout.parallel.use_distributed_optimizer == (strategy != "no_shard")
        mem = memory_breakdown(model, layout, H100)
        assert (mem.params, mem.grads, mem.optimizer) == pytest.approx((params, grads, optimizer), rel=1e-12)
    # one rank holds the state alone: nothing to shard, no transient counted; its float32 copy of
    # the parameters is still the main copy
    alone = memory_breakdown(model, Candidate.of(1, 1, 1, 1, 1, sharding="optim_grads_params"), H100)
    assert (alone.params, alone.grads, alone.optimizer) == (4 * n, 4 * n, 8 * n)


def test_sharded_communication_times():
    """optim: reduce-scatter + all-gather, each half an all-reduce; optim_grads: a reduce-scatter
    per microbatch, hidden behind its backward but the last; optim_grads_params: no weight
    all-gather after the step, two gathers of every unit per microbatch, the first exposed."""
    g, p, u = 4e9, 2e9, 1e8
    kw = dict(
        grad_bytes=g,
        param_bytes=p,
        unit_param_bytes=u,
        tp=8,
        shard=64,
        units=10,
        layer_forward=0.001,
        layer_backward=0.002,
        links=LINKS,
    )
    ar = lambda nbytes: hierarchical_all_reduce_time(nbytes, 64, 1, LINKS)  # noqa: E731 - tp 8 fills the node
    rs, ag, unit_ag = ar(g) / 2, ar(p) / 2, ar(u) / 2
    assert sharded_dp_times("no_shard", num_microbatches=4, microbatch_backward=0.0, **kw) == pytest.approx(ar(g))
    assert sharded_dp_times("optim", num_microbatches=4, microbatch_backward=0.0, **kw) == pytest.approx(rs + ag)
    grads = sharded_dp_times("optim_grads", num_microbatches=4, microbatch_backward=0.0, **kw)
    assert grads == pytest.approx(4 * rs + ag)
    assert sharded_dp_times("optim_grads", num_microbatches=4, microbatch_backward=10.0, **kw) == pytest.approx(rs + ag)
    params = sharded_dp_times("optim_grads_params", num_microbatches=4, microbatch_backward=10.0, **kw)
    per_microbatch = 2 * unit_ag + 9 * max(0, unit_ag - 0.001) + 9 * max(0, unit_ag - 0.002)
    assert params == pytest.approx(4 * per_microbatch + rs)
    # a first stage's embeddings' unit is gathered in forward only: one gather fewer per backward
    embeddings = sharded_dp_times(
        "optim_grads_params", num_microbatches=4, microbatch_backward=10.0, backward_units=9, **kw
    )
    assert embeddings == pytest.approx(4 * (per_microbatch - max(0, unit_ag - 0.002)) + rs)
    one = dict(kw, shard=1)
    assert sharded_dp_times("optim_grads_params", num_microbatches=4, microbatch_backward=0.0, **one) == 0.0


def test_cp_divides_the_step_work_and_reduces_over_dp_times_cp():
    """cp = 2 on 2 GPUs vs dp = 2 at B = 2: per rank 2 microbatches of s/2 tokens, each attending
    to all s keys, vs 1 microbatch of s tokens: the same FLOPs (only GEMM shapes differ), a
    key/value exchange, gradients reduced over 2 ranks either way."""
    for flash in (True, False):
        model = dataclasses.replace(LLAMA, use_flash_attn=flash, seq_length=4096)
        cluster = Cluster(H100, 2, 8)
        cp = evaluate_performance(model, Candidate.of(1, 1, 1, 1, 2, cp=2), cluster)
        dp = evaluate_performance(model, Candidate.of(1, 1, 2, 1, 2), cluster)
        assert cp.time.cp_comm >= 0 and dp.time.cp_comm == 0  # the ring hides behind attention here
        assert cp.time.dp_comm == pytest.approx(dp.time.dp_comm)
        assert cp.time.compute == pytest.approx(dp.time.compute, rel=0.1)
        assert cp.model_flops == dp.model_flops
        half = evaluate_performance(dataclasses.replace(model, seq_length=2048), Candidate.of(1, 1, 2, 1, 2), cluster)
        assert cp.time.compute > 1.2 * half.time.compute  # not just s/cp tokens: attention sees all s keys


def test_layout_fields_and_json():
    layout = Candidate.of(8, 16, 8, 1, 16, cp=16, sharding="optim")
    assert layout.num_gpus == 16384 and layout.shard_size == 128 and layout.parallel.use_distributed_optimizer
    assert Candidate.of(1, 1, 2, 1, 2, distributed_optimizer=True).sharding_strategy == "optim"
    assert Candidate.of(1, 1, 2, 1, 2).sharding_strategy == "no_shard"
    assert Candidate.of(1, 1, 2, 1, 2).replace(distributed_optimizer=True).sharding_strategy == "optim"


LLAMA_405B_128K = ["plan", "--model", "llama3-405b", "--gpus", "16384", "--gpu", "h100-sxm", "--seq-length", "131072"]
SPLIT = "7," + "8," * 14 + "7"


@pytest.mark.parametrize("batch", ["16", "128"])
def test_llama3_405b_128k_stage_fits_as_published(batch, capsys):
    """Llama 3 405B's long-context stage (Dubey et al. 2024, §3.3.2 and Table 4: tp 8, cp 16, pp 16,
    dp 8 on 16,384 H100, 16M tokens per batch = 128 sequences of 131,072 tokens, 16 per
    data-parallel rank) is planned as fitting, with 128 sequences and with 16, at most with the
    optimizer state and gradients sharded (§3.3.2: its FSDP shards both, not the parameters)."""
    assert (
        cli.main(
            [
                *LLAMA_405B_128K,
                "--global-batch-size",
                batch,
                "--tp",
                "8",
                "--cp",
                "16",
                "--pp",
                "16",
                "--pipeline-layer-split",
                SPLIT,
                "--json",
            ]
        )
        == 0
    )
    plans = json.loads(capsys.readouterr().out)
    best = plans[0]
    assert best["fits"] and (best["tp"], best["cp"], best["pp"], best["dp"]) == (8, 16, 16, 8)
    assert best["global_batch_size"] == int(batch)
    assert best["sharding"] in ("no_shard", "optim", "optim_grads") and "cp_comm" in best["time_s"]
    assert best["memory_bytes"]["total"] <= get_gpu("h100-sxm").memory_bytes


def test_search_uses_cp_for_long_sequences_only():
    model = dataclasses.replace(get_model("llama3-405b"), seq_length=131072)
    cluster = Cluster(get_gpu("h100-sxm"), 16384, 8)
    result = search(model, cluster, 16)
    assert result.plans and all(p.layout.cp > 1 for p in result.plans[:10])
    assert all(131072 // p.layout.cp >= 1024 and 131072 % (2 * p.layout.cp) == 0 for p in result.plans)
    fixed = search(
        model,
        cluster,
        16,
        fixed=Fixed(
            tensor_model_parallel_size=8,
            context_parallel_size=16,
            pipeline_model_parallel_size=16,
            pipeline_layer_split=(7,) + (8,) * 14 + (7,),
        ),
    )
    assert fixed.plans and all(p.layout.cp == 16 and p.layout.dp == 8 for p in fixed.plans)
    short = search(dataclasses.replace(model, seq_length=4096), Cluster(get_gpu("h100-sxm"), 2048, 8), 512)
    assert short.plans and {p.layout.cp for p in short.plans + [pl for pl, _ in short.rejected]} == {1}


def test_search_stops_at_the_first_sharded_strategy_that_fits():
    """A more sharded strategy is tried only where the less sharded ones do not fit; each kept
    plan is no slower than the more sharded strategies of the same layout, up to the optimizer's
    sharded gradient traffic, but those reducing chunk by chunk, of which optim_grads is kept too."""
    model = get_model("llama3-8b")
    cluster = Cluster(get_gpu("h100-sxm"), 64, 8)
    result = search(
        model, cluster, 256, fixed=Fixed(micro_batch_size=1, recompute_granularity="none", sequence_parallel=True)
    )
    order = ("no_shard", "optim", "optim_grads", "optim_grads_params")
    seen = {}
    for plan in result.plans:
        key = plan.layout.replace(sharding=None, distributed_optimizer=False, layer_split=None)
        seen.setdefault(key, []).append(plan)
    assert seen
    for plans in seen.values():
        sharded = [
            p
            for p in plans
            if p.layout.sharding_strategy != "no_shard"
            and not chunk_by_chunk(
                p.layout.sharding_strategy,
                p.layout.shard_size,
                p.layout.virtual_stages,
                p.layout.num_microbatches,
                p.layout.pp,
            )
        ]  # always evaluated
        assert len(sharded) <= 1
        for plan in sharded:
            level = order.index(plan.layout.sharding_strategy)
            for more in order[level + 1 :]:
                by_chunk = chunk_by_chunk(
                    more,
                    plan.layout.shard_size,
                    plan.layout.virtual_stages,
                    plan.layout.num_microbatches,
                    plan.layout.pp,
                )
                if by_chunk:  # optim_grads then kept beside (it can be faster), params sharded too never faster
                    assert any(p.layout.sharding_strategy == "optim_grads" for p in plans), plans
                    continue
                other = evaluate_performance(model, plan.layout.replace(sharding=more), cluster)
                n = plan.memory.params / 2  # 16-bit weights of the stage
                slack = 8 * n / (cluster.gpu.memory_bandwidth * 0.5)
                assert other.time.step >= plan.time.step - slack


def test_plan_flag_errors_exit_2(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "h100-sxm", "--global-batch-size", "64"]
    assert cli.main([*base, "--use-distributed-optimizer", "--data-parallel-sharding-strategy", "no_shard"]) == 2
    assert "contradicts" in capsys.readouterr().err
    assert cli.main([*base, "--tp", "8", "--cp", "3"]) == 2
    assert "does not divide the 64 GPUs (rule: tp * cp * pp * dp = GPUs)" in capsys.readouterr().err
    # a fixed cp no layout can use is a bad request (exit 2), not "no layout fits"
    assert cli.main([*base, "--tp", "8", "--cp", "8", "--seq-length", "8200", "--json"]) == 2
    assert "seq_length=8200 is not divisible by 2*context_parallel_size = 2*8 = 16" in capsys.readouterr().err


def test_cp_comm_type_flag_plans_the_all_gather(capsys):
    """--cp-comm-type all_gather: the all-gather's buffers (4 cp B e) instead of the ring's (8 B e)
    and its exchange exposed; p2p by default."""
    args = [
        *LLAMA_405B_128K,
        "--global-batch-size",
        "16",
        "--tp",
        "8",
        "--cp",
        "16",
        "--pp",
        "16",
        "--pipeline-layer-split",
        SPLIT,
        "--micro-batch-size",
        "1",
        "--recompute-granularity",
        "none",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--json",
        "--top",
        "1",
    ]
    plans = {}
    for comm in ("p2p", "all_gather"):
        assert cli.main([*args, "--cp-comm-type", comm]) == 0
        plans[comm] = json.loads(capsys.readouterr().out)[0]
        assert plans[comm]["cp_comm_type"] == comm
    assert cli.main(args) == 0
    assert json.loads(capsys.readouterr().out)[0]["cp_comm_type"] == "p2p"
    model = get_model("llama3-405b")
    block = 131072 / 16 * 1 * 8 * 128 / 8 * 2  # one K block of a rank, bytes
    extra = plans["all_gather"]["memory_bytes"]["activations"] - plans["p2p"]["memory_bytes"]["activations"]
    assert extra == pytest.approx(4 * 16 * block - 8 * block, rel=1e-9)
    assert model.kv_heads == 8 and plans["all_gather"]["time_s"]["cp_comm"] > plans["p2p"]["time_s"]["cp_comm"]
