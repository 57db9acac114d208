"""Uneven pipeline splits in the planner: the candidates the search tries, memory per stage against
hand-computed bytes, the time of the busiest stage, and the split the search picks and prints."""

from __future__ import annotations

import json
import re

import pytest

from ptdp import cli
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.layout.pipeline.partition import first_last_of, first_last_split
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import get_model, gpt
from ptdp.planner.memory.activations import inflight_layer_microbatches, stage_activation_bytes
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.params import stage_param_counts
from ptdp.planner.search.layouts import Fixed, search
from ptdp.planner.search.predict import evaluate
from ptdp.planner.splits import (
    accounting_of,
    candidate_splits,
    chunk_layers,
    describe_split,
    interleaved_splits,
    split_flags,
    split_options,
)
from ptdp.planner.time.stages import edge_layer_equivalents, split_stage_times
from ptdp.planner.time.step_time import evaluate_performance

A100, H100 = CATALOG["a100-80gb"], CATALOG["h100-sxm"]
LLAMA3_405B_SPLIT = (7,) + (8,) * 14 + (7,)


@pytest.mark.parametrize(
    "layers, pp, first, last",
    [
        (126, 16, 0.01, 0.6),
        (126, 8, 0.0, 0.6),
        (96, 8, 0.0, 0.3),
        (32, 4, 0.0, 3.0),
        (7, 2, 0.0, 0.5),
        (80, 16, 0.1, 1.4),
        (61, 4, 0.0, 0.0),
        (3, 4, 0.0, 0.5),
    ],
)
def test_candidates_are_few_valid_and_expressible_with_megatrons_flags(layers, pp, first, last):
    splits = candidate_splits(layers, pp, first, last)
    assert len(splits) <= 6 and len(set(splits)) == len(splits)
    assert (splits[:1] == [None]) == (layers % pp == 0)
    for split in splits[1:] if layers % pp == 0 else splits:
        assert len(split) == pp and sum(split) == layers and min(split) >= 1
        counts = first_last_of(split)
        assert counts is not None and counts != (None, None)
        assert first_last_split(layers, pp, *counts) == split


def test_candidates_hold_llama3_405b_split():
    assert LLAMA3_405B_SPLIT in candidate_splits(126, 16, 0.0, 0.6)
    assert candidate_splits(3, 4, 0.0, 0.5) == []  # fewer layers than stages: nothing to plan


def test_flags_and_description_of_a_split():
    assert split_flags(LLAMA3_405B_SPLIT) == (
        "--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7"
    )
    assert split_flags((8,) * 15 + (6,)) == "--decoder-last-pipeline-num-layers 6"
    assert split_flags((3, 2)) == "--decoder-first-pipeline-num-layers 3"
    assert split_flags((1, 2, 3, 1)) == "--pipeline-layer-split 1,2,3,1"
    assert split_flags(None) is None
    assert describe_split(LLAMA3_405B_SPLIT) == "7, 8 x 14, 7" and describe_split((1, 2, 3)) == "1, 2, 3"


# A small GPT worked by hand: h = 64, a = 4, s = 32, V = 1000 (padded to 1024), tied, dropout,
# unfused attention; 6 layers over pp = 3 as (1, 4, 1); b = 1, m = 8, tp = dp = 1, bf16, 1F1B.
SMALL = gpt(6, 64, 4, vocab_size=1000, seq_length=32, use_flash_attn=False)
SMALL_LAYOUT = Candidate.of(tp=1, pp=3, dp=1, micro_batch_size=1, global_batch_size=8, layer_split=(1, 4, 1))


def test_memory_per_stage_of_an_uneven_split_by_hand():
    layer = 12 * 64**2 + 13 * 64  # 4 h^2 attention + 8 h^2 MLP weights, 13 h of biases and norms: 49,984
    embedding, positions, final_norm = 1024 * 64, 32 * 64, 2 * 64
    params = [1 * layer + embedding + positions, 4 * layer, 1 * layer + final_norm + embedding]  # tied copy last
    assert stage_param_counts(SMALL, 1, 3, layer_split=(1, 4, 1)) == params == [117_568, 199_936, 115_648]
    # [K22]: s b h (34 + 5 a s / h) bytes per layer and microbatch = 2048 * 44 = 90,112; 1F1B rank r
    # holds min(pp - r, m) = 3, 2, 1 microbatches; the first stage adds the embedding dropout
    # mask (1 byte, s b h per microbatch), the last one for one microbatch the final-norm and
    # output-layer inputs (2 x 2 s b h), an fp32 log-sum-exp and int64 label per token (12 s b) and
    # the bf16 logits s b V_pad (kept: far below 256 MiB)
    per_layer = 32 * 64 * (34 + 5 * 4 * 32 // 64)
    activations = [
        per_layer * 3 * 1 + 3 * 32 * 64,
        per_layer * 2 * 4,
        per_layer * 1 * 1 + 2 * 2 * 32 * 64 + 12 * 32 + 2 * 32 * 1024,
    ]
    assert activations == [276_480, 720_896, 164_224]
    for rank, n_layers in enumerate((1, 4, 1)):
        assert stage_activation_bytes(SMALL, SMALL_LAYOUT, rank, n_layers) == activations[rank]
    mem = memory_breakdown(SMALL, SMALL_LAYOUT, A100, overhead_bytes=0)
    assert mem.stage == 1  # the middle stage: four layers and two microbatches in flight
    assert (mem.params, mem.grads, mem.optimizer) == (2 * params[1], 4 * params[1], 12 * params[1])
    assert mem.activations == activations[1] and mem.total == 18 * 199_936 + 720_896
    # an uneven split's memory checks the stages that can be the largest, not one per stage
    lighter_middle = memory_breakdown(SMALL, SMALL_LAYOUT.replace(layer_split=(4, 1, 1)), A100, overhead_bytes=0)
    assert lighter_middle.stage == 0 and lighter_middle.activations == per_layer * 3 * 4 + 3 * 32 * 64


def test_busiest_stage_and_fill_of_an_uneven_split():
    layer, first, last = (1.0, 0.5, 0.25), (1.0, 0.5, 0.35), (1.6, 0.5, 0.35)  # 1 layer, + edges
    out = split_stage_times((7, 8, 8, 7), layer, first, last)
    assert out[0] == pytest.approx((7.0, 3.5, 1.85)) and out[2] == pytest.approx((7.6, 3.5, 1.85))
    assert out[1] == pytest.approx((8.0, 4.0, 2.0)) and out[3] == pytest.approx((8.0, 4.0, 2.0))
    assert out[4] == pytest.approx((30 - 8) * 1.75)  # fill and drain: the other stages' layers
    heavy_last = split_stage_times((8, 8, 8, 8), layer, first, last)
    assert heavy_last[3] == pytest.approx((8.6, 4.0, 2.1)) and heavy_last[4] == pytest.approx(24 * 1.75)


def test_uneven_step_is_the_busiest_stage_m_times_plus_fill():
    model = get_model("llama3-8b")
    layout = Candidate.of(tp=2, pp=4, dp=1, micro_batch_size=1, global_batch_size=16, layer_split=(7, 10, 10, 5))
    cluster = Cluster(H100, 8)
    perf = evaluate_performance(model, layout, cluster)
    even = evaluate_performance(model, layout.replace(layer_split=None), cluster)
    first_eq, last_eq = edge_layer_equivalents(model, layout, cluster)
    assert 0 <= first_eq < 0.1 < 1 < last_eq < 4  # the lookup is nearly free; a 128K vocabulary is not
    # busiest: a middle stage of 10 layers (5 + the loss side is lighter); its m = 16 slots
    per_layer_even = (even.time.compute + even.time.recompute + even.time.tp_comm) / 16 / (8 + last_eq)
    assert perf.time.compute + perf.time.recompute + perf.time.tp_comm == pytest.approx(
        16 * 10 * per_layer_even, rel=1e-6
    )
    p2p = perf.time.pp_comm / 16
    assert perf.time.bubble == pytest.approx((32 - 10) * per_layer_even + 3 * p2p, rel=1e-6)


def test_uneven_pipeline_sizes_share_one_note():
    result = search(get_model("llama3-405b"), Cluster(H100, 64), 64)
    uneven = [n for n in result.notes if "layers do not split evenly" in n]
    assert len(uneven) == 1, result.notes
    assert uneven[0].startswith("126 layers do not split evenly over pp = 4, 8, 16, 32, 64 stages:"), uneven


def test_search_picks_llama3_405b_split_and_notes_interleaving():
    model = get_model("llama3-405b")
    result = search(
        model, Cluster(H100, 2048), 2048, fixed=Fixed(tensor_model_parallel_size=8, pipeline_model_parallel_size=16)
    )
    assert result.plans and {p.layout.layer_split for p in result.plans} == {LLAMA3_405B_SPLIT}
    assert any("126 layers do not split evenly over pp = 16 stages" in n and "interleaved" in n for n in result.notes)
    fixed = search(
        model,
        Cluster(H100, 2048),
        2048,
        fixed=Fixed(
            tensor_model_parallel_size=8,
            pipeline_model_parallel_size=16,
            decoder_first_pipeline_num_layers=6,
            decoder_last_pipeline_num_layers=8,
        ),
    )
    assert {p.layout.layer_split for p in fixed.plans + [p for p, _ in fixed.rejected]} == {(6,) + (8,) * 15}


def test_even_split_kept_unless_an_uneven_one_is_needed_to_fit():
    """GPT-3 175B's 96 layers over pp = 8: the even split's busiest stage (12 layers + 0.3 of the
    loss side) is lighter than any 13-layer middle stage, so a layout keeps the even split unless
    that does not fit (then 9, 13 x 6, 9 takes memory off the first stage). Under 1F1B: the
    zero-bubble schedules load the last stage more."""
    model, cluster = get_model("gpt3-175b"), Cluster(A100, 1024)
    result = search(
        model,
        cluster,
        1536,
        fixed=Fixed(
            tensor_model_parallel_size=8,
            pipeline_model_parallel_size=8,
            data_parallel_size=16,
            pipeline_schedule="1f1b",
        ),
    )
    assert result.plans[0].layout.layer_split is None
    uneven = [p for p in result.plans if p.layout.layer_split is not None]
    assert uneven and all(p.layout.layer_split == (9,) + (13,) * 6 + (9,) for p in uneven)
    for plan in uneven:
        assert evaluate(model, plan.layout.replace(layer_split=None), cluster)[1].rule == "memory"


def test_plan_prints_the_split_and_its_flags(capsys):
    argv = [
        "plan",
        "--model",
        "llama3-405b",
        "--gpus",
        "16384",
        "--gpu",
        "h100-sxm",
        "--global-batch-size",
        "2048",
        "--seq-length",
        "8192",
        "--tp",
        "8",
        "--pp",
        "16",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "layers per stage 7, 8 x 14, 7" in out
    assert (
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
        "--num-layers-per-virtual-pipeline-stage 1"
    ) in out  # the best: v = 8, Llama 3's own layout
    assert "126 layers do not split evenly over pp = 16 stages" in out
    assert cli.main(argv + ["--json", "--top", "40"]) == 0
    records = [r for r in json.loads(capsys.readouterr().out) if r["fits"]]
    assert records and all(r["layer_split"] == list(LLAMA3_405B_SPLIT) for r in records)
    assert {r["virtual_stages"] for r in records} >= {1, 8}
    assert all(r["layer_split_flags"] == split_flags(LLAMA3_405B_SPLIT, r["virtual_stages"]) for r in records)
    assert "--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7" in {
        r["layer_split_flags"] for r in records
    }


def test_interleaved_splits_count_the_embedding_and_loss():
    pairs = interleaved_splits(126, 16)
    assert [v for v, _ in pairs] == [2, 4, 8] and all(s == LLAMA3_405B_SPLIT for _, s in pairs)
    assert accounting_of(LLAMA3_405B_SPLIT, 8) == (True, True) and accounting_of((4, 4), 2) is None
    assert interleaved_splits(7, 4) == [(2, (2, 2, 2, 1)), (2, (1, 2, 2, 2))]  # 7 + 1 (loss; embedding) in 4 x 2
    assert split_options(LLAMA3_405B_SPLIT, 8) == {
        "account_for_embedding_in_pipeline_split": True,
        "account_for_loss_in_pipeline_split": True,
        "num_layers_per_virtual_pipeline_stage": 1,
    }
    assert split_options(LLAMA3_405B_SPLIT) == {
        "decoder_first_pipeline_num_layers": 7,
        "decoder_last_pipeline_num_layers": 7,
    }
    assert split_options((1, 2, 3, 1)) == {"pipeline_layer_split": (1, 2, 3, 1)} and split_options(None) == {}
    assert split_options((3, 5), 2) is None and split_flags((3, 5), 2) is None


def test_every_searched_split_runs_in_ptdp_train():
    """Each fitting plan's split, given to ptdp train by the options the report prints, passes its
    rules (every plan can run), interleaved ones included (plans with context parallelism, which
    ptdp train does not run yet, left out)."""
    model = get_model("llama3-405b")
    result = search(
        model, Cluster(H100, 16384), 2048, fixed=Fixed(tensor_model_parallel_size=8, pipeline_model_parallel_size=16)
    )
    config = ModelConfig(
        num_layers=126,
        hidden_size=16384,
        num_attention_heads=128,
        num_query_groups=8,
        ffn_hidden_size=53248,
        seq_length=8192,
        vocab_size=128256,
    )
    assert {p.layout.virtual_stages for p in result.plans} >= {1, 8}
    for plan in (p for p in result.plans if p.layout.cp == 1):
        lay = plan.layout
        parallel = ParallelConfig(
            tensor_model_parallel_size=lay.tp,
            pipeline_model_parallel_size=lay.pp,
            data_parallel_size=lay.dp,
            **split_options(lay.layer_split, lay.virtual_stages),
        )
        resolved = resolve(
            Config(
                model=config,
                parallel=parallel,
                train=TrainConfig(micro_batch_size=lay.micro_batch_size, global_batch_size=2048),
            ),
            16384,
        )
        assert resolved.pipeline.virtual_stages == lay.virtual_stages
        assert resolved.pipeline.layer_split == lay.layer_split


def test_plan_with_the_embedding_and_loss_counted(capsys):
    base = [
        "plan",
        "--model",
        "llama3-405b",
        "--gpus",
        "16384",
        "--gpu",
        "h100-sxm",
        "--global-batch-size",
        "2048",
        "--seq-length",
        "8192",
        "--tp",
        "8",
        "--pp",
        "16",
        "--json",
        "--top",
        "50",
    ]
    both = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    assert cli.main(base + both) == 0
    records = [r for r in json.loads(capsys.readouterr().out) if r["fits"]]
    assert {r["virtual_stages"] for r in records} <= {1, 2, 4, 8} and 8 in {r["virtual_stages"] for r in records}
    assert all(r["layer_split"] == list(LLAMA3_405B_SPLIT) for r in records)
    assert cli.main(base + both + ["--virtual-pipeline-stages", "4"]) == 0
    records = [r for r in json.loads(capsys.readouterr().out) if r["fits"]]
    assert records and {r["virtual_stages"] for r in records} == {4}
    assert (
        cli.main(base + ["--no-account-for-embedding-in-pipeline-split", "--no-account-for-loss-in-pipeline-split"])
        == 0
    )
    assert {r["virtual_stages"] for r in json.loads(capsys.readouterr().out) if r["fits"]} == {1}
    assert cli.main(base + ["--account-for-loss-in-pipeline-split"]) == 2
    assert (
        "num_layers=126 + the loss counted as layers = 127 is not divisible by pp*v = 16*1" in capsys.readouterr().err
    )
    assert cli.main(base + both + ["--decoder-first-pipeline-num-layers", "7"]) == 2
    assert "cannot be combined with decoder_first_pipeline_num_layers=7" in capsys.readouterr().err


def test_layers_in_flight_of_an_interleaved_split_with_the_embedding_and_loss_counted():
    """4 layers + 2 over 2 ranks x 3 chunks: rank 0's chunks hold 0, 1, 1 layers, rank 1's 1, 1, 0.
    By hand (m = 4): rank 0 runs 6 warm-up forwards of chunks 0 0 1 1 2 2 (4 layers) and never holds
    more; rank 1 runs 4 (chunks 0 0 1 1: 4 layers), then forward chunk 2 / backward chunk 2 twice,
    then forward chunk 0 (5 layers held, no loss side: both chunk-2 backwards done) / backward chunk 1.
    The even formula would say 7/3 x 2 and 5/3 x 2; the dist test checks these against ptdp's saved
    bytes (tests/dist/test_planner_activations.py)."""
    layout = Candidate.of(1, 2, 1, 2, 8, virtual_stages=3, layer_split=(2, 2))
    assert chunk_layers((2, 2), 3, 0) == (0, 1, 1) and chunk_layers((2, 2), 3, 1) == (1, 1, 0)
    assert inflight_layer_microbatches(layout, 0, 2) == (4.0, None)
    assert inflight_layer_microbatches(layout, 1, 2) == (5.0, 0.0)
    # a heavy loss side moves the peak to where a loss is held: 4 layers + 1 loss (forward of chunk 2)
    assert inflight_layer_microbatches(layout, 1, 2, loss_weight=10.0) == (4.0, 1.0)
    even = layout.replace(layer_split=None, virtual_stages=2)
    assert inflight_layer_microbatches(even, 0, 2) == (2 * (2 + 2 + 1) / 2, None)  # the usual formula
    # Llama 3 405B's layout at m = 16: every chunk's forwards in flight on rank 0 (7 x 16 layers)
    meta = Candidate.of(8, 16, 128, 1, 2048, virtual_stages=8, layer_split=LLAMA3_405B_SPLIT)
    assert inflight_layer_microbatches(meta, 0, 7)[0] == 112.0


def test_no_balanced_split_is_a_rejection_not_a_crash(capsys):
    """6 layers with a 150,000-word vocabulary: at pp = 4 the output layer outweighs every middle
    stage, no candidate split exists, and those layouts are rejected with the reason (the search
    used to fail on an empty candidate list)."""
    from ptdp import cli

    code = cli.main(
        [
            "plan",
            "--num-layers",
            "6",
            "--hidden-size",
            "512",
            "--num-attention-heads",
            "8",
            "--ffn-hidden-size",
            "2048",
            "--vocab-size",
            "150000",
            "--seq-length",
            "1024",
            "--gpus",
            "8",
            "--gpu",
            "a100-80gb",
            "--global-batch-size",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "fit" in out
    assert "num_layers=6 has no balanced split over pp=4 stages" in out


def test_fixed_virtual_stages_still_count_the_embedding_and_loss_as_layers(capsys):
    """--pp 16 --virtual-pipeline-stages 8 fixes Llama 3 405B's own layout: 126 layers do not
    split over 128 chunks, but with the embedding and the loss counted as layers they do, as the
    unconstrained search finds (it used to reject every such layout when v was fixed)."""
    from ptdp import cli

    code = cli.main(
        [
            "plan",
            "--model",
            "llama3-405b",
            "--gpus",
            "16384",
            "--gpu",
            "h100-sxm",
            "--global-batch-size",
            "2048",
            "--seq-length",
            "8192",
            "--pp",
            "16",
            "--virtual-pipeline-stages",
            "8",
            "--json",
        ]
    )
    plans = [p for p in json.loads(capsys.readouterr().out) if p["fits"]]
    assert code == 0 and plans
    assert all(p["virtual_stages"] == 8 and tuple(p["layer_split"]) == (7,) + (8,) * 14 + (7,) for p in plans)


@pytest.mark.parametrize(
    ("layers", "mtp", "pp", "v", "split", "counted"),
    [
        (62, 1, 8, 4, None, (True, True)),  # DeepSeek-V3 in Megatron-Bridge's layout, Et|(tt|)*30mL
        (62, 1, 16, 1, (4,) * 15 + (2,), (False, False)),
        (32, 0, 4, 2, None, (False, False)),
        (31, 0, 4, 2, None, (True, False)),
        (94, 0, 32, 3, None, (True, True)),  # Qwen3-235B, pp 32 v 3
        (30, 2, 4, 1, (8, 8, 8, 6), (False, False)),
    ],
)
def test_a_megatron_layout_reads_back_as_the_split_that_writes_it(layers, mtp, pp, v, split, counted):
    from ptdp.planner.splits import layout_split, megatron_layout

    text = megatron_layout(layers, mtp, pp, v, split, counted)
    assert layout_split(text, layers, mtp, pp, None) == (v, split, counted, None)
    assert layout_split(text, layers, mtp, pp, v)[0] == v


def test_megatron_layout_strings_repeat_and_break_rules_by_name():
    from ptdp.planner.splits import expand_megatron_layout, layout_split

    assert expand_megatron_layout("Et|(tt|)*2t m L") == ["Et", "tt", "tt", "tmL"]
    assert expand_megatron_layout("Et*4|((t*2)*2|)*2tmL") == ["Etttt", "tttt", "tttt", "tmL"]
    # Megatron-Bridge's DeepSeek-V3 on pp 2: uneven chunks, planned as the nearest even ones
    v, split, counted, nearest = layout_split("Et*4|(t*4|)*14tmL", 62, 1, 2, None)
    assert (v, split, counted) == (8, None, (True, True)) and nearest == "Ettt|" + "tttt|" * 14 + "ttmL"
    for text, pp, message in (
        ("Et|(tt|)*29mL", 8, "31 segments do not split over pp = 8"),
        ("tE|(tt|)*30mL", 8, "E (the embedding) begins the first segment"),
        ("Et|(tt|)*30Lm", 8, "L (the loss) ends the last segment"),
        ("Em|(tt|)*30tL", 8, "the MTP modules (m) come after every transformer layer"),
        ("Et|(tt|)*30tL", 8, "62 t and 0 m, the model has 61 transformer layers and 1 MTP modules"),
        ("Et|(tt|*30mL", 8, "an unmatched '('"),
        ("Et|x", 1, "'x' at character 4"),
        ("Et*|mL", 2, "'*' at character 3 needs a count"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            layout_split(text, 62, 1, pp, None)
    with pytest.raises(ValueError, match="are v = 4 chunks, not 2"):
        layout_split("Et|(tt|)*30mL", 62, 1, 8, 2)


def test_ptdp_plan_takes_back_the_layout_it_prints(capsys):
    """An MTP model's report prints Megatron-Core's layout; given back with
    --pipeline-model-parallel-layout it plans the same layout (v, the embedding and the loss
    counted as layers); the other split flags with it, or no pp, exit 2."""
    base = ["plan", "--model", "deepseek-v3", "--gpus", "1024", "--gpu", "h100", "--global-batch-size", "8192"]
    base += ["--tp", "2", "--pp", "8", "--ep", "64", "--recompute-granularity", "selective", "--top", "1"]
    base += ["--micro-batch-size", "1", "--cp", "1", "--recompute-modules", "mla_up_proj", "mlp", "--fp8"]
    counted = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    assert cli.main([*base, *counted, "--virtual-pipeline-model-parallel-size", "4"]) == 0
    printed = capsys.readouterr().out
    layout = printed.split('--pipeline-model-parallel-layout "')[1].split('"')[0]
    assert layout == "Et|" + "tt|" * 30 + "mL"
    assert cli.main([*base, "--pipeline-model-parallel-layout", "Et|(tt|)*30mL"]) == 0
    again = capsys.readouterr().out
    best = next(line for line in printed.splitlines() if line.startswith("best:"))
    assert best in again and f'--pipeline-model-parallel-layout "{layout}"' in again
    assert cli.main([*base, *counted, "--pipeline-model-parallel-layout", layout]) == 2
    assert "places the layers itself: drop --account-for-embedding" in capsys.readouterr().err
    no_pp = [a for a in base if a not in ("--pp", "8")]
    assert cli.main([*no_pp, "--pipeline-model-parallel-layout", layout]) == 2
    assert "needs --pipeline-model-parallel-size" in capsys.readouterr().err
