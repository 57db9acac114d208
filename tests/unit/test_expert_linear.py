"""The experts' linear layer (ptdp.engine.moe.expert_linear) against a plain float64 reference:
FP8 forward and input gradient per expert from operands quantised with per-token activation
scales and the recipe's per-expert weight scales, the weight gradient in the activations' dtype
(a tensor scale over an expert's rows is never used: it would depend on which micro-batches share
a rank); without FP8 autograd's gradients exactly; a deferred weight gradient equal to the one at
once."""

from __future__ import annotations

import pytest
import torch

from ptdp.engine.fp8 import FP8Recipe, compute_amax, dequantize, quantize, scale_from_amax
from ptdp.engine.fp8_layout import whole
from ptdp.engine.moe.expert_linear import ExpertFP8, ExpertLinearFunction, ExpertPlan
from ptdp.engine.tensor_parallel.linear import WgradQueue

RECIPES = {
    "tensorwise": FP8Recipe("hybrid", "tensorwise"),
    "delayed": FP8Recipe("hybrid", "delayed", amax_history_len=2),
    "rowwise": FP8Recipe("e4m3", "rowwise", margin=1),
    "blockwise": FP8Recipe("e4m3", "blockwise"),
}
ACTIVATION = {"tensorwise": "row", "delayed": "row", "rowwise": "row", "blockwise": "1x128"}
WEIGHT = {"tensorwise": "tensor", "delayed": "tensor", "rowwise": "row", "blockwise": "128x128"}


def _apply(x: torch.Tensor, weight: torch.Tensor, splits: list[int], plan: ExpertPlan) -> torch.Tensor:
    return ExpertLinearFunction.apply(x, weight, torch.tensor(splits), splits, plan)


def _fake(x: torch.Tensor, granularity: str, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """``x`` quantised with its own scales and dequantised (float64)."""
    scale = scale_from_amax(compute_amax(x, granularity), dtype, margin)
    return dequantize(quantize(x, scale, dtype), scale.reciprocal(), torch.float64)


@pytest.mark.parametrize("name", list(RECIPES))
def test_expert_gemms_equal_the_reference_per_expert(name):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    n, k, splits = 136, 160, [70, 0, 33, 5]  # K > 128: two tiles; an expert with no rows
    x = (torch.randn(sum(splits), k, dtype=torch.float64) * 3).requires_grad_()
    weight = torch.randn(len(splits), n, k, dtype=torch.float64).requires_grad_()
    fp8 = ExpertFP8(recipe, out_dim=whole(n), in_dim=whole(k), emulate=True, tag="t")
    y = _apply(x, weight, splits, ExpertPlan(fp8))
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    act, wgt, m = ACTIVATION[name], WEIGHT[name], recipe.margin
    want_y, want_dx, want_dw = [], [], []
    for e, (xe, dye) in enumerate(zip(x.detach().split(splits), dy.split(splits))):
        w = weight.detach()[e]
        want_y.append(_fake(xe, act, recipe.dtype("input"), m) @ _fake(w, wgt, recipe.dtype("weight"), m).t())
        wt = _fake(w, wgt, recipe.dtype("weight"), m).t() if wgt != "row" else _fake(w.t(), wgt, torch.float8_e4m3fn, m)
        want_dx.append(_fake(dye, act, recipe.dtype("grad_output"), m) @ wt.t())
        want_dw.append(dye.t() @ xe)
    torch.testing.assert_close(y.detach(), torch.cat(want_y), rtol=1e-13, atol=0)
    torch.testing.assert_close(x.grad, torch.cat(want_dx), rtol=1e-13, atol=1e-16)  # dy ~ 1e-3
    torch.testing.assert_close(weight.grad, torch.stack(want_dw), rtol=1e-13, atol=0)
    assert (
        y.detach() - torch.cat([a @ weight.detach()[e].t() for e, a in enumerate(x.detach().split(splits))])
    ).abs().max() > 1e-3


def test_activation_scales_do_not_depend_on_which_rows_share_a_gemm():
    """An expert's output for a token is the same whether its rows come alone or with another
    micro-batch's (ep over data-parallel ranks): the scales are per token."""
    torch.manual_seed(1)
    fp8 = ExpertFP8(RECIPES["tensorwise"], out_dim=whole(16), in_dim=whole(32), emulate=True, tag="t")
    a, b = torch.randn(7, 32, dtype=torch.float64), 100 * torch.randn(5, 32, dtype=torch.float64)
    w = torch.randn(1, 16, 32, dtype=torch.float64)
    alone = _apply(a, w, [7], ExpertPlan(fp8))
    together = _apply(torch.cat([a, b]), w, [12], ExpertPlan(fp8))
    torch.testing.assert_close(together[:7], alone, rtol=1e-13, atol=0)  # up to the GEMM's blocking


def test_weights_are_quantised_once_per_step_until_they_change():
    fp8 = ExpertFP8(RECIPES["rowwise"], out_dim=whole(16), in_dim=whole(32), emulate=True, tag="t")
    w = torch.randn(2, 16, 32)
    first = fp8.weights(w, False)
    assert fp8.weights(w, False) is first
    w.add_(1.0)  # an optimizer step changes the version
    assert fp8.weights(w, False) is not first
    again = fp8.weights(w, False)
    fp8.end_step()
    assert fp8.weights(w, False) is not again


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_without_fp8_the_gemms_are_autograds(dtype):
    """Forward, input and weight gradients of the explicit GEMMs equal autograd's of the per-expert
    products (the grouped GEMM where torch takes the dtype, float32, else the loop)."""
    torch.manual_seed(2)
    splits = [3, 0, 9, 4]
    x = torch.randn(sum(splits), 32, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 48, 32, dtype=dtype, requires_grad=True)
    y = _apply(x, w, splits, ExpertPlan(grouped=True))
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = torch.cat([piece @ w2[e].t() for e, piece in enumerate(x2.split(splits))])
    rx, rw = torch.autograd.grad(ref, (x2, w2), dy)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(gw, rw, **tol)


@pytest.mark.parametrize("recipe", [None, "rowwise"])
def test_a_deferred_weight_gradient_equals_the_one_at_once(recipe):
    """While the queue defers, backward leaves the weight's gradient to a closure; run later it adds
    exactly what autograd's gradient would have been into ``main_grad`` (or ``.grad``)."""
    torch.manual_seed(3)
    splits = [5, 2, 0]
    fp8 = ExpertFP8(RECIPES[recipe], out_dim=whole(8), in_dim=whole(16), emulate=True, tag="t") if recipe else None
    x = torch.randn(sum(splits), 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(sum(splits), 8, dtype=torch.float64)
    at_once = torch.autograd.grad(_apply(x, w, splits, ExpertPlan(fp8)), (x, w), dy)
    queue = WgradQueue()
    w.main_grad = torch.zeros_like(w)
    with queue.defer():
        y = _apply(x, w, splits, ExpertPlan(fp8, queue=queue))
        (gx,) = torch.autograd.grad(y, (x,), dy)
    assert len(queue) == 1 and w.grad is None and not w.main_grad.any()
    assert queue.run() == 1
    torch.testing.assert_close(gx, at_once[0], rtol=0, atol=0)
    torch.testing.assert_close(w.main_grad, at_once[1], rtol=0, atol=0)


def test_experts_defer_both_weight_gradients_to_the_chunks_queue():
    """Under a zero-bubble schedule (a queue that may defer) the experts run the explicit GEMMs:
    B leaves fc1's and fc2's weight gradients to the queue, W adds them, as at once."""
    from ptdp.engine.moe.experts import Experts

    def build(queue):
        torch.manual_seed(4)
        experts = Experts(
            num_experts=3,
            hidden=16,
            ffn=24,
            swiglu=True,
            bias=False,
            approximate="none",
            dtype=torch.float64,
            wgrad_queue=queue,
        )
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.2)
        return experts

    x = torch.randn(10, 16, dtype=torch.float64)
    counts = torch.tensor([4, 0, 6])
    plain = build(None)
    plain(x, counts).square().sum().backward()
    queue = WgradQueue()
    deferred = build(queue)
    with queue.defer():
        deferred(x, counts).square().sum().backward()
    assert len(queue) == 2  # fc2's, then fc1's
    assert all(p.grad is None for p in deferred.parameters())
    queue.run()
    for (name, got), want in zip(deferred.named_parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-13, atol=0, msg=name)
