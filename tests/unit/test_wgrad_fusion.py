"""Weight gradients of bfloat16 linear layers go straight into the float32 ``main_grad`` (no 16-bit
``.grad``, no hook), and the buffer still learns that each gradient is complete."""

from __future__ import annotations

import warnings

import pytest
import torch

import ptdp.engine.tensor_parallel.wgrad as wgrad
from helpers.torch_features import NEEDS_FUSED_WGRAD
from ptdp.engine.comm import AxisGroup
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ptdp.engine.tensor_parallel.linear import linear
from ptdp.engine.tensor_parallel.wgrad import weight_grad


def _bf16_layers():
    tp = AxisGroup.single("tp")
    torch.manual_seed(0)
    col = ColumnParallelLinear(16, 32, tp=tp, dtype=torch.bfloat16)
    row = RowParallelLinear(32, 16, tp=tp, dtype=torch.bfloat16)
    for p in [*col.parameters(), *row.parameters()]:
        with torch.no_grad():
            p.normal_(0, 0.1)
    return col, row


@NEEDS_FUSED_WGRAD
def test_linear_weight_gradients_land_in_main_grad_without_a_16_bit_grad():
    col, row = _bf16_layers()
    params = [*col.parameters(), *row.parameters()]
    seen_16_bit = []  # per accumulation: whether autograd made a 16-bit .grad (this hook runs before the buffer's)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: seen_16_bit.append((id(q), q.grad is not None)))
    GradBuffer([params], dp=AxisGroup.single("dp"), grad_dtype=torch.float32)

    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    for step in range(2):  # two microbatches accumulate
        row(torch.nn.functional.gelu(col(x + step))).float().pow(2).sum().backward()
    assert col.weight.grad is None and row.weight.grad is None
    weights = {id(col.weight), id(row.weight)}
    # autograd still runs each weight's accumulation step (and so the buffer's hook, which marks the
    # gradient complete for the bucketed reductions) once per microbatch, with nothing to accumulate
    assert sorted(i for i, _ in seen_16_bit if i in weights) == sorted([id(col.weight), id(row.weight)] * 2)
    assert all(not had for i, had in seen_16_bit if i in weights)  # no bfloat16 weight gradient, ever
    assert sum(had for i, had in seen_16_bit if i not in weights) == 4  # the biases, twice each
    for b in (col.bias, row.bias):  # biases: autograd's bfloat16 gradient, added by the buffer's hook
        assert b.grad is None and b.main_grad.abs().sum() > 0
    for p in (col.weight, row.weight):
        assert p.main_grad.dtype == torch.float32 and p.main_grad.abs().sum() > 0


def test_where_hooks_need_a_gradient_autograds_path_feeds_the_buffer(monkeypatch):
    """On a torch that runs no post-accumulate hook for a leaf without a gradient (2.7), the layers
    hand autograd their 16-bit gradients: the buffer's hook runs for every parameter once per
    microbatch and adds them, to the main gradients the fused path gives (bfloat16 rounding)."""
    grads = {}
    for fuses in (True, False):
        if not fuses:
            monkeypatch.setattr(wgrad, "hooks_run_without_grad", lambda: False)
        if fuses and not wgrad.hooks_run_without_grad():
            continue
        col, row = _bf16_layers()
        params = [*col.parameters(), *row.parameters()]
        seen = []
        for p in params:
            p.register_post_accumulate_grad_hook(lambda q: seen.append(id(q)))
        GradBuffer([params], dp=AxisGroup.single("dp"), grad_dtype=torch.float32)
        assert wgrad.fuse_here(col.weight) is fuses
        x = torch.randn(3, 5, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
        for step in range(2):
            row(torch.nn.functional.gelu(col(x + step))).float().pow(2).sum().backward()
        assert sorted(seen) == sorted([id(p) for p in params] * 2)
        assert all(p.grad is None for p in params)
        grads[fuses] = [p.main_grad.clone() for p in params]
    assert all(g.abs().sum() > 0 for g in grads[False])
    for fused, plain in zip(grads.get(True, []), grads[False]):
        torch.testing.assert_close(fused, plain, rtol=2e-2, atol=2e-2)


def test_fused_accumulation_equals_16_bit_grad_plus_add():
    """The CPU path: the 16-bit GEMM added into float32, exactly what the hook did."""
    torch.manual_seed(1)
    w = torch.randn(8, 6, dtype=torch.bfloat16, requires_grad=True)
    g, x = torch.randn(10, 8, dtype=torch.bfloat16), torch.randn(10, 6, dtype=torch.bfloat16)
    assert torch.equal(weight_grad(w, g, x), g.t().mm(x))  # no main_grad: returned
    w.main_grad = torch.full((8, 6), 0.5)
    assert weight_grad(w, g, x) is None
    torch.testing.assert_close(w.main_grad, 0.5 + g.t().mm(x).float(), rtol=0, atol=0)


@NEEDS_FUSED_WGRAD
def test_linear_matches_f_linear_forward_and_input_grad():
    torch.manual_seed(2)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    w.main_grad = torch.zeros(4, 3, dtype=torch.float64)
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    y = linear(x, w, b)
    x2 = x.detach().requires_grad_()
    w2, b2 = w.detach().requires_grad_(), b.detach().requires_grad_()
    y2 = torch.nn.functional.linear(x2, w2, b2)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    y.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, b2.grad, rtol=0, atol=0)
    assert w.grad is None
    torch.testing.assert_close(w.main_grad, w2.grad, rtol=1e-15, atol=1e-15)


def _bf16_gemm_inputs():
    torch.manual_seed(4)
    return torch.randn(10, 8, dtype=torch.bfloat16), torch.randn(10, 6, dtype=torch.bfloat16)


def test_a_failing_fused_gemm_is_warned_once_counted_and_not_retried(monkeypatch):
    """The CPU has no ``aten::addmm.dtype_out`` kernel (NotImplementedError; a torch without the
    overload, AttributeError): the failure is kept,
    warned about once, and every later call counted as a fallback without trying again."""
    monkeypatch.setattr(wgrad, "FUSED_GEMM", wgrad.FusedGemmRecord())
    g, x = _bf16_gemm_inputs()
    main = torch.zeros(8, 6)
    with pytest.warns(RuntimeWarning, match="fall back to a 16-bit GEMM") as caught:
        assert wgrad._fused_gemm(main, g, x) is False
    assert len(caught) == 1 and torch.equal(main, torch.zeros(8, 6))  # nothing written by the failed try
    tried = []
    monkeypatch.setattr(wgrad, "_addmm_float32", lambda *a: tried.append(a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        assert wgrad._fused_gemm(main, g, x) is False
    assert tried == []
    record = wgrad.FUSED_GEMM
    assert (record.fused, record.fallback) == (0, 2) and record.error.startswith(
        ("NotImplementedError: ", "AttributeError: ")
    )


def test_a_torch_without_the_dtype_out_overload_falls_back(monkeypatch):
    """torch 2.7 (the floor) has no ``addmm.dtype_out`` overload: looking it up raises AttributeError."""
    monkeypatch.setattr(wgrad, "FUSED_GEMM", wgrad.FusedGemmRecord())

    def missing(*args):
        raise AttributeError("'OpOverloadPacket' object has no attribute 'dtype_out'")

    monkeypatch.setattr(wgrad, "_addmm_float32", missing)
    g, x = _bf16_gemm_inputs()
    with pytest.warns(RuntimeWarning, match="AttributeError"):
        assert wgrad._fused_gemm(torch.zeros(8, 6), g, x) is False
    assert wgrad.FUSED_GEMM.fallback == 1


def test_fused_calls_are_counted_in_eager_mode_only(monkeypatch):
    """A working kernel (emulated here) counts each eager call; traced by ``torch.compile`` nothing
    is counted (a Python counter there would become a guard), and the result is the same."""
    monkeypatch.setattr(wgrad, "FUSED_GEMM", wgrad.FusedGemmRecord())
    monkeypatch.setattr(wgrad, "_addmm_float32", lambda main, g, x: main.add_(g.t().float() @ x.float()))
    g, x = _bf16_gemm_inputs()
    eager, compiled = torch.zeros(8, 6), torch.zeros(8, 6)
    assert wgrad._fused_gemm(eager, g, x) is True
    assert torch.compile(wgrad._fused_gemm, backend="eager")(compiled, g, x) is True
    assert torch.equal(eager, compiled) and eager.abs().sum() > 0
    assert wgrad.FUSED_GEMM == wgrad.FusedGemmRecord(fused=1, fallback=0, error=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_accumulates_in_float32_in_place():
    """On CUDA the weight gradient is one float32-accumulating GEMM into main_grad: closer to the
    float64 product than the bfloat16 GEMM's rounded output."""
    torch.manual_seed(3)
    w = torch.randn(64, 48, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    g = torch.randn(256, 64, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 48, dtype=torch.bfloat16, device="cuda")
    w.main_grad = torch.ones(64, 48, device="cuda")
    ptr = w.main_grad.data_ptr()
    fused_before = wgrad.FUSED_GEMM.fused
    assert weight_grad(w, g, x) is None and w.main_grad.data_ptr() == ptr
    assert wgrad.FUSED_GEMM.error is None and wgrad.FUSED_GEMM.fused == fused_before + 1  # not the fallback
    exact = 1 + g.double().t().mm(x.double())
    fused_err = (w.main_grad.double() - exact).abs().max()
    rounded_err = (1 + g.t().mm(x).double() - exact).abs().max()
    assert fused_err <= rounded_err


@NEEDS_FUSED_WGRAD
@pytest.mark.parametrize("untied", [True, False])
def test_output_layer_gradient_goes_straight_into_main_grad(monkeypatch, untied):
    """bfloat16 GPT at tp = 1: the chunked loss adds the output layer's gradient into its float32
    main_grad chunk by chunk (a tied embedding's lookup adds its part there too: test_embedding_wgrad), and
    the buffer holds what the 16-bit-gradient path gives, up to bfloat16 rounding of that path."""
    import ptdp.engine.tensor_parallel.linear_cross_entropy as lce
    from helpers.layout_cases import rank_microbatches, tiny_config
    from ptdp.engine.groups import ParallelGroups
    from ptdp.engine.stage import build_stage

    cfg = tiny_config(1, 1, 1, "bfloat16", untie_embeddings_and_output_weights=untied)
    grads = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(lce, "fuse_here", lambda w: False)
        stage = build_stage(cfg, ParallelGroups.single_process())
        out = stage.model.output_layer if untied else stage.model.word_embeddings
        seen = []
        out.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
        stage.grads.zero()
        tokens, labels = rank_microbatches(0, cfg, 0, 1)[0]
        stage.model(tokens, labels).float().backward()
        grads[fused] = stage.grads.grad(out.weight).clone()
        assert len(seen) == 1  # the accumulation step (and the buffer's hook before this one) ran once
        if fused and untied:
            assert seen == [False]  # nothing left for autograd to accumulate
    assert grads[True].abs().sum() > 0
    torch.testing.assert_close(grads[True], grads[False], rtol=2e-2, atol=2e-4)
