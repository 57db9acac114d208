"""The staged GPU check's CPU dry run in-process (``--device cpu --quick``): each stage's report,
its budget, a stage stopped part way, the loss bounds, and ``gpu_run.sh``'s stages and limits."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from helpers.bench_scripts import BENCHMARKS, import_scripts

PEAK_TFLOPS = 0.5


@pytest.fixture
def bench(monkeypatch):
    names = (
        "gpu_check",
        "gpu_loss",
        "gpu_models",
        "gpu_probes",
        "gpu_report",
        "gpu_speed",
        "gpu_moe",
        "gpu_fp8",
        "gpu_zb",
    )
    return dict(zip(names, import_scripts(monkeypatch, *names)))


def run_stage(bench, tmp_path, stage: str, *extra: str) -> dict:
    """``gpu_check.py STAGE --device cpu --quick`` in this process; its report."""
    argv = [stage, "--device", "cpu", "--quick", "--peak-tflops", str(PEAK_TFLOPS), "--output-dir", str(tmp_path)]
    bench["gpu_check"].main([*argv, *extra])
    return json.loads((tmp_path / f"gpu_check_{stage}.json").read_text())


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_catalog_key_of_device_names(bench, name, key):
    assert bench["gpu_speed"].catalog_key(name) == key


def test_peak_flops_cpu_needs_an_override(bench):
    speed = bench["gpu_speed"]
    assert speed.peak_flops(torch.device("cpu"), "float32", None)[0] is None
    assert speed.peak_flops(torch.device("cpu"), "float32", 2.0) == (2e12, "--peak-tflops")


def test_eager_stage_reports_the_loss_check_and_the_speed_row(bench, tmp_path, capsys):
    r = run_stage(bench, tmp_path, "eager")
    assert (r["stage"], r["complete"], r["budget_exhausted"], r["failures"]) == ("eager", True, False, [])
    assert (r["device"], r["dtype"], r["budget_s"]) == ("cpu", "float32", bench["gpu_check"].BUDGET_S["eager"])
    assert 0 < r["elapsed_s"] < r["budget_s"]
    # float32 against float64 differs by rounding only, and not by nothing
    check = r["loss_check"]
    assert check["bound"] == 1e-5 and 0 < r["max_loss_rel_diff_vs_float64_cpu"] == check["max_rel_diff"] < 1e-5
    assert len(check["float64_cpu"]) == len(check["float32"]) == check["steps"] == 3
    assert abs(check["float64_cpu"][0] - math.log(check["model"]["vocab_size"])) < 0.1  # small init: ~ln V
    (row,) = r["rows"]
    assert row["mode"] == "eager" and row["timed_steps"] == row["requested_steps"] == 3
    assert row["stopped_by_budget"] is False
    assert row["vocab_rows"] == {"ptdp": 512, "plain": 512}  # V = 500, each model's own padding
    # the model FLOPs per token, 6 N + 12 l h s, from the quick shape (tied embedding once on the
    # real vocabulary, no position table): N = l (12 h^2 + 13 h) + 2 h + V h
    m = r["model"]
    l, h, s, v = m["num_layers"], m["hidden_size"], m["seq_length"], m["vocab_size"]
    n = l * (12 * h * h + 13 * h) + 2 * h + v * h
    assert row["flop_params"] == n and r["flops_per_token"] == 6 * n + 12 * l * h * s
    tokens = r["batch"]["tokens_per_step"]
    assert math.isclose(row["tokens_per_s"], tokens / row["ptdp_step_s"], rel_tol=1e-12)
    assert math.isclose(row["ratio_vs_plain"], row["ptdp_step_s"] / row["plain_step_s"], rel_tol=1e-12)
    assert math.isclose(row["mfu"], r["flops_per_token"] * row["tokens_per_s"] / (PEAK_TFLOPS * 1e12), rel_tol=1e-12)
    first = row["first_step_loss"]
    assert abs(first["ptdp"] - first["plain"]) <= 1e-5 * first["plain"]  # the same weights, data and vocabulary
    assert row["wgrad_fused_gemm"]["status"] == bench["gpu_report"].NOT_ON_CPU
    out = capsys.readouterr().out
    assert "stage eager" in out and "ratio" in out and "FAILED" not in out


def test_probes_stage_records_each_probe(bench, tmp_path):
    r = run_stage(bench, tmp_path, "probes")
    assert (r["stage"], r["complete"], r["failures"]) == ("probes", True, [])
    p, na = r["probes"], bench["gpu_report"].NOT_ON_CPU
    assert set(p) == {"wgrad", "sdpa", "gemm", "step"}
    assert p["wgrad"]["status"] == na
    assert p["step"]["host_syncs"] == {"status": na} and p["step"]["top_kernels"] == {"status": na}
    # every backend tried; the CPU has flash and math kernels, no cuDNN or efficient attention
    sdpa = p["sdpa"]
    assert set(sdpa["backends"]) == set(bench["gpu_probes"].BACKENDS)
    assert sdpa["backends"]["MATH"]["ok"] and sdpa["backends"]["FLASH_ATTENTION"]["ok"]
    assert sdpa["backends"]["FLASH_ATTENTION"]["max_abs_diff_vs_math"] < 1e-5
    assert sdpa["backends"]["FLASH_ATTENTION"]["fwd_bwd_s"] > 0
    assert not sdpa["backends"]["CUDNN_ATTENTION"]["ok"] and sdpa["backends"]["CUDNN_ATTENTION"]["error"]
    assert sdpa["shape"] == {"b": 2, "heads": 4, "s": 64, "d": 16, "dtype": "torch.float32"}
    # the default dispatch, seen by the profiler in the probe and in ptdp's own step
    assert sdpa["default"]["backend"] == p["step"]["attention"]["backend"] == "FLASH_ATTENTION"
    assert any("flash_attention" in op for op in sdpa["default"]["aten_ops"]) and sdpa["default"]["kernels"] == na
    gemms = p["gemm"]["gemms"]
    assert set(gemms) == {"qkv", "proj", "fc1", "fc2", "logits"}
    assert (gemms["qkv"]["rows"], gemms["qkv"]["out"], gemms["fc2"]["in"], gemms["logits"]["out"]) == (
        128,
        192,
        256,
        512,
    )
    for entry in gemms.values():
        for op in ("forward", "input_grad", "weight_grad"):
            assert entry[op]["tflops"] > 0 and math.isclose(entry[op]["of_peak"], entry[op]["tflops"] / PEAK_TFLOPS)
        assert "weight_grad_into_float32" not in entry  # CUDA only


def test_moe_stage_trains_the_moe_model_and_times_its_grouped_gemm(bench, tmp_path, capsys):
    r = run_stage(bench, tmp_path, "moe")
    assert (r["stage"], r["complete"], r["budget_exhausted"], r["failures"], r["notes"]) == ("moe", True, False, [], [])
    assert (r["dtype"], r["budget_s"]) == ("float32", bench["gpu_check"].BUDGET_S["moe"])
    moe = r["moe"]
    m = moe["model"]
    assert (m["num_experts"], m["topk"], m["expert_ffn"], m["dense_ffn"]) == (8, 2, 128, 256)  # k F = F_d
    rules = moe["grouped_gemm"]
    assert rules["usable"] and rules["status"] == "used" and rules["cutlass_kernel"] == bench["gpu_report"].NOT_ON_CPU
    own, *more = moe["gemm"]
    assert (own["num_experts"], own["hidden"], own["ffn"], own["tokens"]) == (8, 64, 128, 2 * 64)  # the model's
    assert len(more) == len(bench["gpu_moe"].QUICK_GEMM_SIZES)
    for row in moe["gemm"]:
        assert row["grouped_gemm_used"] and row["grouped_s"] > 0 and row["loop_s"] > 0
        assert row["max_rel_diff_grouped_vs_loop"] < 1e-5
    run = moe["training"]
    assert run["timed_steps"] == 3 and len(run["losses"]) == len(run["max_load"]) == 4
    assert run["finite"] and run["falling"] and run["losses"][-1] < run["losses"][0]
    assert all(load >= 1 for load in run["max_load"])
    assert math.isclose(run["tokens_per_s"], moe["batch"]["tokens_per_step"] / run["median_step_s"], rel_tol=1e-12)
    fp8 = moe["training_fp8_rowwise"]  # the same model and batch with FP8 GEMMs, experts included
    assert fp8["finite"] and fp8["falling"] and len(fp8["losses"]) == 4
    assert fp8["last_loss_diff_vs_bf16"] == fp8["losses"][-1] - run["losses"][-1] != 0
    assert fp8["tokens_per_s_ratio_vs_bf16"] == fp8["tokens_per_s"] / run["tokens_per_s"]
    out = capsys.readouterr().out
    assert "grouped GEMM: used" in out and "tokens/s" in out and "FP8 rowwise" in out and "FAILED" not in out


def test_moe_stage_falls_back_to_the_loop(bench, tmp_path, monkeypatch, capsys):
    """A grouped GEMM that raises fails the stage, and the model trains with the loop; one whose
    rules do not hold (float64) is a note."""

    def broken(*args, **kwargs):
        raise RuntimeError("strides should be multiple of 16 bytes (simulated)")

    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_stage(bench, tmp_path, "moe")
    assert exit_info.value.code == 1
    r = json.loads((tmp_path / "gpu_check_moe.json").read_text())
    assert r["complete"] and r["failures"] == [
        "moe: the grouped GEMM fell back: RuntimeError: strides should be multiple of 16 bytes (simulated); "
        "the experts ran as the loop"
    ]
    assert r["moe"]["gemm"] == [] and r["moe"]["training"]["falling"]
    r = run_stage(bench, tmp_path, "moe", "--dtype", "float64")
    assert r["failures"] == [] and not r["moe"]["grouped_gemm"]["dtype_taken"] and r["moe"]["gemm"] == []
    assert r["notes"] == ["moe: the grouped GEMM not used: a rule above does not hold; the experts run as the loop"]
    assert r["moe"]["training"]["falling"]


def test_fp8_stage_trains_bf16_then_fp8_tensorwise_rowwise_and_blockwise(bench, tmp_path, capsys):
    """The same steps on the same batch: the FP8 runs' first loss differs from bfloat16's by FP8's
    rounding of the forward only, every loss falls; each run one JSON line when it ends."""
    r = run_stage(bench, tmp_path, "fp8")
    assert (r["stage"], r["complete"], r["budget_exhausted"], r["failures"], r["notes"]) == ("fp8", True, False, [], [])
    assert (r["dtype"], r["budget_s"]) == ("bfloat16", bench["gpu_check"].BUDGET_S["fp8"])
    fp8 = r["fp8"]
    assert (fp8["baseline"], fp8["format"]) == ("bfloat16", "hybrid")
    runs = fp8["runs"]
    assert [(x["name"], x["recipe"]) for x in runs] == [
        ("bfloat16", None),
        ("fp8 tensorwise", "tensorwise"),
        ("fp8 rowwise", "rowwise"),
        ("fp8 blockwise", "blockwise"),
    ]
    base = runs[0]
    for run in runs:
        assert run["timed_steps"] == 3 and len(run["losses"]) == 4 and run["finite"] and run["falling"]
        assert math.isclose(run["tokens_per_s"], r["batch"]["tokens_per_step"] / run["median_step_s"], rel_tol=1e-12)
        assert math.isclose(run["mfu"], r["flops_per_token"] * run["tokens_per_s"] / (PEAK_TFLOPS * 1e12))
        assert run["build_s"] > 0 and run["first_step_s"] > 0
    assert "loss_diff" not in base and "gemm_path" not in base
    for run in runs[1:]:
        assert run["gemm_path"] == {"status": bench["gpu_report"].NOT_ON_CPU}
        assert run["compared_steps"] == 4
        diff = [a - b for a, b in zip(run["losses"], base["losses"])]
        assert run["loss_diff"] == diff and run["last_loss_diff"] == diff[-1] != 0
        assert run["last_loss_rel_diff"] == diff[-1] / base["losses"][-1]
        assert 0 < abs(diff[0]) / base["losses"][0] <= run["max_loss_rel_diff"] < 0.05
        assert run["tokens_per_s_vs_baseline"] == run["tokens_per_s"] / base["tokens_per_s"]
    assert runs[1]["losses"] != runs[2]["losses"]  # tensorwise and rowwise scales differ
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith('{"stage": "fp8"')]
    assert [line["name"] for line in lines] == [run["name"] for run in runs]
    assert lines[2]["losses"] == runs[2]["losses"] and "fp8 rowwise" in out and "FAILED" not in out


def test_a_killed_fp8_stage_leaves_the_runs_that_ended(bench, tmp_path, monkeypatch, capsys):
    """Killed in the rowwise run's second step: the report and the JSON lines keep the two runs before it."""
    kill_at_step(monkeypatch, bench["gpu_models"], 2 * 4 + 2)  # the fp8 stage's runs train there
    with pytest.raises(Killed):
        run_stage(bench, tmp_path, "fp8")
    r = json.loads((tmp_path / "gpu_check_fp8.json").read_text())
    runs = r["fp8"]["runs"]
    assert r["complete"] is False and [len(run["losses"]) for run in runs] == [4, 4, 1]
    assert "last_loss_diff" in runs[1] and "mfu" not in runs[2]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["name"] for line in lines] == ["bfloat16", "fp8 tensorwise"]


def test_an_fp8_stage_out_of_budget_or_failing_a_run(bench, tmp_path, monkeypatch):
    """A budget spent at once: the baseline's first step, no FP8 run. A run that raises fails the
    stage and the next one runs."""
    r = run_stage(bench, tmp_path, "fp8", "--budget", "1e-6")
    (run,) = r["fp8"]["runs"]
    assert r["budget_exhausted"] and r["failures"] == [] and len(run["losses"]) == 1 and run["falling"] is None
    assert r["notes"][-3:] == [
        "fp8: fp8 tensorwise not run: stopped, the stage's budget of 1e-06 s was spent",
        "fp8: fp8 rowwise not run: stopped, the stage's budget of 1e-06 s was spent",
        "fp8: fp8 blockwise not run: stopped, the stage's budget of 1e-06 s was spent",
    ]
    fp8 = bench["gpu_fp8"]
    real = fp8.fp8_config

    def config(shape, dtype, recipe):
        if recipe == "tensorwise":
            raise RuntimeError("no kernel (simulated)")
        return real(shape, dtype, recipe)

    monkeypatch.setattr(fp8, "fp8_config", config)
    with pytest.raises(SystemExit):
        run_stage(bench, tmp_path, "fp8")
    r = json.loads((tmp_path / "gpu_check_fp8.json").read_text())
    assert r["failures"] == ["fp8: fp8 tensorwise: RuntimeError: no kernel (simulated)"]
    assert [len(run.get("losses", [])) for run in r["fp8"]["runs"]] == [4, 0, 4, 4]
    assert r["fp8"]["runs"][2]["compared_steps"] == 4


def test_zb_stage_trains_1f1b_zb_h1_and_zb_v_to_the_same_losses(bench, tmp_path, capsys):
    """The same weights and batch under 1f1b, zb-h1 and zb-v at pp = 1: the same first loss, every
    later one within float32 rounding of 1f1b's; each program's actions, zb-v's two chunks sharing
    the tied embedding, the step times against 1f1b's; each run one JSON line when it ends."""
    r = run_stage(bench, tmp_path, "zb")
    assert (r["stage"], r["complete"], r["budget_exhausted"], r["failures"], r["notes"]) == ("zb", True, False, [], [])
    assert (r["dtype"], r["budget_s"], r["batch"]["num_microbatches"]) == (
        "float32",
        bench["gpu_check"].BUDGET_S["zb"],
        4,
    )
    zb = r["zb"]
    assert (zb["baseline"], zb["loss_bound"]) == ("1f1b", 1e-5)
    runs = zb["runs"]
    assert [(x["name"], x["virtual_stages"]) for x in runs] == [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)]
    assert [x["program"] for x in runs] == [
        {"forward": 4, "backward": 4},
        {"forward": 4, "backward_input": 4, "backward_weight": 4},
        {"forward": 8, "handover_forward": 4, "backward_input": 8, "backward_weight": 8, "handover_backward": 4},
    ]
    assert runs[2]["tied_embedding_shared"] is True and "tied_embedding_shared" not in runs[0]
    base = runs[0]
    for run in runs:
        assert run["timed_steps"] == 3 and len(run["losses"]) == 4 and run["finite"] and run["falling"]
        assert math.isclose(run["tokens_per_s"], r["batch"]["tokens_per_step"] / run["median_step_s"], rel_tol=1e-12)
        assert run["build_s"] > 0 and run["first_step_s"] > 0
    assert "loss_diff" not in base and "step_s_vs_1f1b" not in base
    for run in runs[1:]:
        assert run["losses"][0] == base["losses"][0]  # the same initial weights
        rel = [abs(a - b) / b for a, b in zip(run["losses"], base["losses"])]
        assert run["compared_steps"] == 4 and run["max_loss_rel_diff"] == max(rel) <= 1e-5
        assert run["step_s_vs_1f1b"] == run["median_step_s"] / base["median_step_s"]
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith('{"stage": "zb"')]
    assert [line["name"] for line in lines] == ["1f1b", "zb-h1", "zb-v"] and lines[2]["losses"] == runs[2]["losses"]
    assert re.search(r"^zb-v +3 .* 1e-05$", out, re.M) and "FAILED" not in out


def test_a_zb_stage_out_of_budget_or_with_losses_apart(bench, tmp_path, monkeypatch):
    """A budget spent at once: 1f1b's first step, no zero-bubble run. A zero-bubble run whose losses
    leave 1f1b's (here zb-v at another learning rate) fails the stage."""
    r = run_stage(bench, tmp_path, "zb", "--budget", "1e-6")
    (run,) = r["zb"]["runs"]
    assert r["budget_exhausted"] and r["failures"] == [] and len(run["losses"]) == 1 and run["falling"] is None
    assert r["notes"][-2:] == [
        "zb: zb-h1 not run: stopped, the stage's budget of 1e-06 s was spent",
        "zb: zb-v not run: stopped, the stage's budget of 1e-06 s was spent",
    ]
    zb = bench["gpu_zb"]
    real = zb.zb_config

    def config(shape, dtype, schedule):
        c = real(shape, dtype, schedule)
        if schedule != "zb-v":
            return c
        return dataclasses.replace(c, train=dataclasses.replace(c.train, lr=2 * zb.LR, min_lr=2 * zb.LR))

    monkeypatch.setattr(zb, "zb_config", config)
    with pytest.raises(SystemExit):
        run_stage(bench, tmp_path, "zb")
    r = json.loads((tmp_path / "gpu_check_zb.json").read_text())
    (failure,) = r["failures"]
    assert failure.startswith("zb: zb-v: losses differ from 1f1b's by ") and failure.endswith("(1e-05)")
    assert r["zb"]["runs"][2]["max_loss_rel_diff"] > 1e-5 >= r["zb"]["runs"][1]["max_loss_rel_diff"]


@pytest.mark.parametrize(
    "ops, backend",
    [
        (
            ["aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward"],
            "FLASH_ATTENTION",
        ),
        (
            ["aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward"],
            "CUDNN_ATTENTION",
        ),
        (["aten::_scaled_dot_product_efficient_attention"], "EFFICIENT_ATTENTION"),
        (["aten::_scaled_dot_product_attention_math"], "MATH"),
        (["aten::_scaled_dot_product_flash_attention_for_cpu"], "FLASH_ATTENTION"),
        (["aten::mm"], None),
    ],
)
def test_the_attention_backend_from_the_profiled_operators(bench, ops, backend):
    assert bench["gpu_probes"].attention_backend(ops) == backend


def test_a_stage_out_of_budget_still_writes_what_it_has(bench, tmp_path, capsys):
    """A budget spent at once: the eager stage still runs its loss check, builds the models and runs
    their first (checking) step and the warm-up round, times nothing and says so; the probes stage
    runs its first probe only."""
    r = run_stage(bench, tmp_path, "eager", "--budget", "1e-6")
    assert r["complete"] and r["budget_exhausted"] and r["failures"] == []
    assert r["loss_check"]["max_rel_diff"] < 1e-5
    (row,) = r["rows"]
    assert row["stopped_by_budget"] and row["timed_steps"] == 0 and row["ptdp_step_s"] is None
    assert row["first_step_loss"]["ptdp"] > 0 and row["mfu"] is None
    assert any("timing after 0 of 3 steps" in note for note in r["notes"])
    p = run_stage(bench, tmp_path, "probes", "--budget", "1e-6")
    assert p["budget_exhausted"] and p["probes"]["wgrad"]["status"] == bench["gpu_report"].NOT_ON_CPU
    assert {p["probes"][k]["status"] for k in ("sdpa", "gemm", "step")} == {"not run: the stage's budget was spent"}
    assert "n/a" in capsys.readouterr().out
    moe = run_stage(bench, tmp_path, "moe", "--budget", "1e-6")  # the trial and the first step only
    assert moe["budget_exhausted"] and moe["failures"] == [] and len(moe["moe"]["gemm"]) == 1
    run = moe["moe"]["training"]
    assert len(run["losses"]) == 1 and run["stopped_by_budget"] and run["falling"] is None  # not judged


class Killed(BaseException):
    """A stage killed from outside (its command's time limit), as far as this process sees it."""


def kill_at_step(monkeypatch, module, n: int) -> None:
    """``module.train_step`` raising :class:`Killed` at its ``n``-th call."""
    calls = []
    real_step = module.train_step

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise Killed
        return real_step(*args, **kwargs)

    monkeypatch.setattr(module, "train_step", step)


def test_a_killed_stage_leaves_its_results_so_far_marked_incomplete(bench, tmp_path, monkeypatch):
    """The report is rewritten after each result: killed in its second timed round, the eager stage
    leaves the loss check, the first-step losses and the first timed round, ``complete`` false."""
    kill_at_step(monkeypatch, bench["gpu_speed"], 4)  # first step, warm-up, first timed, (killed) second timed
    with pytest.raises(Killed):
        run_stage(bench, tmp_path, "eager")
    r = json.loads((tmp_path / "gpu_check_eager.json").read_text())
    assert r["complete"] is False and r["loss_check"]["max_rel_diff"] < 1e-5
    (row,) = r["rows"]
    assert row["timed_steps"] == 1 and row["ptdp_step_s"] > 0 and "wgrad_fused_gemm" not in row
    assert not list(tmp_path.glob("*.tmp"))  # every write replaced the report whole


def test_a_failing_row_is_reported_and_the_loss_check_still_written(bench, tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(bench["gpu_check"], "measure_mode", broken)
    with pytest.raises(SystemExit) as exit_info:
        run_stage(bench, tmp_path, "eager")
    assert exit_info.value.code == 1
    r = json.loads((tmp_path / "gpu_check_eager.json").read_text())
    assert r["complete"] and r["failures"] == ["eager: RuntimeError: out of memory (simulated)"] and r["rows"] == []
    assert 0 < r["max_loss_rel_diff_vs_float64_cpu"] < 1e-5
    assert "FAILED eager: RuntimeError: out of memory (simulated)" in capsys.readouterr().out


def test_a_loss_beyond_rounding_fails_the_check(bench):
    loss = bench["gpu_loss"]
    assert loss.loss_failures({"max_rel_diff": 3e-3}, "bfloat16") == []
    assert loss.loss_failures({"max_rel_diff": 3e-3, "max_rel_diff_float64_device_vs_cpu": 1e-12}, "bfloat16") == []
    (too_far,) = loss.loss_failures({"max_rel_diff": 2e-5}, "float32")
    assert "float32 differs from float64 on the CPU by 2.00e-05" in too_far
    assert loss.loss_failures({"max_rel_diff": 2e-5, "bound": loss.LOSS_BOUND["tfloat32"]}, "float32") == []
    (device,) = loss.loss_failures({"max_rel_diff": 1e-3, "max_rel_diff_float64_device_vs_cpu": 1e-7}, "bfloat16")
    assert "float64 on the device differs from the CPU by 1.00e-07" in device
    assert len(loss.loss_failures({"max_rel_diff": float("nan")}, "bfloat16")) == 1


def test_float32_on_cuda_gets_the_tf32_bound(bench, monkeypatch):
    """ptdp lets float32 GEMMs use TF32 on CUDA: its inputs keep float16's 10 mantissa bits, so float16's bound."""
    loss = bench["gpu_loss"]
    assert loss.LOSS_BOUND["tfloat32"] == loss.LOSS_BOUND["float16"]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert loss.loss_bound("float32", cuda) == loss.LOSS_BOUND["tfloat32"]
    assert loss.loss_bound("float32", cpu) == loss.loss_bound("float64", cuda) * 1e4 == 1e-5
    assert loss.loss_bound("bfloat16", cuda) == 1e-2
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert loss.loss_bound("float32", cuda) == 1e-5


def test_stage_reports_are_replaced_whole(bench, tmp_path):
    report = bench["gpu_report"]
    path = tmp_path / "r.json"
    report.write_json(path, {"a": 1})
    report.write_json(path, {"a": [2, 3]})
    assert json.loads(path.read_text()) == {"a": [2, 3]} and [f.name for f in tmp_path.iterdir()] == ["r.json"]


def _gpu_run_sh() -> tuple[dict[str, int], int, dict[str, list[str]]]:
    """``gpu_run.sh``'s budgets, grace seconds and stage groups, read from the script."""
    text = (BENCHMARKS / "gpu_run.sh").read_text()
    budgets = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A BUDGET=\((.*)\)", text)[1])}
    grace = int(re.search(r"^GRACE_S=(\d+)$", text, re.M)[1])
    groups = {name: stages.split() for name, stages in re.findall(r'^\s*(\w+)\) stages="([\w ]+)" ;;$', text, re.M)}
    assert re.search(r"^\s*eager \| compile \| probes \| moe \| fp8 \| zb\) stages=\$group ;;$", text, re.M)
    return budgets, grace, groups


def test_gpu_run_sh_runs_gpu_checks_stages_in_three_commands_of_at_most_9_minutes(bench):
    gpu_check = bench["gpu_check"]
    budgets, grace, groups = _gpu_run_sh()
    assert set(budgets) == set(gpu_check.STAGES) and budgets == gpu_check.BUDGET_S
    assert sorted(groups) == ["first", "second", "third"]
    assert sorted(s for stages in groups.values() for s in stages) == sorted(gpu_check.STAGES)  # each once
    kill_after = 10  # timeout -k
    for stages in groups.values():
        assert sum(budgets[s] + grace + kill_after for s in stages) <= 9 * 60
