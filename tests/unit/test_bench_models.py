"""The benchmarks' plain PyTorch GPT equals ptdp's model, and the GPU check's catalog lookup."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ptdp.engine.groups import ParallelGroups
from ptdp.engine.step import build_stage, train_step

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """The benchmarks folder on sys.path (its scripts import each other by plain name)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check
    import plain_gpt

    return gpu_check, plain_gpt


def test_plain_gpt_trains_like_ptdp_in_float64(bench):
    gpu_check, plain_gpt = bench
    shape = dict(gpu_check.QUICK, seq_length=16, vocab_size=300)
    cfg = gpu_check.speed_config(shape, "float64")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1e-2, min_lr=1e-2, clip_grad=0.5))
    stage = build_stage(cfg, ParallelGroups.single_process())
    plain = plain_gpt.plain_like(cfg).double()
    plain_gpt.copy_weights(stage.model, plain, cfg.model.vocab_size)
    opt = plain_gpt.plain_optimizer(plain, cfg.train, torch.device("cpu"))
    for step in range(3):
        mbs = gpu_check.random_microbatches(cfg, seed=step)
        ours = train_step(stage, mbs, step).loss
        theirs = plain_gpt.plain_step(plain, opt, mbs, cfg.train.clip_grad)
        torch.testing.assert_close(torch.tensor(float(ours), dtype=torch.float64), theirs, rtol=1e-9, atol=0)
    params = dict(stage.model.named_parameters())
    torch.testing.assert_close(plain.blocks[1].fc2.weight, params["layers.1.mlp.fc2.weight"], rtol=1e-9, atol=1e-12)
    assert (stage.model.word_embeddings.weight.shape[0], plain.wte.weight.shape[0]) == (384, 320)  # each its own
    assert not plain.wte.weight[300:].any()  # the padding rows: never a label, no gradient, no decay


def test_plain_like_refuses_llama_options(bench):
    gpu_check, plain_gpt = bench
    cfg = gpu_check.speed_config(gpu_check.QUICK, "float32")
    with pytest.raises(ValueError, match="LayerNorm"):
        plain_gpt.plain_like(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, swiglu=True)))


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
    gpu_check, _ = bench
    assert gpu_check.catalog_key(name) == key


def test_peak_flops_cpu_needs_an_override(bench):
    gpu_check, _ = bench
    assert gpu_check.peak_flops(torch.device("cpu"), "float32", None)[0] is None
    assert gpu_check.peak_flops(torch.device("cpu"), "float32", 2.0) == (2e12, "--peak-tflops")


def test_with_compile_switches_on_ptdps_compile_flag(bench):
    gpu_check, plain_gpt = bench
    cfg = gpu_check.speed_config(gpu_check.QUICK, "float32")
    compiled = plain_gpt.with_compile(cfg)
    assert compiled is not None and compiled.model.compile is True and not cfg.model.compile
    assert dataclasses.replace(compiled, model=dataclasses.replace(compiled.model, compile=False)) == cfg


@pytest.mark.parametrize("shape", [{}, {"num_layers": 3, "hidden_size": 48, "vocab_size": 333}])
def test_flop_params_count_the_plain_models_parameters_but_the_positions_and_padding(bench, shape):
    gpu_check, plain_gpt = bench
    cfg = gpu_check.speed_config(dict(gpu_check.QUICK, **shape), "float32")
    plain = plain_gpt.plain_like(cfg)
    counted = sum(p.numel() for n, p in plain.named_parameters() if n != "wpe.weight")
    padding = (plain.wte.weight.shape[0] - cfg.model.vocab_size) * cfg.model.hidden_size
    assert gpu_check.flop_params(cfg) == plain.flop_params() == counted - padding


def test_the_plain_gpt_pads_gpt2s_vocabulary_as_nanogpt(bench):
    _, plain_gpt = bench
    assert [plain_gpt.padded_vocab(v) for v in (50257, 50304, 500, 64, 1)] == [50304, 50304, 512, 64, 64]
    plain = plain_gpt.PlainGPT(vocab=70, seq=8, h=16, heads=2, ffn=64, layers=1)
    assert plain.wte.weight.shape == (128, 16)
    tokens = torch.randint(0, 70, (2, 8))
    with torch.no_grad():
        plain.wte.weight[70:] = 5.0  # padding rows with large logits would change a loss over all rows
        loss = plain(tokens, tokens)
        x = plain.wte(tokens) + plain.wpe.weight
        logits = torch.nn.functional.linear(plain.ln_f(plain.blocks[0](x)), plain.wte.weight[:70])
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()))


def test_a_failing_mode_is_reported_and_the_rest_still_written(bench, monkeypatch, tmp_path, capsys):
    gpu_check, _ = bench

    def broken(config, mode, shape, device):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(gpu_check, "measure_mode", broken)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cpu", "--quick", "--output", str(out)])
    assert exit_info.value.code == 1
    report = json.loads(out.read_text())
    assert report["failures"] == ["eager: RuntimeError: out of memory (simulated)"] and report["rows"] == []
    assert report["tokens_per_s"] is None and 0 < report["max_loss_rel_diff_vs_float64_cpu"] < 1e-5
    assert "FAILED eager: RuntimeError: out of memory (simulated)" in capsys.readouterr().out


def test_a_loss_beyond_rounding_fails_the_check(bench):
    gpu_check, _ = bench
    assert gpu_check.loss_failures({"max_rel_diff": 3e-3}, "bfloat16") == []
    assert (
        gpu_check.loss_failures({"max_rel_diff": 3e-3, "max_rel_diff_float64_device_vs_cpu": 1e-12}, "bfloat16") == []
    )
    (too_far,) = gpu_check.loss_failures({"max_rel_diff": 2e-5}, "float32")
    assert "float32 differs from float64 on the CPU by 2.00e-05" in too_far
    (device,) = gpu_check.loss_failures({"max_rel_diff": 1e-3, "max_rel_diff_float64_device_vs_cpu": 1e-7}, "bfloat16")
    assert "float64 on the device differs from the CPU by 1.00e-07" in device
    assert len(gpu_check.loss_failures({"max_rel_diff": float("nan")}, "bfloat16")) == 1
