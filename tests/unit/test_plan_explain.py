"""The planner's explanation of its pick (ptdp.planner.report.explain): which step-time terms decide
between the fastest layout and the runner-up, and how far a fixed layout is from the best."""

from __future__ import annotations

import json

from ptdp.planner.candidate import Candidate, MemoryBreakdown, Plan, TimeBreakdown
from ptdp.planner.inputs.hardware import GiB
from ptdp.planner.report.explain import compare, deciding_terms, distance_from_best, explain_pick, layout_differences


def _plan(layout: Candidate, **times) -> Plan:
    base = dict(compute=10.0, recompute=0.0, tp_comm=1.0, pp_comm=0.5, bubble=2.0, dp_comm=0.3, optimizer=0.2)
    base.update(times)
    memory = MemoryBreakdown(10 * GiB, 5 * GiB, 20 * GiB, 30 * GiB, 2 * GiB)
    return Plan(layout, True, memory, TimeBreakdown(**base), 400.0, 0.4)


A = Candidate.of(8, 16, 128, 1, 2048, virtual_stages=2)
B = A.replace(virtual_stages=1)


def test_bubble_decides_interleaving_with_its_extra_communication_against_it():
    """v = 2 halves the bubble (2 s -> 1 s) at the price of more pipeline transfers (+0.2 s):
    the bubble is named as deciding, the transfers as against."""
    faster, slower = _plan(A, bubble=1.0, pp_comm=0.7), _plan(B)
    gains, losses = deciding_terms(faster, slower)
    assert gains == ["bubble -1 s"] and losses == ["pp_comm +0.2 s"]
    lines = compare(faster, slower, faster_name="#1", slower_name="#2")
    assert lines[0] == "#1 vs #2: v 2 vs 1"
    assert lines[1] == "  5.7% faster (13.2 s vs 14 s per step)"  # (14.0 - 13.2) / 14.0
    assert "decided by bubble -1 s; against it: pp_comm +0.2 s" in lines[2]
    assert "30" not in lines[0] and lines[3].endswith("67.0 vs 67.0 GiB")


def test_terms_are_named_until_they_explain_most_of_the_gain():
    faster = _plan(A, bubble=1.0, dp_comm=0.1, tp_comm=0.95)
    slower = _plan(B)
    gains, _ = deciding_terms(faster, slower)
    assert gains == ["bubble -1 s"]  # 1.0 of 1.25 is 80%
    gains, _ = deciding_terms(faster, slower, share=0.9)
    assert gains == ["bubble -1 s", "dp_comm -0.2 s"]


def test_near_tie_is_called_one():
    lines = compare(_plan(A, bubble=1.95), _plan(B), faster_name="#1", slower_name="#2")
    assert "near tie" in lines[1] and "0.4% apart" in lines[1]


def test_explain_pick_needs_two_plans_and_differences_name_every_field():
    assert explain_pick([_plan(A)]) == []
    other = B.replace(tp=4, dp=256, sequence_parallel=True, recompute="selective")
    assert layout_differences(_plan(A), _plan(other)) == [
        "tp 8 vs 4",
        "dp 128 vs 256",
        "v 2 vs 1",
        "recompute none vs selective",
        "sp off vs on",
    ]
    lines = explain_pick([_plan(A, bubble=1.0), _plan(other)])
    assert lines[0] == "why #1:" and lines[1].startswith("#1 vs #2: tp 8 vs 4")


def test_distance_of_a_fixed_layout_from_the_best():
    best, mine = _plan(A, bubble=1.0), _plan(B)
    lines = distance_from_best(mine, best)
    assert lines[0] == "the best layout with nothing fixed:" and lines[1] == "best vs yours: v 2 vs 1"
    assert "decided by bubble -1 s" in lines[3]
    assert distance_from_best(best, best) == [
        "your fixed choices include the best layout the search finds with nothing fixed"
    ]
    assert distance_from_best(best, None) == []
    assert distance_from_best(None, best) == [
        "with nothing fixed the search finds a fitting layout: --tp 8 --pp 16 --dp 128 --micro-batch-size 1 "
        "--virtual-pipeline-stages 2 --recompute-granularity none --no-sequence-parallel "
        "--data-parallel-sharding-strategy no_shard"
    ]


def test_ptdp_plan_explains_its_pick_and_a_fixed_layouts_distance(capsys):
    """Through the CLI: the pick is explained against the runner-up; with --tp/--pp fixed, the
    report also compares the best plan under them with the best found with nothing fixed."""
    from ptdp import cli

    base = ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-80gb", "--global-batch-size", "1536"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert "why #1:\n#1 vs #2: " in out and "decided by " in out
    assert "the best layout with nothing fixed" not in out
    assert cli.main([*base, "--tp", "2", "--pp", "8"]) == 0
    out = capsys.readouterr().out
    assert "the best layout with nothing fixed:\nbest vs yours: tp " in out


def test_fixed_choices_no_layout_can_use_are_bad_requests(capsys, tmp_path):
    """Exit 2 with the rule, not "no layout fits" (exit 1): a fixed tp that does not divide the
    key/value heads, a fixed micro batch that does not divide the global batch; a --model path
    that does not exist is named as a missing file; --plot with nothing fitting writes no plot and
    says so without a failure."""
    from ptdp import cli

    base = ["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "h100-sxm", "--global-batch-size", "16"]
    assert cli.main([*base, "--tp", "16"]) == 2
    assert "num_query_groups=8 is not divisible by tp=16" in capsys.readouterr().err
    assert cli.main([*base, "--micro-batch-size", "3"]) == 2
    assert "global_batch_size=16 is not divisible by micro_batch_size=3" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(tmp_path / "missing.json"), "--gpus", "8", "--global-batch-size", "8"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    plot = tmp_path / "nf.png"
    assert (
        cli.main(
            [
                "plan",
                "--model",
                "llama3-405b",
                "--gpus",
                "8",
                "--gpu",
                "a100-80gb",
                "--global-batch-size",
                "8",
                "--plot",
                str(plot),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "no layout fits: no plot written" in err and "failed" not in err and not plot.exists()


def test_the_split_flags_the_report_prints_can_be_given_back(capsys):
    """The report's split flags (embedding and loss counted as layers, layers per virtual stage)
    plan the same layout when given back with the same pp."""
    from ptdp import cli

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
        "32",
        "--json",
    ]
    assert cli.main(base) == 0
    best = json.loads(capsys.readouterr().out)[0]
    flags = best["layer_split_flags"].split()
    assert "--num-layers-per-virtual-pipeline-stage" in flags
    assert cli.main([*base, *flags]) == 0
    again = json.loads(capsys.readouterr().out)[0]
    assert (again["virtual_stages"], again["layer_split"]) == (best["virtual_stages"], best["layer_split"])


def test_differences_say_even_and_not_set_rather_than_none():
    split = B.replace(layer_split=(7, 9), pp=2, ddp_bucket_size=1000)
    assert layout_differences(_plan(B), _plan(split)) == [
        "pp 16 vs 2",
        "layer split even vs 7,9",
        "ddp_bucket_size not set vs 1000",
    ]


def test_layout_flags_give_the_split_cp_and_non_default_options():
    from ptdp.planner.report.explain import layout_flags

    uneven = Candidate.of(2, 4, 2, 1, 64, layer_split=(5, 7, 7, 5), cp=2, cp_comm_type="all_gather")
    assert layout_flags(uneven) == (
        "--tp 2 --cp 2 --cp-comm-type all_gather --pp 4 --dp 2 --micro-batch-size 1 "
        "--decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 5 --recompute-granularity none "
        "--no-sequence-parallel --data-parallel-sharding-strategy no_shard"
    )
    options = B.replace(ddp_bucket_size=1000, overlap_grad_reduce=False, sharding="optim_grads_params")
    assert layout_flags(options.replace(reshard_after_forward=False)).endswith(
        "--data-parallel-sharding-strategy optim_grads_params --ddp-bucket-size 1000 --no-overlap-grad-reduce "
        "--no-reshard-after-forward"
    )


def test_the_experts_explanation_says_how_much_longer_the_other_plan_takes():
    """ "X% slower" is the step of the best plan it names over the best's, less one."""
    import re

    import ptdp

    result = ptdp.plan("qwen3-30b-a3b", gpus=64, gpu="h100", global_batch_size=512, seq_length=4096)
    line = next(x for x in result.explanation if "% slower" in x)
    ep, etp, shown = re.search(r"ep (\d+), etp (\d+)\)? is ([\d.]+)% slower", line).groups()
    alt = next(p for p in result.plans if (p.layout.ep, p.layout.etp) == (int(ep), int(etp)))
    assert float(shown) == round(100 * (alt.need_time().step / result.best.need_time().step - 1), 1)
