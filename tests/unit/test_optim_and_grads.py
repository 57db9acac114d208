"""Learning-rate schedule, weight-decay groups, gradient buffer and norm counting (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from ptdp.config.model import ModelConfig
from ptdp.config.schema import TrainConfig
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.data_parallel.grads import clip_grad_norm, counts_in_norm
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.optim.factory import build_optimizer
from ptdp.engine.tensor_parallel.sharding import initialize_parameters
from ptdp.layout.lr_schedule import lr_at


def test_lr_warmup_cosine_and_floor():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4, train_iters=14)
    assert [lr_at(i, cfg) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)
    values = [lr_at(i, cfg) for i in range(4, 15)]
    assert all(a >= b for a, b in zip(values, values[1:])), "cosine decay is monotone"


def test_lr_warmup_is_a_fraction_of_the_decay_unless_given():
    # Megatron-LM's --lr-warmup-fraction: a share of the decay iterations, rounded down here
    assert TrainConfig().warmup_iters == 30  # 0.1 of the default 300 steps
    assert TrainConfig(train_iters=5).warmup_iters == 0  # a short run is never refused for its warmup
    assert TrainConfig(train_iters=100, lr_decay_iters=57, lr_warmup_fraction=0.2).warmup_iters == 11
    assert TrainConfig(train_iters=100, lr_warmup_iters=7, lr_warmup_fraction=0.5).warmup_iters == 7  # given: wins
    assert TrainConfig(train_iters=100, lr_warmup_iters=0).warmup_iters == 0
    cfg = TrainConfig(lr=1.0, min_lr=0.0, train_iters=40)  # warmup 4 from the fraction
    assert [lr_at(i, cfg) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_at(40, cfg) == 0.0


def tiny_model() -> GPTModel:
    cfg = ModelConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=300, params_dtype="float64"
    )
    model = GPTModel(cfg, ParallelGroups.single_process().tp, layer_ids=range(2), pre_process=True, post_process=True)
    initialize_parameters(model, seed=1, std=0.02, num_layers=2, tp_rank=0, tp_size=1)
    return model


def test_weight_decay_only_on_matrices():
    model = tiny_model()
    opt = build_optimizer(
        model,
        TrainConfig(weight_decay=0.1),
        GradBuffer([list(model.parameters())], dp=ParallelGroups.single_process().dp),
    )
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_grad_buffer_accumulates_in_place_and_detects_dropped_views():
    model = tiny_model()
    buf = GradBuffer([list(model.parameters())], dp=ParallelGroups.single_process().dp)
    tokens = torch.randint(0, 300, (2, 8))
    model(tokens, tokens).backward()
    first = buf.data.clone()
    assert first.abs().sum() > 0
    model(tokens, tokens).backward()
    torch.testing.assert_close(buf.data, 2 * first)
    buf.zero()
    assert torch.all(buf.data == 0)
    for p in model.parameters():
        p.grad = None
    with pytest.raises(RuntimeError, match="no longer views the gradient buffer"):
        buf.zero()


def test_norm_counts_every_parameter_once_and_clips():
    model = tiny_model()
    groups = ParallelGroups.single_process()
    buf = GradBuffer([list(model.parameters())], dp=ParallelGroups.single_process().dp)
    tokens = torch.randint(0, 300, (2, 8))
    model(tokens, tokens).backward()
    assert all(counts_in_norm(p, groups) for p in model.parameters())
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    norm = clip_grad_norm(model, buf, groups, max_norm=expected / 2)
    assert norm == pytest.approx(expected, rel=1e-12)
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert clipped == pytest.approx(expected / 2, rel=1e-5)


def test_bfloat16_trains_float32_main_params():
    """bf16 weights get float32 main parameters and float32 gradient accumulation: updates far
    below bf16's resolution (1 + 3e-4 rounds to 1 in bf16) still accumulate."""
    import dataclasses

    from helpers.layout_cases import rank_microbatches, tiny_config
    from ptdp.engine.stage import build_stage
    from ptdp.engine.step import train_step

    losses = {}
    for dtype in ("bfloat16", "float32"):
        cfg = tiny_config(1, 1, 1, dtype)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=3e-4, min_lr=3e-4))
        stage = build_stage(cfg, ParallelGroups.single_process())
        ln = stage.model.layers["0"].ln1.weight
        losses[dtype] = [train_step(stage, rank_microbatches(i, cfg, 0, 1), i).loss for i in range(3)]
        if dtype == "bfloat16":
            assert stage.grads.data.dtype == torch.float32
            main = dict((id(p), m) for p, m in stage.optimizer.pairs)
            ln_main = main[id(ln)]
            assert ln_main.dtype == torch.float32
            assert torch.all(ln_main != 1.0), "every LayerNorm weight moved in float32"
            assert torch.all(ln == 1.0), "the bf16 copy cannot show moves of 3 * 3e-4"
            for p, m in stage.optimizer.pairs:
                assert torch.equal(p, m.to(torch.bfloat16))
    torch.testing.assert_close(torch.tensor(losses["bfloat16"]), torch.tensor(losses["float32"]), rtol=2e-2, atol=0)


def test_fused_adamw_skips_on_the_device_and_otherwise_matches_plain_adamw():
    """step_unless: a true skip flag leaves parameters, moments and step count bitwise unchanged
    (fused AdamW's found_inf, no host read); a false one updates like torch's default AdamW."""
    from ptdp.engine.optim.adamw import adamw, step_unless

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64, generator=gen)) for _ in range(2)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = adamw([{"params": params, "weight_decay": 0.1}], lr=1e-2)
    plain = torch.optim.AdamW([{"params": reference, "weight_decay": 0.1}], lr=1e-2)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    for step in range(3):
        grads = [torch.randn(5, 3, dtype=torch.float64, generator=gen) for _ in params]
        for p, q, g in zip(params, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 1:
            before = [p.detach().clone() for p in params]
            state = {k: v.clone() for k, v in fused.state[params[0]].items()}
            step_unless(fused, torch.tensor(True))
            assert all(torch.equal(a, p) for a, p in zip(before, params))
            assert all(torch.equal(v, fused.state[params[0]][k]) for k, v in state.items()) and state["step"] == 1
            continue
        step_unless(fused, torch.tensor(False))
        plain.step()
    for p, q in zip(params, reference):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)


def test_clip_coefficient_on_the_device():
    from ptdp.engine.data_parallel.grads import clip_coefficient

    def coef(norm, max_norm):
        return clip_coefficient(torch.tensor(norm, dtype=torch.float64), max_norm).item()

    assert coef(1.0, 1.0) == 1.0 and coef(0.5, 1.0) == 1.0 and coef(3.0, 0.0) == 1.0
    assert coef(4.0, 1.0) == 1.0 / (4.0 + 1e-6)
    assert coef(float("nan"), 1.0) == 1.0 and coef(float("inf"), 1.0) == 0.0


def test_main_parameters_are_one_flat_float32_tensor_laid_out_like_the_gradient_buffer():
    from ptdp.engine.optim.adamw import MainParamsAdamW

    model = tiny_model().to(torch.bfloat16)
    buf = GradBuffer([list(model.parameters())], dp=ParallelGroups.single_process().dp, grad_dtype=torch.float32)
    opt = build_optimizer(model, TrainConfig(), buf)
    assert isinstance(opt, MainParamsAdamW) and opt.main_data.dtype == torch.float32
    assert opt.main_data.numel() == buf.data.numel()
    for p, main in opt.pairs:
        assert main.untyped_storage().data_ptr() == opt.main_data.untyped_storage().data_ptr()
        assert main.storage_offset() == buf.grad(p).storage_offset() and main.grad is buf.grad(p)
        assert torch.equal(main.to(torch.bfloat16), p)


@pytest.mark.parametrize("shard", [False, True], ids=["main_params", "distributed"])
def test_bf16_gradient_buffer_steps_exactly_like_float32_with_the_same_values(shard):
    """--grad-reduce-in-bf16: a bf16 ``main_grad`` buffer; the step converts it to float32. Given
    gradients that bf16 holds exactly, the update, the norm and the clipped gradients equal those
    of a float32 buffer holding the same values, bit for bit, and no float32 gradient outlives the step."""
    from ptdp.engine.data_parallel.grads import global_grad_norm

    single = ParallelGroups.single_process()
    values = None
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model().to(torch.bfloat16)
        buf = GradBuffer([list(model.parameters())], dp=single.dp, grad_dtype=dtype, main_grad=True, shard=shard)
        assert buf.uses_main_grad and buf.data.dtype == dtype
        if values is None:
            values = torch.randn(buf.data.numel(), generator=torch.Generator().manual_seed(3)).bfloat16()
        buf.data.copy_(values)
        buf.finish()
        opt = build_optimizer(model, TrainConfig(weight_decay=0.1, clip_grad=0.5), buf)
        norm = global_grad_norm(model, buf, single)
        clip_grad_norm(model, buf, single, 0.5)
        for _ in range(2):
            opt.step()
        mains = [m for _, m in opt.pairs]
        assert all(m.grad is None for m in mains) if dtype == torch.bfloat16 else True
        results[dtype] = (norm, [p.detach().clone() for p in model.parameters()], [m.detach().clone() for m in mains])
    (n32, p32, m32), (n16, p16, m16) = results[torch.float32], results[torch.bfloat16]
    torch.testing.assert_close(n16, n32, rtol=1e-6, atol=0)  # float32 norms of the same values, summed in float64
    assert len(m16) == len(m32) > 0
    for a, b in zip(m16, m32):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(p16, p32):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
