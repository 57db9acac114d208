"""The experts' FP8 GEMMs (ptdp.engine.moe.expert_fp8) against a plain float64 reference: forward
and input gradient per expert from operands quantised with per-token activation scales and the
recipe's per-expert weight scales, weight gradient in the activations' dtype; a tensor scale over an
expert's rows is never used (it would depend on which micro-batches share a rank)."""

from __future__ import annotations

import pytest
import torch

from ptdp.engine.fp8 import FP8Recipe, compute_amax, dequantize, quantize, scale_from_amax
from ptdp.engine.fp8_layout import whole
from ptdp.engine.moe.expert_fp8 import ExpertFP8, ExpertLinearFP8

RECIPES = {
    "tensorwise": FP8Recipe("hybrid", "tensorwise"),
    "delayed": FP8Recipe("hybrid", "delayed", amax_history_len=2),
    "rowwise": FP8Recipe("e4m3", "rowwise", margin=1),
    "blockwise": FP8Recipe("e4m3", "blockwise"),
}
ACTIVATION = {"tensorwise": "row", "delayed": "row", "rowwise": "row", "blockwise": "1x128"}
WEIGHT = {"tensorwise": "tensor", "delayed": "tensor", "rowwise": "row", "blockwise": "128x128"}


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
    y = ExpertLinearFP8.apply(x, weight, splits, fp8)
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
    alone = ExpertLinearFP8.apply(a, w, [7], fp8)
    together = ExpertLinearFP8.apply(torch.cat([a, b]), w, [12], fp8)
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
