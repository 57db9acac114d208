"""The linear layer's three GEMMs (:mod:`ptdp.engine.tensor_parallel.linear`): forward, input
gradient and weight gradient against autograd of ``x @ w.T`` (float64, exact), each GEMM's own
dtype, deferred weight gradients equal to immediate ones, FP8 against a plain reference built from
:mod:`ptdp.engine.fp8`, and compiled equal to eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ptdp.config.fp8 import FP8Config
from ptdp.engine.fp8 import FP8Recipe, compute_amax, dequantize, quantize, scale_from_amax
from ptdp.engine.fp8_layout import GemmDim, token_dim, whole
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.tensor_parallel.linear import FP8Settings, GemmDtypes, LinearPlan, WgradQueue, linear

EXACT = dict(rtol=0, atol=0)
#: the same products summed by a differently laid out float64 GEMM
CLOSE = dict(rtol=1e-12, atol=1e-14)


def _operands(bias: bool = True, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 8, dtype=dtype, generator=g)
    w = torch.randn(6, 8, dtype=dtype, generator=g)
    b = torch.randn(6, dtype=dtype, generator=g) if bias else None
    dy = torch.randn(5, 3, 6, dtype=dtype, generator=g)
    return x, w, b, dy


def _run(plan: LinearPlan | None, x, w, b, dy, main_grad: bool = False):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    if main_grad:
        w.main_grad = torch.zeros_like(w)  # type: ignore[attr-defined]
    y = linear(x, w, b, plan) if plan is not None else F.linear(x, w, b)
    y.backward(dy)
    grad_w = w.main_grad if main_grad else w.grad  # type: ignore[attr-defined]
    return y.detach(), x.grad, grad_w, (b.grad if b is not None else None)


@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_three_gemms_equal_autograd_in_float64(bias, main_grad):
    x, w, b, dy = _operands(bias)
    want = _run(None, x, w, b, dy)
    # a plan that is not plain (a dtype given) runs the function's own three GEMMs
    got = _run(LinearPlan(dtypes=GemmDtypes(torch.float64, torch.float64, torch.float64)), x, w, b, dy, main_grad)
    for g, e in zip(got, want):
        if e is None:
            assert g is None
        else:
            torch.testing.assert_close(g, e, **EXACT)
    # by hand: y = x wᵀ + b, dx = dy w, dW = dyᵀ x over the flattened tokens
    torch.testing.assert_close(got[1], dy @ w, **EXACT)
    torch.testing.assert_close(got[2], dy.flatten(0, 1).t() @ x.flatten(0, 1), **EXACT)


def test_each_gemm_runs_in_its_own_dtype():
    """float32 forward, float64 dgrad, float32 wgrad on float64 tensors: each result is the
    GEMM in that dtype, cast back."""
    x, w, _, dy = _operands(bias=False)
    y, dx, dw, _ = _run(LinearPlan(dtypes=GemmDtypes(torch.float32, None, torch.float32)), x, w, None, dy)
    x2, dy2 = x.flatten(0, 1), dy.flatten(0, 1)
    torch.testing.assert_close(y.flatten(0, 1), (x2.float() @ w.float().t()).double(), **EXACT)
    torch.testing.assert_close(dx, dy @ w, **EXACT)
    torch.testing.assert_close(dw, (dy2.float().t() @ x2.float()).double(), **EXACT)
    assert not torch.equal(dw, dy2.t() @ x2)  # float32 rounding shows


@pytest.mark.parametrize("main_grad", [False, True])
def test_deferred_weight_gradient_equals_immediate(main_grad):
    x, w, b, dy = _operands()
    want = _run(LinearPlan(dtypes=GemmDtypes(torch.float64)), x, w, b, dy, main_grad)
    queue = WgradQueue()
    plan = LinearPlan(queue=queue)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    if main_grad:
        ws.main_grad = torch.zeros_like(ws)  # type: ignore[attr-defined]
    with queue.defer():
        linear(xs, ws, b, plan).backward(dy)
    grad_w = ws.main_grad if main_grad else ws.grad  # type: ignore[attr-defined]
    assert len(queue) == 1 and (grad_w is None or not grad_w.any())  # nothing yet: the closure waits
    torch.testing.assert_close(xs.grad, want[1], **EXACT)  # the input gradient came at once
    done: list[torch.Tensor] = []
    assert queue.run(done=done.append) == 1 and len(queue) == 0
    assert len(done) == 1 and done[0] is ws  # the parameter whose gradient the closure completed
    grad_w = ws.main_grad if main_grad else ws.grad  # type: ignore[attr-defined]
    torch.testing.assert_close(grad_w, want[2], **EXACT)
    # outside defer() the same plan runs wgrad at once
    xs.grad = None
    linear(xs, ws, b, plan).backward(dy)
    assert len(queue) == 0
    grad_w = ws.main_grad if main_grad else ws.grad  # type: ignore[attr-defined]
    torch.testing.assert_close(grad_w, 2 * want[2], **EXACT)


def _fp8_plan(recipe: FP8Recipe, x, w) -> LinearPlan:
    gemms = FP8Settings(recipe).gemms(whole(w.shape[0]), whole(w.shape[1]), "test")
    return LinearPlan(fp8=gemms)


def _q(t: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """Tensorwise quantise-dequantise in float64 (the plain reference)."""
    scale = scale_from_amax(compute_amax(t, "tensor"), dtype, margin)
    return dequantize(quantize(t, scale, dtype), scale.reciprocal(), torch.float64)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_tensorwise_gemms_equal_the_plain_reference(fmt):
    recipe = FP8Recipe(format=fmt, recipe="tensorwise", margin=1)
    x, w, b, dy = _operands()
    y, dx, dw, db = _run(_fp8_plan(recipe, x, w), x, w, b, dy, main_grad=True)
    x2, dy2 = x.flatten(0, 1), dy.flatten(0, 1)
    gdtype = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    xq, wq, gq = _q(x2, torch.float8_e4m3fn, 1), _q(w, torch.float8_e4m3fn, 1), _q(dy2, gdtype, 1)
    torch.testing.assert_close(y.flatten(0, 1), xq @ wq.t() + b, **CLOSE)
    torch.testing.assert_close(dx.flatten(0, 1), gq @ wq, **CLOSE)
    torch.testing.assert_close(dw, gq.t() @ xq, **CLOSE)
    torch.testing.assert_close(db, dy2.sum(0), **EXACT)
    assert not torch.equal(dw, dy2.t() @ x2)  # quantisation acted


def test_fp8_rowwise_quantises_each_gemm_along_its_inner_dim():
    recipe = FP8Recipe(format="e4m3", recipe="rowwise")
    x, w, _, dy = _operands(bias=False)
    _, dx, dw, _ = _run(_fp8_plan(recipe, x, w), x, w, None, dy)
    x2, dy2 = x.flatten(0, 1), dy.flatten(0, 1)

    def rq(t):  # per row over the inner (last) dim
        scale = scale_from_amax(compute_amax(t, "row"), torch.float8_e4m3fn)
        return dequantize(quantize(t, scale, torch.float8_e4m3fn), scale.reciprocal(), torch.float64)

    torch.testing.assert_close(dx.flatten(0, 1), rq(dy2) @ rq(w.t().contiguous()).t(), **CLOSE)
    torch.testing.assert_close(dw, rq(dy2.t().contiguous()) @ rq(x2.t().contiguous()).t(), **CLOSE)
    assert not torch.allclose(dw, _q(dy2, torch.float8_e4m3fn).t() @ _q(x2, torch.float8_e4m3fn), rtol=1e-9, atol=0)


def test_delayed_scaling_uses_the_history_and_records_only_with_grad():
    recipe = FP8Recipe(format="hybrid", recipe="delayed", amax_history_len=2)
    x, w, b, dy = _operands()
    plan = _fp8_plan(recipe, x, w)
    gemms = plan.fp8
    assert gemms is not None and gemms.delayed is not None
    with torch.no_grad():
        linear(x, w, b, plan)
    assert not gemms.delayed.pending.any()  # evaluation records nothing
    y, *_ = _run(plan, x, w, b, dy)
    # the first step quantises with scale 1 (empty history): e4m3 of x and w as they are
    one = torch.ones(())
    xq = dequantize(quantize(x.flatten(0, 1), one, torch.float8_e4m3fn), one, torch.float64)
    wq = dequantize(quantize(w, one, torch.float8_e4m3fn), one, torch.float64)
    torch.testing.assert_close(y.flatten(0, 1), xq @ wq.t() + b, **CLOSE)
    want = torch.tensor([x.abs().max(), w.abs().max(), dy.abs().max()], dtype=torch.float32)
    torch.testing.assert_close(gemms.delayed.pending, want, **EXACT)


def test_delayed_scaling_records_the_weight_after_an_evaluation_of_the_same_weight():
    """An evaluation before the step quantises the weight without recording and keeps the copy;
    the step's first forward still records the weight's amax, once (a lost amax would give the
    next step scale 1)."""
    recipe = FP8Recipe(format="hybrid", recipe="delayed", amax_history_len=2)
    x, w, b, dy = _operands()
    plan = _fp8_plan(recipe, x, w)
    gemms = plan.fp8
    assert gemms is not None and gemms.delayed is not None
    weight = torch.nn.Parameter(w.clone())
    with torch.no_grad():
        linear(x, weight, b, plan)
    assert not gemms.delayed.pending.any()
    for _ in range(2):  # two microbatches of the step: the kept copy, the amax recorded once
        linear(x.clone().requires_grad_(), weight, b, plan).backward(dy)
    want = torch.tensor([x.abs().max(), w.abs().max(), dy.abs().max()], dtype=torch.float32)
    torch.testing.assert_close(gemms.delayed.pending, want, **EXACT)
    gemms.end_step()
    with torch.no_grad():
        linear(x, weight, b, plan)
    gemms.delayed.step()  # pending reset to zeros
    linear(x.clone().requires_grad_(), weight, b, plan).backward(dy)
    assert gemms.delayed.pending[1] == w.abs().max().float()


def test_token_dim_holds_the_cp_rank_s_two_chunks():
    class Axis:  # a stand-in with the attributes token_dim reads
        def __init__(self, rank, size):
            self.rank, self.size = rank, size

    dim = token_dim(4, 3, Axis(1, 2))  # s = 8 over cp 2: rank 1 holds chunks 1 and 2 of 2 positions
    assert dim.length == 24 and dim.ranges == ((6, 12), (12, 18))
    assert dim.ids(torch.device("cpu")).tolist() == list(range(6, 18))
    assert token_dim(4, 3, None) == GemmDim(12)


def test_a_dim_cuts_a_tile_only_when_a_boundary_is_not_on_one():
    class Axis:
        size = 2

    assert GemmDim(256, ((0, 128),), (Axis(),)).cuts(128) is False  # type: ignore[arg-type]
    assert GemmDim(200, ((128, 200),), (Axis(),)).cuts(128) is False  # type: ignore[arg-type]  # to the end
    assert GemmDim(64, ((32, 64),), (Axis(),)).cuts(128) is True  # type: ignore[arg-type]  # tile [0, 64)
    assert GemmDim(64, ((0, 32),), (Axis(),)).cuts(128) is True  # type: ignore[arg-type]
    assert GemmDim(64, ((0, 32),)).cuts(128) is False  # no other rank holds the rest


@pytest.mark.slow
def test_compiled_fp8_model_trains_like_eager():
    """The tiny model with FP8 linears (tensorwise, emulated) under --compile: the linears run
    eagerly between compiled graphs; losses and parameters equal eager mode's within float32
    rounding."""
    from helpers.compile_cases import TOL
    from helpers.layout_cases import tiny_config, train_and_collect

    cfg = tiny_config(1, 1, 1, "float32")
    cfg = dataclasses.replace(cfg, fp8=FP8Config(fp8_format="hybrid", fp8_recipe="tensorwise"))
    groups = ParallelGroups.single_process()
    eager = train_and_collect(cfg, groups)
    torch._dynamo.reset()
    compiled = train_and_collect(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=True)), groups)
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), **TOL)
    for name, (tensor, _, _) in eager["params"].items():
        torch.testing.assert_close(compiled["params"][name][0], tensor, **TOL)
    plain = train_and_collect(dataclasses.replace(cfg, fp8=FP8Config()), groups)
    assert plain["losses"] != eager["losses"]  # FP8 acted
