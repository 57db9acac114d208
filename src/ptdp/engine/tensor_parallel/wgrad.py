"""Weight gradients of the linear layers and of the embedding lookup accumulated straight into
float32 main gradients.

For 16-bit parameters with a float32 ``param.main_grad``
(:class:`ptdp.engine.data_parallel.buffer.GradBuffer`), the backward adds ``grad_outputᵀ · input``
into ``main_grad`` itself (Megatron-LM's "gradient accumulation fusion", Narayanan et al. SC21 §4):
on CUDA one ``aten::addmm.dtype_out`` accumulating in float32, elsewhere (or where that kernel
fails, warned once and counted in :data:`FUSED_GEMM`) a 16-bit GEMM added into the buffer. No
weight gradient goes to autograd; the buffer's post-accumulate hook still marks it complete. The
embedding lookup does the same with ``index_add_`` (:class:`EmbeddingFunction`). Weights without
``main_grad``, torches that skip the hook without a gradient (:func:`hooks_run_without_grad`:
torch 2.7) and ``torch.compile`` regions (:func:`fuse_here`) keep autograd's path.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.nn.functional as F


def fuse_here(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s gradient goes straight into its float32 ``main_grad`` in this call: it
    has one, this is not traced by ``torch.compile``, and this torch runs a leaf's post-accumulate
    hook when no gradient reaches it (:func:`hooks_run_without_grad`)."""
    return hasattr(weight, "main_grad") and not torch.compiler.is_compiling() and hooks_run_without_grad()


@functools.cache
def hooks_run_without_grad() -> bool:
    """Whether autograd runs a leaf's post-accumulate-grad hooks when every function using it
    returned None for its gradient (torch 2.8 and later do; torch 2.7 skips the accumulation step, so a
    fused layer's gradient would never be marked complete and its bucket never reduced in
    backward). Found once per process by a three-element backward on the CPU."""
    leaf = torch.zeros(3, requires_grad=True)
    calls: list[int] = []
    leaf.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    with torch.inference_mode(False), torch.enable_grad():
        _NoGrad.apply(torch.ones(3, requires_grad=True), leaf).sum().backward()
    return calls == [1]


class _NoGrad(torch.autograd.Function):
    """``x + w`` whose backward returns no gradient for ``w`` (:func:`hooks_run_without_grad`)."""

    @staticmethod
    def forward(ctx, x, w):
        return x + w

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def weight_grad(weight: torch.Tensor, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> torch.Tensor | None:
    """``grad_rowsᵀ · input_rows`` (``[out, n] · [n, in]``), the gradient of ``weight [out, in]``:
    returned, or, when ``weight`` has a ``main_grad``, added into it in float32 and None returned
    (autograd then accumulates nothing, and the buffer's hook, which still runs, only marks the
    gradient complete)."""
    main = getattr(weight, "main_grad", None)
    if main is None:
        return grad_rows.t().mm(input_rows)
    add_weight_grad(main, grad_rows, input_rows)
    return None


def add_weight_grad(main: torch.Tensor, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> None:
    """``main += grad_rowsᵀ · input_rows`` (float32 accumulation in the GEMM on CUDA)."""
    if not (
        main.is_cuda
        and main.dtype == torch.float32
        and grad_rows.dtype != torch.float32
        and _fused_gemm(main, grad_rows, input_rows)
    ):
        main.add_(grad_rows.t().mm(input_rows))


@dataclasses.dataclass
class FusedGemmRecord:
    """What the float32-accumulating weight-gradient GEMM did in this process (eager calls only;
    plain Python counters, no host synchronisation): ``fused`` calls ran ``aten::addmm.dtype_out``,
    ``fallback`` calls wanted it (CUDA, float32 ``main_grad``, 16-bit inputs) but ran the 16-bit GEMM
    added into float32, because the kernel failed once with ``error`` (then warned once, never
    tried again)."""

    fused: int = 0
    fallback: int = 0
    error: str | None = None


FUSED_GEMM = FusedGemmRecord()
"""This process's :class:`FusedGemmRecord`."""


def _addmm_float32(main: torch.Tensor, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> None:
    """``main += grad_rowsᵀ · input_rows`` by ``aten::addmm.dtype_out`` (``out = main``, beta = 1).
    Raises AttributeError on a torch without that overload, NotImplementedError or RuntimeError
    where the device has no kernel for it."""
    torch.ops.aten.addmm.dtype_out(main, grad_rows.t(), input_rows, torch.float32, out=main)


def _fused_gemm(main: torch.Tensor, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> bool:
    """``main += grad_rowsᵀ · input_rows`` in one float32-accumulating GEMM on CUDA; False where
    this torch or device lacks the kernel: recorded in :data:`FUSED_GEMM` and warned about once
    (a RuntimeWarning), and never tried again."""
    record, counted = FUSED_GEMM, not torch.compiler.is_compiling()
    if record.error is None:
        try:
            _addmm_float32(main, grad_rows, input_rows)
        except (AttributeError, NotImplementedError, RuntimeError) as e:
            record.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(
                f"ptdp: the float32-accumulating weight-gradient GEMM (aten::addmm.dtype_out) failed "
                f"({record.error}); weight gradients fall back to a 16-bit GEMM added into float32",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            if counted:
                record.fused += 1
            return True
    if counted:
        record.fallback += 1
    return False


class EmbeddingFunction(torch.autograd.Function):
    """The lookup ``weight[ids]`` (``F.embedding``), rows whose id is ``outside`` this shard zeroed,
    whose backward adds the looked-up rows' gradients into ``weight.main_grad``.

    Per rank: ``ids [...]`` int64 in ``[0, rows)`` (local to the shard, 0 where ``outside``),
    ``weight [rows, h]``, ``outside`` bool like ``ids`` or None; output ``[..., h]``. No
    communication. Backward: ``main_grad.index_add_(0, ids, rows)`` of the output gradient as
    float32 ``[n, h]`` rows (zeroed where ``outside``); nothing goes to autograd. Without
    ``main_grad``: autograd's dense gradient. On CUDA ``index_add_`` uses atomics: the summation
    order varies unless ``torch.use_deterministic_algorithms(True)``.
    """

    @staticmethod
    def forward(ctx, ids, weight, outside):
        ctx.weight, ctx.rows = weight, weight.shape[0]  # the leaf itself: no version check in backward
        ctx.save_for_backward(ids, outside)
        out = F.embedding(ids, weight)
        return out if outside is None else out.masked_fill_(outside.unsqueeze(-1), 0)

    @staticmethod
    def backward(ctx, grad):
        ids, outside = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        main = getattr(ctx.weight, "main_grad", None)
        if main is None:
            if outside is not None:
                grad = grad.masked_fill(outside.unsqueeze(-1), 0)
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.rows, -1, False), None
        rows = grad.reshape(-1, grad.shape[-1])
        if rows.dtype != main.dtype:
            rows = rows.to(main.dtype)  # a new [n, h] tensor: masked in place
            if outside is not None:
                rows.masked_fill_(outside.reshape(-1, 1), 0)
        elif outside is not None:
            rows = rows.masked_fill(outside.reshape(-1, 1), 0)
        main.index_add_(0, ids.reshape(-1), rows)
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, outside: torch.Tensor | None = None) -> torch.Tensor:
    """``F.embedding(ids, weight)`` with the rows where ``outside`` (bool, shaped like ``ids``) zeroed:
    ``[...] -> [..., h]``. The weight's gradient goes into ``weight.main_grad`` when it has one and
    this is not traced by ``torch.compile`` (:class:`EmbeddingFunction`); otherwise autograd's path,
    unchanged. No communication."""
    if fuse_here(weight):
        return EmbeddingFunction.apply(ids, weight, outside)
    out = F.embedding(ids, weight)
    return out if outside is None else out.masked_fill(outside.unsqueeze(-1), 0.0)
