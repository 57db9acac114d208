"""The benchmarks' plain PyTorch GPT equals ptdp's model, and the GPU check's models built on the device."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from helpers.bench_scripts import import_scripts
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.engine.tensor_parallel.sharding import global_param


@pytest.fixture
def bench(monkeypatch):
    return import_scripts(monkeypatch, "gpu_models", "plain_gpt")


def test_plain_gpt_trains_like_ptdp_in_float64(bench):
    """Each model pads its own vocabulary (300: ptdp 384 rows, the plain GPT 320) and both train alike."""
    gpu_models, plain_gpt = bench
    shape = dict(gpu_models.QUICK, seq_length=16, vocab_size=300)
    cfg = gpu_models.speed_config(shape, "float64")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1e-2, min_lr=1e-2, clip_grad=0.5))
    stage = build_stage(cfg, ParallelGroups.single_process())
    plain = plain_gpt.plain_like(cfg).double()
    assert (stage.model.word_embeddings.weight.shape[0], plain.wte.weight.shape[0]) == (384, 320)
    plain_gpt.copy_weights(stage.model, plain, cfg.model.vocab_size)
    opt = plain_gpt.plain_optimizer(plain, cfg.train, torch.device("cpu"))
    for step in range(3):
        mbs = gpu_models.random_microbatches(cfg, seed=step)
        ours = train_step(stage, mbs, step).loss
        theirs = plain_gpt.plain_step(plain, opt, mbs, cfg.train.clip_grad)
        torch.testing.assert_close(torch.tensor(float(ours), dtype=torch.float64), theirs, rtol=1e-9, atol=0)
    params = dict(stage.model.named_parameters())
    torch.testing.assert_close(plain.blocks[1].fc2.weight, params["layers.1.mlp.fc2.weight"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(plain.wte.weight[:300], params["word_embeddings.weight"][:300], rtol=1e-9, atol=1e-12)
    assert not plain.wte.weight[300:].any()  # the padding rows: never a label, no gradient, no decay


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


def test_plain_like_refuses_llama_options(bench):
    gpu_models, plain_gpt = bench
    cfg = gpu_models.speed_config(gpu_models.QUICK, "float32")
    with pytest.raises(ValueError, match="LayerNorm"):
        plain_gpt.plain_like(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, swiglu=True)))


def test_with_compile_switches_on_ptdps_compile_flag(bench):
    gpu_models, plain_gpt = bench
    cfg = gpu_models.speed_config(gpu_models.QUICK, "float32")
    compiled = plain_gpt.with_compile(cfg)
    assert compiled is not None and compiled.model.compile is True and not cfg.model.compile
    assert dataclasses.replace(compiled, model=dataclasses.replace(compiled.model, compile=False)) == cfg


@pytest.mark.parametrize("shape", [{}, {"num_layers": 3, "hidden_size": 48, "vocab_size": 333}])
def test_flop_params_count_the_plain_models_parameters_but_the_positions_and_padding(bench, shape):
    gpu_models, plain_gpt = bench
    cfg = gpu_models.speed_config(dict(gpu_models.QUICK, **shape), "float32")
    plain = plain_gpt.plain_like(cfg)
    m = cfg.model
    counted = sum(p.numel() for n, p in plain.named_parameters() if n != "wpe.weight")
    padding = (plain.wte.weight.shape[0] - m.vocab_size) * m.hidden_size
    assert gpu_models.flop_params(cfg) == plain.flop_params() == counted - padding
    assert gpu_models.flops_per_token(cfg) == 6 * plain.flop_params() + 12 * m.num_layers * m.hidden_size * m.seq_length


def test_device_stage_draws_the_initial_values_where_the_stage_lives(bench):
    """``device_stage`` draws on the stage's device (here the CPU): other values than ptdp's own
    CPU draw, from the same distributions (std 0.02, scaled by 1 / sqrt(2 l) for the output
    projections), norms one, biases and padded vocabulary rows zero; the optimizer's main
    parameters start from them, and the stage trains from about ln V."""
    gpu_models, _ = bench
    cfg = gpu_models.speed_config(dict(gpu_models.QUICK, hidden_size=128, num_layers=4), "bfloat16")
    stage = gpu_models.device_stage(cfg, torch.device("cpu"))
    ptdp_own = dict(build_stage(cfg, ParallelGroups.single_process()).model.named_parameters())
    std, layers = cfg.model.init_method_std, cfg.model.num_layers
    for name, p in stage.model.named_parameters():
        spec = global_param(p)
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16 and p.shape == ptdp_own[name].shape
        if spec.init == "ones":
            assert bool((p == 1).all()), name
        elif spec.init == "zeros":
            assert not p.any(), name
        else:
            real = p[: spec.real_rows].float() if spec.real_rows is not None else p.float()
            expected = std / math.sqrt(2 * layers) if spec.init == "scaled_normal" else std
            assert abs(real.std().item() / expected - 1) < 0.05, name
            assert not torch.equal(p, ptdp_own[name]), name  # drawn here, not ptdp's CPU values
            if spec.real_rows is not None:
                assert not p[spec.real_rows :].any(), name
    assert stage.model.word_embeddings.weight.shape[0] == 512  # the quick vocabulary, 500, padded
    # the float32 main parameters were made from these values (the optimizer is built after them)
    for p, main in stage.optimizer.pairs:
        assert torch.equal(main.detach().to(p.dtype), p.detach())
    losses = [train_step(stage, gpu_models.random_microbatches(cfg, seed=i), i).loss for i in range(2)]
    assert abs(losses[0] - math.log(cfg.model.vocab_size)) < 0.1 and losses[1] < losses[0] + 0.1
