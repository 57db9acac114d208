"""ptdp plan for mixture-of-experts models: the search's expert rules are ptdp train's, the flags,
the exchange model's expected node counts, the load-imbalance factor, model FLOPs with MLA and MTP,
the experts' state per rank, the explanation, and the validation against published runs."""

from __future__ import annotations

import dataclasses
import json
import math
from itertools import combinations

import pytest

from ptdp import cli, load_config
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.errors import ConfigError
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import MOE_PRESETS, llama
from ptdp.planner.inputs.moe_model import MoEModel, with_moe, with_mtp
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.moe_params import expert_bytes_per_param, stage_counts
from ptdp.planner.memory.strategies import strategy_bytes_per_param
from ptdp.planner.search.predict import evaluate
from ptdp.planner.search.rules import expert_rejections
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, MOE_FIT_FIELDS
from ptdp.planner.time.flops import model_flops_per_step
from ptdp.planner.time.moe_time import parts_hit
from ptdp.planner.validate.published_moe import (
    default_moe_csv,
    fit_moe_constants,
    load_moe_runs,
    memory_checks,
    moe_errors,
)

H100 = CATALOG["h100-sxm"]
SMALL = llama(4, 64, 4, 2, 96, 512, 32)


@pytest.mark.parametrize(
    "experts,topk,ffn,tp,pp,dp,ep,etp,sp",
    [
        (8, 2, 32, 1, 1, 4, 4, 1, False),
        (8, 2, 32, 1, 1, 4, 3, 1, False),  # E % ep
        (6, 2, 32, 1, 2, 2, 4, 1, False),  # E % ep
        (8, 2, 32, 2, 1, 2, 2, 2, True),  # etp > 1 with linear biases: not run yet
        (8, 2, 32, 2, 1, 2, 2, 1, True),
        (8, 2, 30, 2, 1, 2, 2, 4, True),  # world % (etp ep pp), F % etp
        (8, 2, 32, 2, 1, 2, 2, 1, False),  # MoE at tp > 1 needs sequence parallelism
        (8, 9, 32, 1, 1, 2, 2, 1, False),  # k > E
        (8, 2, 32, 1, 2, 2, 8, 1, False),  # the expert grid does not fit the world
    ],
)
def test_the_search_refuses_exactly_the_expert_layouts_ptdp_train_refuses(experts, topk, ffn, tp, pp, dp, ep, etp, sp):
    moe = MoEConfig(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn)
    model = with_moe(ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32), moe)
    world = tp * pp * dp
    planner = bool(expert_rejections(model, tp, pp, world, ep, etp, sp, "alltoall"))
    try:
        load_config(
            world_size=world,
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            seq_length=32,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            sequence_parallel=sp,
            num_experts=experts,
            moe_router_topk=topk,
            moe_ffn_hidden_size=ffn,
            global_batch_size=8 * dp,
            micro_batch_size=1,
        )
        trainer = False
    except ConfigError as e:
        trainer = True
        assert "expert" in str(e) or "moe" in str(e).lower() or "routed" in str(e), e
    assert planner == trainer


def test_parts_hit_is_the_expected_number_of_shares_holding_a_tokens_experts():
    """4 experts in 2 shares, 2 picked: both in one share with probability 2 / C(4, 2)."""
    assert parts_hit(4, 2, 2) == pytest.approx(2 * (1 - 1 / 6))
    assert parts_hit(256, 8, 1) == 1.0
    brute = sum(len({e // 2 for e in pick}) for pick in combinations(range(8), 3)) / math.comb(8, 3)
    assert parts_hit(8, 3, 4) == pytest.approx(brute)


def test_moe_flags_make_and_change_the_planned_model(capsys):
    base = ["plan", "--gpus", "64", "--gpu", "h100", "--global-batch-size", "256", "--top", "1"]
    assert cli.main([*base, "--model", "llama3-8b", "--num-experts", "8", "--moe-router-topk", "2"]) == 0
    out = capsys.readouterr().out
    assert "E=8 k=2" in out and "experts: ep" in out
    assert cli.main([*base, "--model", "mixtral-8x7b", "--moe-load-imbalance", "0.5"]) == 2
    assert "--moe-load-imbalance 0.5 must be in [1, 8]" in capsys.readouterr().err
    assert cli.main([*base, "--model", "llama3-8b", "--moe-load-imbalance", "1.5"]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err
    assert cli.main([*base, "--model", "llama3-8b", "--ep", "8"]) == 2  # no layout of a dense model has experts
    assert "expert_model_parallel_size=8 needs --num-experts" in capsys.readouterr().err
    for value in ("inf", "nan", "9"):
        assert cli.main([*base, "--model", "mixtral-8x7b", "--moe-load-imbalance", value]) == 2
        assert "must be in [1, 8]" in capsys.readouterr().err
    assert cli.main([*base, "--model", "mixtral-8x7b", "--ep", "3"]) == 2
    assert "num_experts=8 is not divisible by expert_model_parallel_size=3" in capsys.readouterr().err
    assert cli.main([*base, "--model", "mixtral-8x7b", "--etp", "0"]) == 2
    assert "expert_tensor_parallel_size=0 must be a positive integer" in capsys.readouterr().err
    assert cli.main([*base, "--model", "mixtral-8x7b", "--tp", "2", "--no-sequence-parallel"]) == 2
    assert "MoE with tensor_model_parallel_size=2 needs --sequence-parallel" in capsys.readouterr().err
    assert cli.main([*base, "--model", "mixtral-8x7b", "--no-sequence-parallel"]) == 0  # tp 1 runs without


def test_mtp_layers_are_layers_of_the_last_stage_and_flags_change_them():
    v3 = MOE_PRESETS["deepseek-v3"]
    assert (v3.num_layers, v3.main_layers, v3.mtp_layers, len(v3.moe_layer_ids)) == (62, 61, 1, 59)
    none = with_mtp(v3, 0)
    assert (none.num_layers, len(none.moe_layer_ids)) == (61, 58)
    dense, _ = stage_counts(v3, 1, 2, 64, 1, (31, 31))
    dense0, _ = stage_counts(none, 1, 2, 64, 1, (31, 30))
    h = v3.hidden_size
    assert dense[0] == dense0[0]
    assert dense[1] - dense0[1] > 2 * h * h  # an MoE layer's attention and router, and the projection


def test_model_flops_of_deepseek_v3_count_mla_experts_and_mtp():
    """3 x forward FLOPs per token: 2 x every weight a token passes through (MLA's projections,
    k routed and the shared expert, the router, dense MLPs, the MTP projection, the output layer
    twice) plus the full s x s attention of (qk + v) channels per head."""
    v3 = MOE_PRESETS["deepseek-v3"]
    moe, mla = v3.moe, v3.mla
    assert mla is not None
    h, a, s, l = v3.hidden_size, v3.num_attention_heads, v3.seq_length, v3.num_layers
    attention = sum(o * i for o, i in mla.weight_shapes(h, a).values())
    routed = moe.moe_router_topk * 3 * h * 2048 + 3 * h * 2048 + moe.num_experts * h
    mlp = 3 * (l - len(v3.moe_layer_ids)) * h * 18432 + len(v3.moe_layer_ids) * routed
    weights = l * attention + mlp + 2 * h * h + 2 * v3.vocab_size * h
    core = l * 2 * s * a * (mla.qk_head_dim + mla.v_head_dim)
    per_token = 2 * weights + core
    assert model_flops_per_step(v3, 8, moe) == pytest.approx(3 * 8 * s * per_token, rel=1e-9)


def test_a_load_imbalance_slows_the_exchanges_and_the_experts_and_grows_activations():
    model = dataclasses.replace(MOE_PRESETS["mixtral-8x7b"], use_flash_attn=True)
    layout = Candidate.of(1, 4, 16, 1, 256, 8, sharding="optim", ep=8)
    cluster = Cluster(H100, 64)
    even, _ = evaluate(model, layout, cluster)
    skewed, _ = evaluate(dataclasses.replace(model, load_imbalance=1.5), layout, cluster)
    assert skewed.need_time().ep_comm > even.need_time().ep_comm
    assert skewed.need_time().compute > even.need_time().compute
    assert skewed.need_memory().activations > even.need_memory().activations
    capped = dataclasses.replace(
        model, load_imbalance=1.5, moe=dataclasses.replace(model.moe, moe_expert_capacity_factor=1.0)
    )
    assert capped.expert_load == 1.0


@pytest.mark.parametrize("shared", [0, 64])
def test_an_moe_layer_pays_the_tp_collectives_ptdp_train_runs(shared):
    """At tp 2 with sequence parallelism an MoE layer's routed experts take the sequence shard: its
    tensor-parallel time is the attention's half of a dense layer's, all of it with a shared expert
    (whose MLP gathers and scatters as a dense one does); full recompute repeats the same."""
    from ptdp.planner.time.constants import DEFAULT_CONSTANTS, links_for
    from ptdp.planner.time.stages import layer_terms

    moe = MoEConfig(
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_layer_freq=(0, 1, 1, 1),
        moe_shared_expert_intermediate_size=shared or None,
    )
    model = with_moe(SMALL, moe)
    cluster = Cluster(H100, 8)
    c = DEFAULT_CONSTANTS.for_gpu(H100)
    args = (H100.sustained_peak("bf16"), H100.memory_bandwidth * c.hbm_efficiency, links_for(cluster, c), c, 2.0)
    share = 1.0 if shared else 1.0 - 0.75 / 2
    for recompute in ("none", "full"):
        layout = Candidate.of(2, 1, 4, 1, 8, recompute=recompute, sequence_parallel=True, ep=2)
        dense, moe_terms = layer_terms(SMALL, layout, *args), layer_terms(model, layout, *args)
        assert dense.tp_comm > 0
        assert moe_terms.tp_comm == pytest.approx(share * dense.tp_comm, rel=1e-12)


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_memory_breakdown_holds_the_experts_as_ptdp_train_does(strategy, ep, etp):
    """The dense buffer under the strategy over dp, the routed experts (ep or etp > 1) whole with
    their Adam state over edp: the counts the planner report checks exactly against ptdp train."""
    moe = MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    model = dataclasses.replace(with_moe(SMALL, moe), use_flash_attn=True)
    assert isinstance(model, MoEModel)
    layout = Candidate.of(2, 1, 4, 1, 8, sequence_parallel=True, precision="bf16", sharding=strategy, ep=ep, etp=etp)
    mem = memory_breakdown(model, layout, H100, overhead_bytes=0.0)
    dense, own = stage_counts(model, 2, 1, ep, etp)
    per = strategy_bytes_per_param("bf16", strategy, 4)
    expert = expert_bytes_per_param("bf16", layout.parallel)
    assert (mem.params, mem.grads, mem.optimizer) == pytest.approx(
        tuple(dense[0] * p + own[0] * e for p, e in zip(per, expert))
    )
    assert (own[0] == 0) == (ep * etp == 1)


def test_the_explanation_says_where_the_exchanges_run(capsys):
    assert (
        cli.main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--gpu", "h100", "--global-batch-size", "256"])
        == 0
    )
    out = capsys.readouterr().out
    assert "experts: ep " in out and "of the step exposed" in out
    assert "ep_comm" in out and " ep  etp " in out


@pytest.fixture(scope="module")
def moe_runs():
    path = default_moe_csv()
    if path is None:
        pytest.skip("benchmarks/data/published_moe_validation.csv not in this checkout")
    return load_moe_runs(path)


def test_published_moe_runs_are_planned_at_their_layouts_within_the_targets(moe_runs):
    """At least 12 runs from 3 sources; step-time error mean <= 8%, max <= 15%; every published
    layout fits the planner's memory."""
    assert len(moe_runs) >= 12 and len({run.source_key for run in moe_runs}) >= 3
    errors = [abs(e) for _, _, e in moe_errors(moe_runs)]
    assert not any(math.isnan(e) for e in errors)
    assert sum(errors) / len(errors) <= 0.08, errors
    assert max(errors) <= 0.15, errors
    assert all(total <= cap for _, total, cap in memory_checks(moe_runs))


def test_the_validation_report_refits_without_each_row_even_where_two_share_a_layout(moe_runs):
    """Two published runs at one layout (one prediction, two step times) each get their own
    error with their source left out, and the summary's mean counts every row."""
    import re

    from ptdp.commands.validate import moe_validation_markdown

    mixtral = [run for run in moe_runs if run.name == "Mixtral-8x7B"]
    qwen = [run for run in moe_runs if run.name == "Qwen3-30B-A3B" and run.source_key != mixtral[0].source_key][:2]
    assert len(mixtral) == 2 and mixtral[0].flags() == mixtral[1].flags()
    assert mixtral[0].step_time != mixtral[1].step_time
    out = moe_validation_markdown(mixtral + qwen)
    table = out.split("\n\n")[0].splitlines()[2:]  # the step times, one row per run in order
    held = [float(line.split("|")[-2].strip().rstrip("%")) / 100 for line in table]
    assert len(held) == 4
    one, two = ((1 + e) * run.step_time for e, run in zip(held, mixtral))
    assert held[0] != held[1] and one == pytest.approx(two, rel=2e-3)
    mean = float(re.search(r"refitted without it: mean ([0-9.]+)%", out).group(1))
    assert mean == pytest.approx(100 * sum(abs(e) for e in held) / 4, abs=0.06)
    alone = moe_validation_markdown(mixtral)  # one source: nothing left to refit on
    assert "2 runs from 1 source: " in alone and "one source: no refit without it." in alone
    assert all(line.endswith("| n/a |") for line in alone.split("\n\n")[0].splitlines()[2:])


def test_hopper_moe_constants_are_the_grid_least_squares_fit(moe_runs):
    """A change to the time model must come with a refit: the MoE constants (Hopper's are the
    plain fields) are the grid's argmin over the published H100 runs at the layouts they plan."""
    fitted = fit_moe_constants(moe_runs, DEFAULT_CONSTANTS)
    assert {f: getattr(fitted, f) for f in MOE_FIT_FIELDS} == DEFAULT_CONSTANTS.moe_fit("hopper")


def test_the_flex_dispatcher_is_planned_and_refused_by_ptdp_train(capsys):
    base = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu", "h100", "--global-batch-size", "1024"]
    base += ["--tp", "1", "--pp", "1", "--cp", "1", "--ep", "16", "--micro-batch-size", "1", "--top", "1", "--json"]
    steps = {}
    for name, extra in {
        "alltoall": [],
        "flex": ["--moe-token-dispatcher-type", "flex"],
        "deepep": ["--moe-flex-dispatcher-backend", "deepep"],
    }.items():
        assert cli.main([*base, *extra]) == 0
        steps[name] = json.loads(capsys.readouterr().out)[0]["time_s"]["ep_comm"]
    assert steps["flex"] == steps["deepep"] < steps["alltoall"]  # a token crosses to the other node once
    assert cli.main([*base, "--moe-token-dispatcher-type", "allgather", "--moe-flex-dispatcher-backend", "deepep"]) == 2
    assert "is the backend of --moe-token-dispatcher-type flex" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--moe-token-dispatcher-type flex with --num-experts: ptdp train does not"):
        load_config(world_size=2, num_experts=4, expert_model_parallel_size=2, moe_token_dispatcher_type="flex")


def test_an_ep_group_whose_ranks_sit_etp_apart_leaves_the_node_sooner():
    """ep 2 x etp 4 on 4-GPU nodes: the two ep ranks are 4 apart, in two nodes."""
    from ptdp.planner.time.collectives import Links
    from ptdp.planner.time.moe_time import exchange_time

    links = Links(400e9, 50e9, 5e-6, 1e-5, 4)
    inside = exchange_time(1e9, 2, links, stride=1)
    apart = exchange_time(1e9, 2, links, stride=4)
    assert apart == pytest.approx(0.5e9 / 50e9 + 5e-6 + 1e-5) and inside == pytest.approx(0.5e9 / 400e9 + 5e-6)


def test_mtp_models_print_megatrons_pipeline_layout(capsys):
    flags = ["--model", "deepseek-v3", "--gpus", "1024", "--gpu", "h100", "--tp", "2", "--pp", "8", "--cp", "1"]
    flags += ["--virtual-pipeline-model-parallel-size", "4", "--ep", "64", "--global-batch-size", "8192"]
    assert cli.main(["plan", *flags, "--recompute-granularity", "full", "--top", "1"]) == 0
    out = capsys.readouterr().out
    layout = "Et|" + "tt|" * 30 + "mL"  # Megatron-Bridge's DeepSeek-V3 layout, 'Et|(tt|)*30mL'
    assert f'--pipeline-model-parallel-layout "{layout}" with --num-layers 61 --mtp-num-layers 1' in out


def test_mlp_recompute_runs_the_dense_layers_mlps_only_and_the_overlap_where_megatron_allows_it():
    model = dataclasses.replace(MOE_PRESETS["mixtral-8x7b"], use_flash_attn=True)  # every layer MoE
    cluster = Cluster(H100, 64)
    layout = Candidate.of(1, 4, 16, 1, 256, 8, "selective", sharding="optim", ep=8, recompute_modules=("layernorm",))
    with_mlp = layout.replace(recompute_modules=("layernorm", "mlp"))
    a, b = evaluate(model, layout, cluster)[0], evaluate(model, with_mlp, cluster)[0]
    assert a.need_time().recompute == pytest.approx(b.need_time().recompute)
    from ptdp.planner.time.stages import moe_overlap_applies

    assert moe_overlap_applies(layout)
    assert not moe_overlap_applies(layout.replace(recompute="full"))
    assert not moe_overlap_applies(layout.replace(virtual_stages=1, layer_split=None))  # pp 4 without chunks
    assert not moe_overlap_applies(layout.replace(ep=1))
    assert not moe_overlap_applies(layout.replace(dispatcher="allgather"))


def test_cuda_graphs_of_the_moe_router_drop_the_moe_layers_fixed_cost(capsys):
    """--cuda-graph-impl with a scope holding the MoE layers' router and preprocessing (planner
    only, Megatron-Core's flags): each MoE layer of each micro-batch sheds moe_layer_overhead; a
    scope without them, or a dense model, changes nothing and says so; a scope without an
    implementation is refused (exit 2)."""
    from ptdp.config.keywords import RaisingParser
    from ptdp.planner.inputs.plan_flags import add_plan_arguments
    from ptdp.planner.request import prepare

    base = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu", "h100", "--global-batch-size", "1024"]
    base += ["--tp", "1", "--pp", "1", "--cp", "1", "--ep", "16", "--micro-batch-size", "1", "--top", "1"]
    base += ["--recompute-granularity", "none", "--data-parallel-sharding-strategy", "optim"]
    parser = RaisingParser(prog="ptdp plan", add_help=False)
    add_plan_arguments(parser)

    def planned(*extra: str) -> tuple[dict, str]:
        assert cli.main([*base, *extra, "--json"]) == 0
        times = json.loads(capsys.readouterr().out)[0]["time_s"]
        return times, " ".join(prepare(parser.parse_args([*base[1:], *extra])).notes)

    eager, _ = planned()
    model = MOE_PRESETS["qwen3-30b-a3b"]
    saved = model.num_layers * (1024 // 16) * DEFAULT_CONSTANTS.moe_layer_overhead  # 48 MoE layers, m 64
    for graphs in (
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "moe_router", "moe_preprocess"],
        ["--external-cuda-graph", "--cuda-graph-scope", "moe_router"],
        ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
        ["--enable-cuda-graph"],  # whole layers
    ):
        times, notes = planned(*graphs)
        assert times["compute"] == pytest.approx(eager["compute"] - saved, rel=1e-12), graphs
        assert "CUDA graphs replay the MoE layers' router" in notes
    times, notes = planned("--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn")
    assert times == eager and "change no time of this plan" in notes
    dense = ["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "64", "--cuda-graph-impl", "local"]
    assert "change no time of this plan" in " ".join(prepare(parser.parse_args(dense)).notes)
    assert cli.main([*base, "--cuda-graph-scope", "moe_router"]) == 2
    assert (
        "--cuda-graph-scope moe_router needs --cuda-graph-impl local or transformer_engine" in capsys.readouterr().err
    )
    searched = base[: base.index("--recompute-granularity")] + ["--enable-cuda-graph", "--top", "50", "--json"]
    assert cli.main(searched) == 0
    recomputes = {plan["recompute"] for plan in json.loads(capsys.readouterr().out)}
    assert recomputes and "full" not in recomputes  # Megatron-Core captures no graphs with full recompute
    import ptdp

    with pytest.raises(ConfigError, match="needs --cuda-graph-impl"):
        ptdp.plan("qwen3-30b-a3b", gpus=16, global_batch_size=1024, gpu="h100", cuda_graph_scope=["moe"])


@pytest.mark.parametrize("sp", [False, True])
def test_mlp_recompute_saves_only_the_dense_layers_activations(sp):
    """--recompute-modules mlp recomputes dense MLPs (Megatron-Core's module): an all-MoE model keeps
    what it keeps without it; with one dense layer of four, a quarter of the dense saving."""
    from ptdp.planner.memory.activations import layer_activation_bytes

    moe = MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    tp = 2 if sp else 1
    for freq, share in (((1,), 0.0), ((0, 1, 1, 1), 0.25)):
        model = with_moe(SMALL, dataclasses.replace(moe, moe_layer_freq=freq))

        def kept(modules, m=model):
            return layer_activation_bytes(m, tp, 1, sequence_parallel=sp, recompute="selective", modules=modules)

        def dense_kept(modules):
            return layer_activation_bytes(SMALL, tp, 1, sequence_parallel=sp, recompute="selective", modules=modules)

        saved = dense_kept(("layernorm",)) - dense_kept(("layernorm", "mlp"))
        for base in ((), ("layernorm",), ("core_attn",)):
            dense_saving = dense_kept(base) - dense_kept((*base, "mlp"))
            assert kept(base) - kept((*base, "mlp")) == pytest.approx(share * dense_saving, rel=1e-12), (freq, base)
        assert saved > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--enable-cuda-graph", "--external-cuda-graph"], "both name the CUDA graph implementation: give one"),
        (["--enable-cuda-graph", "--cuda-graph-impl", "none"], "both name the CUDA graph implementation"),
        (["--cuda-graph-impl", "none", "--cuda-graph-scope", "attn"], "needs --cuda-graph-impl local or"),
        (["--enable-cuda-graph", "--recompute-granularity", "full"], "no graphs with full recompute"),
        (["--cuda-graph-impl", "local", "--cuda-graph-scope", "moe_router"], "not moe_router"),
        (["--external-cuda-graph", "--cuda-graph-scope", "full_iteration"], "full_iteration needs --cuda-graph-impl"),
        (["--external-cuda-graph", "--cuda-graph-scope", "moe", "moe_router"], "two captures of one router"),
        (["--external-cuda-graph", "--cuda-graph-scope", "moe_preprocess"], "with moe_router only"),
        (["--external-cuda-graph", "--cuda-graph-scope", "attn", "mlp"], "every layer is an MoE layer"),
        (["--external-cuda-graph"], "(capturing attn moe, Megatron-Core's default): moe is captured only when"),
        (
            ["--external-cuda-graph", "--cuda-graph-scope", "moe", "--moe-token-dispatcher-type", "allgather"],
            "allgather",
        ),
        (
            ["--external-cuda-graph", "--cuda-graph-scope", "moe_router", "moe_preprocess"]
            + ["--moe-expert-capacity-factor", "1.0"],
            "moe_preprocess is not captured with a capacity",
        ),
    ],
)
def test_cuda_graph_flags_follow_megatrons_rules(flags, message, capsys):
    base = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu", "h100", "--global-batch-size", "1024"]
    assert cli.main([*base, "--ep", "16", *flags]) == 2
    assert message in capsys.readouterr().err


def test_delay_wgrad_compute_comes_with_the_moe_overlap(capsys):
    """Megatron-Core's --delay-wgrad-compute needs --overlap-moe-expert-parallel-comm; with it, the
    same plan as the overlap alone, and the note names both."""
    base = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu", "h100", "--global-batch-size", "1024"]
    base += ["--tp", "1", "--pp", "2", "--cp", "1", "--ep", "8", "--micro-batch-size", "1", "--top", "1"]
    base += ["--virtual-pipeline-model-parallel-size", "12", "--recompute-granularity", "none"]
    assert cli.main([*base, "--delay-wgrad-compute"]) == 2
    assert "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm" in capsys.readouterr().err
    overlap = [*base, "--overlap-moe-expert-parallel-comm", "--data-parallel-sharding-strategy", "optim"]
    assert cli.main([*overlap, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)[0]["time_s"]
    assert cli.main([*overlap, "--delay-wgrad-compute", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["time_s"] == alone
    assert cli.main([*overlap, "--delay-wgrad-compute"]) == 0
    assert "(--overlap-moe-expert-parallel-comm, with --delay-wgrad-compute)" in capsys.readouterr().out


def test_cuda_graphs_that_capture_the_moe_layers_whole_need_drop_and_pad(capsys):
    base = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu", "h100", "--global-batch-size", "1024"]
    base += ["--tp", "1", "--pp", "1", "--cp", "1", "--ep", "16", "--micro-batch-size", "1", "--top", "1"]
    padded = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
    assert cli.main([*base, *padded, "--external-cuda-graph"]) == 0  # attn moe
    assert "CUDA graphs replay the MoE layers' router" in capsys.readouterr().out
    dense = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "64", "--top", "1"]
    assert cli.main([*dense, "--external-cuda-graph", "--cuda-graph-scope", "moe_router"]) == 2
    assert "need a mixture-of-experts model" in capsys.readouterr().err


def test_validation_rows_that_cannot_be_planned_are_errors(tmp_path, capsys):
    import csv as csv_module

    path = default_moe_csv()
    if path is None:
        pytest.skip("no validation table in this checkout")
    rows = list(csv_module.reader(open(path, encoding="utf-8")))
    header = rows[0]
    for column, value, message in (
        ("ep", "3", "num_experts=128 is not divisible by expert_model_parallel_size=3"),
        ("gpus", "0", "gpus=0 must be a positive integer"),
        ("precision", "fp4", "precision='fp4' must be bf16 or fp8"),
        ("reported", "inf", "reported=inf"),
        ("cuda_graph_impl", "te", "cuda_graph_impl='te' must be empty or one of none, local, transformer_engine"),
        ("cuda_graph_scope", "router", "cuda_graph_scope='router': ['router'] not in"),
    ):
        bad = [header, list(rows[1])]
        bad[1][header.index(column)] = value
        table = tmp_path / f"{column}.csv"
        with open(table, "w", newline="", encoding="utf-8") as f:
            csv_module.writer(f).writerows(bad)
        assert cli.main(["plan", "--validate", str(table)]) == 2
        assert message in capsys.readouterr().err
    bad = [header, list(rows[1])]
    bad[1][header.index("cuda_graph_impl")], bad[1][header.index("cuda_graph_scope")] = "", "moe_router"
    table = tmp_path / "scope_alone.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        csv_module.writer(f).writerows(bad)
    assert cli.main(["plan", "--validate", str(table)]) == 2
    assert f"{table}:2: --cuda-graph-scope moe_router needs --cuda-graph-impl" in capsys.readouterr().err
    with open(table, "w", newline="", encoding="utf-8") as f:
        csv_module.writer(f).writerows([[*header, "tp"], [*rows[1], "2"]])
    assert cli.main(["plan", "--validate", str(table)]) == 2
    assert "column 'tp' named twice in the header" in capsys.readouterr().err
    graphs = [i for i, name in enumerate(header) if name.startswith("cuda_graph")]
    assert len(graphs) == 2  # a table may leave them out: no graphs
    at = next(i for i, row in enumerate(rows[1:]) if row[graphs[0]])
    graphed = rows[1 + at]
    table = tmp_path / "no_graph_columns.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        csv_module.writer(f).writerows([[v for i, v in enumerate(r) if i not in graphs] for r in (header, graphed)])
    with_graphs, (without,) = load_moe_runs(path)[at], load_moe_runs(table)
    assert dict(with_graphs.options)["cuda_graph_impl"] == "transformer_engine"
    misspelt = [name.replace("cuda_graph_impl", "cuda_graph_imp") for name in header]
    with open(table, "w", newline="", encoding="utf-8") as f:  # the implementation unread: no graphs
        csv_module.writer(f).writerows([[v for i, v in enumerate(r) if i != graphs[1]] for r in (misspelt, graphed)])
    assert cli.main(["plan", "--validate", str(table)]) == 0
    assert "note: columns not read (not among the table's): cuda_graph_imp" in capsys.readouterr().out
    assert dict(without.options) == {k: v for k, v in with_graphs.options if not k.startswith("cuda_graph")}


def test_the_python_api_takes_one_number_for_moe_layer_freq():
    import ptdp

    result = ptdp.plan("llama3-8b", gpus=8, gpu="h100", global_batch_size=64, num_experts=8, moe_layer_freq=2, top=1)
    assert result.model.moe.moe_layers(4) == (True, False, True, False) and result.plans
