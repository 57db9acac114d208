"""Planner search: validity of what it proposes, the published layouts, and the CLI."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.models import PRESETS, gpt
from ptdp.planner.search import predict
from ptdp.planner.search.layouts import Fixed, search
from ptdp.planner.search.predict import evaluate
from ptdp.planner.splits import split_options
from ptdp.planner.time.constants import DEFAULT_CONSTANTS

CSV = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "published_runs.csv"
A100 = CATALOG["a100-80gb"]


def table1_rows() -> list[dict]:
    with open(CSV, newline="") as f:
        return [r for r in csv.DictReader(f) if r["source"].startswith("Narayanan")]


@pytest.mark.parametrize("row", table1_rows(), ids=lambda r: r["model"])
def test_search_beats_or_matches_published_layout_and_lists_it_as_fitting(row):
    model = gpt(
        int(row["layers"]),
        int(row["hidden"]),
        int(row["heads"]),
        vocab_size=int(row["vocab"]),
        seq_length=int(row["seq_len"]),
    )
    gpus, big_b = int(row["gpus"]), int(row["global_batch"])
    cluster = Cluster(A100, gpus)
    published = Candidate.of(
        int(row["tp"]),
        int(row["pp"]),
        int(row["dp"]),
        int(row["micro_batch"]),
        big_b,
        int(row["vpp"]),
        "full",
        False,
        False,
        "fp16",
    )
    result = search(model, cluster, big_b, precision="fp16")
    fitting = {p.layout: p for p in result.plans}
    assert published in fitting, f"published layout {published} not listed as fitting"
    assert result.plans[0].time.step <= fitting[published].time.step


def test_every_proposed_layout_passes_ptdp_train_validation():
    model = PRESETS["gpt-7.5b"]
    cluster = Cluster(A100, 64)
    result = search(model, cluster, 256)
    assert result.plans
    mc = ModelConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        seq_length=model.seq_length,
        vocab_size=model.vocab_size,
    )
    assert any(plan.layout.layer_split for plan in result.plans)  # 36 layers: uneven splits at pp = 8
    for plan in result.plans:
        lay = plan.layout
        # a searched split is given to ptdp train by the options the report prints
        options = dict(split_options(lay.layer_split, lay.virtual_stages))
        if lay.virtual_stages > 1:
            options.setdefault(
                "num_layers_per_virtual_pipeline_stage", model.num_layers // (lay.pp * lay.virtual_stages)
            )
        cfg = Config(
            model=mc,
            parallel=ParallelConfig(
                tensor_model_parallel_size=lay.tp,
                pipeline_model_parallel_size=lay.pp,
                data_parallel_size=lay.dp,
                pipeline_schedule=lay.parallel.schedule,
                **options,
            ),
            train=TrainConfig(micro_batch_size=lay.micro_batch_size, global_batch_size=256, lr_warmup_iters=1),
        )
        resolve(cfg, 64)  # raises ConfigError for an invalid layout
        assert lay.tp <= 8 and plan.memory.total <= A100.memory_bytes
        if lay.parallel.schedule == "interleaved-1f1b":
            assert lay.num_microbatches % lay.pp == 0 and model.num_layers % (lay.pp * lay.virtual_stages) == 0
    ranked = [p.time.step for p in result.plans]
    assert ranked == sorted(ranked)


def test_memory_rejection_says_by_how_much():
    plan, rejection = evaluate(PRESETS["gpt3-175b"], Candidate.of(8, 1, 1, 1, 8), Cluster(A100, 8))
    assert not plan.fits and rejection.rule == "memory"
    assert "GiB > 80.00 GiB" in plan.reasons[0]


def test_fixed_choices_evaluate_one_layout():
    fixed = Fixed(
        tensor_model_parallel_size=8,
        pipeline_model_parallel_size=8,
        data_parallel_size=16,
        micro_batch_size=1,
        virtual_pipeline_model_parallel_size=3,
        recompute_granularity="selective",
        sequence_parallel=True,
        use_distributed_optimizer=False,
    )
    result = search(PRESETS["gpt3-175b"], Cluster(A100, 1024), 1536, fixed=fixed)
    assert [p.layout for p in result.plans] == [Candidate.of(8, 8, 16, 1, 1536, 3, "selective", True, False)]
    by_chunk = search(
        PRESETS["gpt3-175b"],
        Cluster(A100, 1024),
        1536,
        fixed=Fixed(
            tensor_model_parallel_size=8,
            pipeline_model_parallel_size=8,
            micro_batch_size=1,
            num_layers_per_virtual_pipeline_stage=4,
        ),
    )
    assert {p.layout.virtual_stages for p in by_chunk.plans} == {3}


BAD_REQUESTS = [
    (["--tp", "3"], "tp=3 does not divide the 64 GPUs"),
    (["--tp", "8", "--pp", "8", "--dp", "4"], "tp=8 * pp=8 * dp=4 = 256 does not divide the 64 GPUs"),
    (["--tp", "8", "--pp", "2", "--dp", "2"], "tp*pp*dp = 8*2*2 = 32 != 64 GPUs"),
    (["--global-batch-size", "0"], "global_batch_size=0 must be a positive integer"),
    (["--tp", "0"], "tp=0 must be a positive integer"),
    (["--micro-batch-size", "-1"], "micro_batch_size=-1 must be a positive integer"),
    (["--num-query-groups", "7"], "num_attention_heads=96 is not divisible by num_query_groups=7"),
    (["--num-layers", "0"], "num_layers=0 must be a positive integer"),
    (["--memory-overhead-gib", "-5"], "memory overhead -5 GiB must be a finite number >= 0"),
    (["--top", "0"], "top=0 must be a positive integer"),
    (["--gpus-per-node", "0"], "--gpus-per-node=0 must be a positive integer"),
    (["--gpu-catalog", "/nonexistent.toml"], "--gpu-catalog /nonexistent.toml"),
    (["--plot", "/nonexistent/x.png"], "--plot /nonexistent/x.png: folder /nonexistent does not exist"),
]


@pytest.mark.parametrize("extra,message", BAD_REQUESTS, ids=[m[:30] for _, m in BAD_REQUESTS])
def test_bad_requests_are_clear_errors(extra, message, capsys):
    from ptdp import cli

    code = cli.main(["plan", "--model", "gpt3-175b", "--gpus", "64", "--global-batch-size", "1536", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_tensor_parallel_groups_never_straddle_nodes():
    from ptdp.planner.inputs.models import gpt

    model = gpt(24, 3072, 24)
    result = search(model, Cluster(A100, 24), 96, fixed=Fixed(tensor_model_parallel_size=6))
    assert not result.plans
    assert any("tp=6 does not divide the 8 GPUs of a node" in p.reasons[0] for p, _ in result.rejected)
    assert all(8 % p.layout.tp == 0 for p in search(model, Cluster(A100, 24), 96).plans)


def test_explicit_uneven_layer_split_is_planned():
    """--pipeline-layer-split fixes pp and v = 1; memory and time use the given split, and a split
    that does not add up is rejected with the config's rule."""
    from ptdp.planner.inputs.hardware import CATALOG, Cluster
    from ptdp.planner.inputs.models import get_model
    from ptdp.planner.memory.breakdown import memory_breakdown
    from ptdp.planner.search.layouts import Fixed, search

    model = get_model("llama3-405b")  # 126 layers: no even split over 16 stages
    split = (7,) + (8,) * 14 + (7,)
    cluster = Cluster(CATALOG["a100-80gb"], 2048, 8)
    result = search(model, cluster, 2048, fixed=Fixed(tensor_model_parallel_size=8, pipeline_layer_split=split))
    assert result.plans
    for plan in result.plans:
        assert plan.layout.pp == 16 and plan.layout.virtual_stages == 1 and plan.layout.layer_split == split
        assert plan.memory == memory_breakdown(model, plan.layout, cluster.gpu, layer_split=split)
        assert plan.to_json()["layer_split"] == split
    searched = search(
        model, cluster, 2048, fixed=Fixed(tensor_model_parallel_size=8, pipeline_model_parallel_size=16)
    )  # the search picks Llama 3's own split
    assert searched.plans and all(p.layout.layer_split == split for p in searched.plans)
    assert all(r.rule != "layers % pp" for _, r in searched.rejected)
    bad = search(
        get_model("gpt-1.7b"), Cluster(CATALOG["a100-80gb"], 8, 8), 64, fixed=Fixed(pipeline_layer_split=(5, 7, 7, 4))
    )
    assert not bad.plans
    assert all("summing to num_layers=24 (sum is 23)" in p.reasons[0] for p, _ in bad.rejected)


def test_uneven_split_shifts_memory_to_the_heavier_stage():
    from ptdp.planner.candidate import Candidate
    from ptdp.planner.inputs.hardware import CATALOG
    from ptdp.planner.inputs.models import get_model
    from ptdp.planner.memory.breakdown import memory_breakdown

    model, gpu = get_model("gpt-1.7b"), CATALOG["a100-80gb"]
    even = memory_breakdown(model, Candidate.of(1, 4, 2, 1, 64), gpu)
    heavy_first = memory_breakdown(model, Candidate.of(1, 4, 2, 1, 64, layer_split=(9, 5, 5, 5)), gpu)
    assert heavy_first.stage == 0 and heavy_first.params > even.params and heavy_first.activations > even.activations


def test_layer_split_request_errors(capsys):
    from ptdp.cli import main

    base = ["plan", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch-size", "64"]
    assert main(base + ["--pipeline-layer-split", "6,6,6,6", "--pp", "2"]) != 0
    assert "--pipeline-layer-split 6,6,6,6 has 4 stages but --pp 2" in capsys.readouterr().err
    assert main(base + ["--pipeline-layer-split", "8,8,8"]) != 0
    assert "pp=3 does not divide the 8 GPUs" in capsys.readouterr().err
    assert main(base + ["--pipeline-layer-split", "6,6,6,6", "--virtual-pipeline-stages", "2"]) != 0
    assert "cannot be combined with virtual pipeline stages" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--pipeline-layer-split", "0,24"], "each >= 1, summing to num_layers=24"),
        (["--pipeline-layer-split", "10,10"], "(sum is 20)"),
        (["--memory-overhead-gib", "nan"], "must be a finite number >= 0"),
        (["--memory-overhead-gib", "inf"], "must be a finite number >= 0"),
    ],
)
def test_bad_plan_numbers_are_request_errors(extra, message, capsys):
    from ptdp.cli import main

    code = main(["plan", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch-size", "64"] + extra)
    assert code == 2 and message in capsys.readouterr().err


def _captured_figure(monkeypatch):
    import matplotlib.figure

    captured = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: captured.append(fig))
    return captured


def test_plot_draws_every_listed_layout_with_labelled_capacity_and_legends_beside_the_bars(monkeypatch):
    from ptdp.planner.report.render import ABBREVIATIONS, plot, time_axis_floor

    result = search(PRESETS["gpt3-175b"], Cluster(A100, 1024), 1536)
    captured = _captured_figure(monkeypatch)
    plot(result, "unused.png", capacity_bytes=A100.memory_bytes, top=10)
    fig = captured[0]
    ax_m, ax_t, ax_s = fig.axes
    for ax in (ax_m, ax_t, ax_s):
        assert [t.get_text().split()[0] for t in ax.get_xticklabels()] == [f"#{i}" for i in range(1, 11)]
    for ax in (ax_m, ax_t):
        legend = ax.get_legend()
        assert legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1 - 1  # beside, not on, the bars
    assert any(t.get_text() == "GPU capacity (80 GiB)" for t in ax_m.get_legend().get_texts())
    steps = [p.time.step for p in result.plans[:10]]
    assert ax_s.get_ylim()[0] == time_axis_floor(steps) > 0.5 * min(steps)  # zoomed near the data
    assert "axis starts at" in ax_s.get_ylabel() and ax_t.get_ylim()[0] == 0
    assert any(" ".join(t.get_text().split()) == ABBREVIATIONS for t in fig.texts)
    assert "do: distributed optimizer" in ABBREVIATIONS
    assert time_axis_floor([1.0, 3.0]) == 0.0


@pytest.mark.parametrize("top", [1, 10])
def test_plot_footer_lies_inside_the_figure_below_the_tick_labels(monkeypatch, tmp_path, top):
    """Rendered with Agg: the footnote's window extent is within the figure and under every axes'
    tick labels, for the narrowest figure (one layout) and a wide one."""
    import matplotlib.figure

    from ptdp.planner.report.render import ABBREVIATIONS, plot

    boxes = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        real_savefig(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        footer = next(t for t in fig.texts if " ".join(t.get_text().split()) == ABBREVIATIONS)
        boxes.append((footer.get_window_extent(renderer), fig.bbox, [ax.get_tightbbox(renderer) for ax in fig.axes]))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot(
        search(PRESETS["gpt-1.7b"], Cluster(A100, 8), 64),
        str(tmp_path / "plan.png"),
        capacity_bytes=A100.memory_bytes,
        top=top,
    )
    footer, figure, axes = boxes[0]
    assert figure.x0 <= footer.x0 and footer.x1 <= figure.x1, (footer, figure)
    assert figure.y0 <= footer.y0 and footer.y1 <= figure.y1, (footer, figure)
    assert all(footer.y1 <= ax.y0 for ax in axes), (footer, axes)
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_timeline_marks_iterations_and_microbatches_with_the_legend_below_the_rows(monkeypatch, tmp_path):
    from ptdp.run import trace

    events = []
    for it, t0 in ((2, 0.0), (3, 1.0)):
        for rank in (0, 1):
            for mb in range(4):
                for kind, offset in (("forward", 0.0), ("backward", 0.5)):
                    ts = (t0 + offset + 0.1 * mb + 0.05 * rank) * 1e6
                    events.append(
                        {
                            "name": f"{kind}{mb}",
                            "cat": kind,
                            "ph": "X",
                            "pid": rank,
                            "tid": 0,
                            "ts": ts,
                            "dur": 0.04e6,
                            "args": {"iteration": it, "microbatch": mb, "chunk": 0},
                        }
                    )
    captured = _captured_figure(monkeypatch)
    trace._draw(events, tmp_path / "t.png", {0: "rank 0", 1: "rank 1"})
    ax = captured[0].axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert " iteration 2" in texts and " iteration 3" in texts
    assert sorted(t for t in texts if t.isdigit()) == sorted([str(mb) for mb in range(4)] * 8)
    assert ax.get_legend().get_bbox_to_anchor().y1 <= ax.get_window_extent().y0 + 1  # below the rows


def test_an_explicit_even_split_needs_no_split_flags():
    from ptdp.planner.splits import split_report_lines

    assert split_report_lines((20, 20, 20, 20)) == [] == split_report_lines(None)
    assert split_report_lines((19, 21, 20, 20)) == [
        "pipeline: layers per stage 19, 21, 20 x 2; ptdp train (and Megatron-LM) flags: "
        "--pipeline-layer-split 19,21,20,20"
    ]


def test_sharding_is_tried_when_another_split_can_fit_than_the_closest_unsharded_one():
    """The 1T GPT at tp 8, pp 16, dp 24 under zb-h2: unsharded, the even split comes closest to
    fitting and could not fit even fully sharded, but the split (1, 9 x 14, 1) fits under optim;
    the search must not pass over the sharded strategies on the even split's account."""
    model, cluster = PRESETS["gpt-1008b"], Cluster(A100, 3072)
    unsharded = Candidate.of(8, 16, 24, 1, 3072, 1, "full", True, sharding="no_shard", schedule="zb-h2")
    plan, rejection, hopeless = predict._predict_split(model, unsharded, cluster, DEFAULT_CONSTANTS, None, True)
    assert rejection is not None and plan.layout.layer_split is None
    assert predict._sharding_cannot_fit(plan, unsharded, cluster) and not hopeless
    sharded = unsharded.replace(sharding="optim")
    fitting, rejection, _ = predict._predict_split(model, sharded, cluster, DEFAULT_CONSTANTS, None, True)
    assert rejection is None and fitting.timed().layout.layer_split == (1,) + (9,) * 14 + (1,)
    found = search(model, cluster, 3072, fixed=Fixed(tensor_model_parallel_size=8, pipeline_model_parallel_size=16))
    assert any(p.layout.parallel.schedule == "zb-h2" and p.layout.sharding_strategy == "optim" for p in found.plans)


@pytest.mark.parametrize("tp, pp", [(8, 16), (8, 8), (4, 32), (8, 4)])
def test_skipping_sharded_strategies_loses_no_fitting_plan(tp, pp, monkeypatch):
    """The 1T GPT on 3,072 A100s at a fixed tp and pp: the search that skips the sharded strategies
    it shows cannot fit (every split out of reach, or rank 1's floor) finds the plans, with their
    times, of the search that predicts every strategy."""
    model, cluster = PRESETS["gpt-1008b"], Cluster(A100, 3072)
    fixed = Fixed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    skipped = []
    floor = predict._no_split_fits_sharded
    monkeypatch.setattr(predict, "_no_split_fits_sharded", lambda *a: skipped.append(floor(*a)) or skipped[-1])
    pruned = {(p.layout, p.time) for p in search(model, cluster, 3072, fixed=fixed).plans}
    assert any(skipped)
    monkeypatch.setattr(predict, "_no_split_fits_sharded", lambda *a: False)
    monkeypatch.setattr(predict, "_sharding_cannot_fit", lambda *a: False)
    every = {(p.layout, p.time) for p in search(model, cluster, 3072, fixed=fixed).plans}
    assert pruned == every and pruned
