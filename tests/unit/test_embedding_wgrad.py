"""The word embedding's weight gradient goes straight into the float32 ``main_grad`` (rows added with
``index_add_``, no 16-bit ``[V_pad/t, h]`` gradient); float32/float64 models keep autograd's path.
tp = 2 runs in ``tests/dist/test_embedding_wgrad_dist.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.embedding_cases import embedding_gradients, lookup_reference, lookup_run, table_gradients_made
from helpers.layout_cases import tiny_config
from helpers.torch_features import NEEDS_FUSED_WGRAD
from ptdp.engine.comm import AxisGroup
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.tensor_parallel.wgrad import embedding


def _ids_and_mask():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 4, (5, 3), generator=g)
    outside = torch.rand(5, 3, generator=g) < 0.3
    return ids.masked_fill(outside, 0), outside, g


@NEEDS_FUSED_WGRAD
@pytest.mark.parametrize("masked", [False, True])
def test_float64_lookup_into_main_grad_equals_autograd(masked):
    """Forward bitwise equal to F.embedding (+ the mask); main_grad = start + autograd's gradient."""
    ids, outside, g = _ids_and_mask()
    outside = outside if masked else None
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w.main_grad = torch.randn(6, 4, generator=g, dtype=torch.float64)
    start = w.main_grad.clone()
    grad = torch.randn(5, 3, 4, generator=g, dtype=torch.float64)
    ref_w = w.detach().clone().requires_grad_()
    ref = F.embedding(ids, ref_w)
    if masked:
        ref = ref.masked_fill(outside.unsqueeze(-1), 0.0)
    out = embedding(ids, w, outside)
    assert torch.equal(out, ref)
    out.backward(grad)
    ref.backward(grad)
    assert w.grad is None
    torch.testing.assert_close(w.main_grad, start + ref_w.grad, rtol=1e-12, atol=1e-12)


def test_without_main_grad_the_lookup_is_autograds_exactly():
    """No main_grad at call time: F.embedding itself; lost between forward and backward: the function
    hands autograd the same dense gradient."""
    ids, outside, g = _ids_and_mask()
    w = torch.randn(6, 4, generator=g, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(5, 3, 4, generator=g, dtype=torch.bfloat16)
    ref_w = w.detach().clone().requires_grad_()
    F.embedding(ids, ref_w).masked_fill(outside.unsqueeze(-1), 0.0).backward(grad)
    out = embedding(ids, w, outside)
    assert out.grad_fn.name() == "MaskedFillBackward0"  # autograd's path: no main_grad
    out.backward(grad)
    assert torch.equal(w.grad, ref_w.grad)
    w.grad, w.main_grad = None, torch.zeros(6, 4)
    out = embedding(ids, w, outside)
    del w.main_grad
    out.backward(grad)
    assert torch.equal(w.grad, ref_w.grad)


@NEEDS_FUSED_WGRAD
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows_summed_in_float32_without_a_table_sized_16_bit_gradient(dtype):
    """tp = 1, two microbatches: main_grad is the float64 sum of the received 16-bit rows to float32
    rounding (autograd's 16-bit dense gradient is no closer), no op makes a 16-bit tensor of the
    table's shape (autograd's path does: the check can fail), .grad stays None, and the parameter's
    post-accumulate hook (the buffer's completion mark) still runs once per backward."""
    tp = AxisGroup.single("tp")
    fused, plain = lookup_run(tp, dtype, main_grad=True), lookup_run(tp, dtype, main_grad=False)
    exact = 2 * lookup_reference(dtype)
    torch.testing.assert_close(fused["grad"], exact, rtol=1e-6, atol=1e-6)
    assert (fused["grad"] - exact).abs().max() <= (plain["grad"] - exact).abs().max()
    assert torch.equal(fused["out"], plain["out"])
    assert fused["made"] == [] and fused["grad_is_none"]
    assert fused["arrived"] == [False, False] and fused["hooks"] == 2
    assert plain["made"] and plain["arrived"] == [True, True]  # autograd's path makes one per backward


def test_float32_and_float64_models_keep_autograds_gradient():
    """Without main_grad (float32/float64 parameters, whose buffer is .grad) nothing changes."""
    tp = AxisGroup.single("tp")
    res = lookup_run(tp, torch.float64, main_grad=False)
    torch.testing.assert_close(res["grad"], 2 * lookup_reference(), rtol=1e-12, atol=1e-12)
    assert res["arrived"] == [True, True]


@NEEDS_FUSED_WGRAD
@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("distinct", [None, 5])
def test_bf16_gpt_embedding_gradient_in_main_grad_matches_autograds_path(untied, distinct):
    """A bfloat16 GPT at tp = 1, two microbatches (tied: the lookup and the output layer share the
    weight, both add into main_grad): the buffer holds what autograd's 16-bit path gave, exactly
    when no token repeats within a microbatch, else to bfloat16 rounding of that path's per-row sums
    (``distinct=5``: each token ~3 times); untied, it is the float64 sum of the received rows to
    float32 rounding. No gradient ever reaches autograd's accumulation, whose hook still runs once
    per backward."""
    cfg = tiny_config(1, 1, 1, "bfloat16", untie_embeddings_and_output_weights=untied)
    groups = ParallelGroups.single_process()
    fused = embedding_gradients(cfg, groups, fused=True, distinct=distinct)
    plain = embedding_gradients(cfg, groups, fused=False, distinct=distinct)
    assert fused["word"].abs().sum() > 0
    tol = dict(rtol=0, atol=0) if distinct is None else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(fused["word"], plain["word"], **tol)
    if untied:
        torch.testing.assert_close(fused["output"], plain["output"], rtol=0, atol=0)
        torch.testing.assert_close(fused["word"].double(), fused["lookup"], rtol=1e-6, atol=1e-7)
        if distinct is not None:  # the float32 sums are no further from float64's than the 16-bit ones
            err = (fused["word"].double() - fused["lookup"]).abs().max()
            assert 0 < (plain["word"].double() - plain["lookup"]).abs().max() and err <= 1e-6
    assert fused["arrived"] == [False, False] and fused["hooks"] == 2 and fused["grad_is_none"]
    assert plain["arrived"] == [True, True] and plain["hooks"] == 2


@NEEDS_FUSED_WGRAD
def test_fusion_is_off_where_torch_compile_traces(monkeypatch):
    """Inside a compiled region the lookup stays autograd's (the graph cannot write main_grad)."""
    w = torch.randn(6, 4, requires_grad=True, dtype=torch.bfloat16)
    w.main_grad = torch.zeros(6, 4)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert embedding(torch.tensor([1, 2]), w).grad_fn.name() == "EmbeddingBackward0"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert embedding(torch.tensor([1, 2]), w).grad_fn.name() == "EmbeddingFunctionBackward"


def test_allocation_check_sees_autograds_dense_gradient():
    """The dispatch-mode check used above reports the dense 16-bit gradient autograd's path makes."""
    w = torch.randn(6, 4, dtype=torch.bfloat16, requires_grad=True)
    out = F.embedding(torch.tensor([[1, 1, 3]]), w)
    assert table_gradients_made(w, lambda: out.sum().backward()) != []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lookup_adds_float32_rows_in_place_deterministic_on_request():
    """On CUDA: the rows go into the same main_grad storage, summed in float32 (to float32 rounding of
    the float64 sum of the received bfloat16 rows), no table-shaped 16-bit tensor; with
    ``torch.use_deterministic_algorithms(True)`` two backward passes give bitwise equal sums."""
    g = torch.Generator().manual_seed(11)
    v, h, n = 64, 32, 4096
    ids = torch.randint(0, 4, (n,), generator=g).cuda()  # 4 distinct ids: ~1000 rows each
    grad = torch.randn(n, h, generator=g).to(torch.bfloat16).cuda()
    exact = torch.zeros(v, h, dtype=torch.float64).index_add_(0, ids.cpu(), grad.double().cpu())
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.zeros(v, h, device="cuda")
    ptr = w.main_grad.data_ptr()
    made = table_gradients_made(w, lambda: embedding(ids, w).backward(grad))
    assert made == [] and w.grad is None and w.main_grad.data_ptr() == ptr
    torch.testing.assert_close(w.main_grad.double().cpu(), exact, rtol=1e-5, atol=1e-4)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        sums = []
        for _ in range(2):
            w.main_grad.zero_()
            embedding(ids, w).backward(grad)
            sums.append(w.main_grad.clone())
    finally:
        torch.use_deterministic_algorithms(previous)
    assert torch.equal(sums[0], sums[1])
