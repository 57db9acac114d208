"""The linear layer of every transformer-layer GEMM (QKV, attention projection, fc1, fc2) as one
autograd function with three explicit GEMMs: forward ``y = x Wᵀ + b``, input gradient (dgrad)
``dx = dy W`` and weight gradient (wgrad) ``dW = dyᵀ x``.

Each GEMM runs in its own precision (:class:`GemmDtypes`: the operands' dtype, or another float
dtype), or all three in FP8 under a recipe (:class:`FP8GEMMs`, :mod:`ptdp.engine.fp8`). The
weight gradient goes into the float32 ``weight.main_grad`` when the weight has one
(:mod:`ptdp.engine.tensor_parallel.wgrad`), at once or, while a :class:`WgradQueue` defers, as a
closure over the tensors it needs (no autograd graph kept) run by :meth:`WgradQueue.run`.

Communication (:class:`LinearPlan`): ``local`` none; ``all_reduce``, the column-parallel linear's f:
backward sums the input gradient over tp, started when dgrad is known and waited for after wgrad;
``sequence``, sequence parallelism's g fused in: forward all-gathers the input ``[s/t, b, in]``
along the sequence (only the shard is kept), backward gathers it again for wgrad while dgrad
runs and reduce-scatters the input gradient while wgrad runs.

FP8 memory kept for backward: the input as wgrad's FP8 operand (1 byte per element; with
``sequence`` the input's shard in its own dtype, gathered again); the weight's FP8 forward and
dgrad operands for the step (:meth:`FP8GEMMs.weight`). The GEMMs' ``[T, ·]`` rows are the
microbatch's tokens flattened sequence-major (:func:`ptdp.engine.fp8_layout.token_dim`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from ptdp.engine.comm import AxisGroup, Handle, all_reduce, all_reduce_async
from ptdp.engine.eager import outside_compile
from ptdp.engine.fp8 import (
    DelayedScaling,
    FP8Recipe,
    Granularity,
    Role,
    compute_amax,
    fp8_matmul,
    quantize,
    scale_from_amax,
)
from ptdp.engine.fp8_layout import GemmDim, shared_amax, token_dim
from ptdp.engine.tensor_parallel.sequence import start_sequence_gather, start_sequence_reduce_scatter
from ptdp.engine.tensor_parallel.wgrad import add_weight_grad, fuse_here

Comm = Literal["local", "all_reduce", "sequence"]


@dataclass(frozen=True)
class GemmDtypes:
    """The dtype each GEMM multiplies in (None: its operands' dtype); its result is cast back to
    the activation's dtype (wgrad: the gradient's, float32 into ``main_grad``)."""

    forward: torch.dtype | None = None
    dgrad: torch.dtype | None = None
    wgrad: torch.dtype | None = None

    @property
    def native(self) -> bool:
        return self.forward is None and self.dgrad is None and self.wgrad is None


class WgradQueue:
    """Weight-gradient GEMMs handed over by backward while :meth:`defer` is active, each a closure
    over the tensors it needs, run in order by :meth:`run`. The caller runs them before the
    gradients are read or reduced."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        """Whether :meth:`defer` may be used: the linears then run their own autograd function in
        every forward, so a recomputed forward saves what the first one did."""
        self.deferring = False
        self._pending: list[tuple[Callable[[], None], torch.Tensor]] = []

    @contextlib.contextmanager
    def defer(self) -> Iterator[WgradQueue]:
        """Within this block, the linears using this queue defer their weight gradients to it."""
        if not self.enabled:
            raise RuntimeError("this WgradQueue was built with enabled=False: its linears cannot defer")
        before, self.deferring = self.deferring, True
        try:
            yield self
        finally:
            self.deferring = before

    def put(self, job: Callable[[], None], param: torch.Tensor) -> None:
        """Defer ``job``, which completes ``param``'s gradient for this microbatch."""
        self._pending.append((job, param))

    def take(self) -> list[tuple[Callable[[], None], torch.Tensor]]:
        """Remove and return the deferred ``(closure, parameter)`` pairs (oldest first), for
        :meth:`run` later."""
        jobs, self._pending = self._pending, []
        return jobs

    def run(
        self,
        jobs: list[tuple[Callable[[], None], torch.Tensor]] | None = None,
        done: Callable[[torch.Tensor], None] | None = None,
    ) -> int:
        """Run ``jobs`` (by default every deferred weight-gradient GEMM, which leave the queue),
        oldest first, calling ``done(parameter)`` after each; returns how many ran."""
        if jobs is None:
            jobs = self.take()
        with torch.no_grad():  # the closures' operands are autograd's saved tensors
            for job, param in jobs:
                job()
                if done is not None:
                    done(param)
        return len(jobs)

    def __len__(self) -> int:
        return len(self._pending)


class FP8GEMMs:
    """One linear layer's FP8 GEMMs on this rank: the recipe, ``emulate`` (never
    ``torch._scaled_mm``), the layer's output and input dims as this rank holds them
    (:class:`~ptdp.engine.fp8_layout.GemmDim`: N and K) and the cp axis splitting the tokens.
    Under ``delayed`` a :class:`~ptdp.engine.fp8.DelayedScaling` history (:attr:`delayed`):
    this step's amaxes observed locally, reduced over every rank running the layer by
    :func:`end_fp8_step`. The weight's two FP8 operands (forward ``W``, dgrad ``Wᵀ``, contiguous)
    are kept from their first use until the weight changes or the step ends (2 bytes per weight,
    as Transformer Engine keeps them), so each is quantised once per step."""

    def __init__(
        self,
        recipe: FP8Recipe,
        *,
        out_dim: GemmDim,
        in_dim: GemmDim,
        cp: AxisGroup | None = None,
        emulate: bool = False,
        tag: str = "linear",
    ) -> None:
        self.recipe, self.emulate, self.tag = recipe, emulate, tag
        self.out_dim, self.in_dim, self.cp = out_dim, in_dim, cp
        self.delayed = DelayedScaling(recipe) if recipe.recipe == "delayed" else None
        self.recording = True
        """Whether delayed scaling records this call's amaxes (not in evaluation, without grad)."""
        self._weights: dict[bool, tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
        self._weight_recorded = False
        """Whether delayed scaling recorded the kept weight's amax (a copy made in evaluation did not)."""

    def weight(self, weight: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantised ``W [N, K]`` (forward) or ``Wᵀ [K, N]`` (dgrad, ``transposed``), from
        this step's copy while ``weight`` is unchanged (same storage and version). Under delayed
        scaling a recording call records the weight's amax once per copy, also when the copy was
        made while not recording (evaluation before the step)."""
        key = (weight.data_ptr(), weight._version)
        kept = self._weights.get(transposed)
        if kept is not None and kept[0] == key:
            if self.delayed is not None and self.recording and not self._weight_recorded:
                self.delayed.observe("weight", compute_amax(weight.detach(), "tensor"))
                self._weight_recorded = True
            return kept[1]
        if not transposed:
            self._weight_recorded = self.recording
            quantized = self.quantize(weight, self.out_dim, self.in_dim, "weight")
        elif self.reuses_transpose("weight"):
            q, scale_inv = self.transposed(self.weight(weight, False))
            quantized = (q.contiguous(), scale_inv.contiguous())
        else:
            quantized = self.quantize(weight.t(), self.in_dim, self.out_dim, "weight")
        self._weights[transposed] = (key, quantized)
        return quantized

    def end_step(self) -> None:
        """Drop the step's FP8 weights (the next step quantises the updated weights)."""
        self._weights.clear()
        self._weight_recorded = False

    def tokens(self, shape: torch.Size) -> GemmDim:
        """The token dim of an activation ``[s, b, ·]`` (or ``[T, ·]``) on this rank."""
        if len(shape) == 3:
            return token_dim(shape[0], shape[1], self.cp)
        return token_dim(shape[0], 1, self.cp)

    def quantize(self, x: torch.Tensor, rows: GemmDim, cols: GemmDim, role: Role) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_q, scale_inv)`` of the operand ``x [R, K]`` as ``role`` in this layer's recipe."""
        dtype = self.recipe.dtype(role)
        if self.delayed is not None:
            if self.delayed.history.device != x.device:
                self.delayed.history = self.delayed.history.to(x.device)
                self.delayed.pending = self.delayed.pending.to(x.device)
            if self.recording:
                self.delayed.observe(role, compute_amax(x.detach(), "tensor"))
            scale = self.delayed.scale(role)
        else:
            amax = shared_amax(x.detach(), rows, cols, self.granularity(role), f"fp8_amax_{self.tag}")
            scale = scale_from_amax(amax, dtype, self.recipe.margin)
        return quantize(x.detach(), scale, dtype), scale.reciprocal()

    def matmul(
        self, a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], out_dtype
    ) -> torch.Tensor:
        """``a @ bᵀ`` of two quantised operands ``(q, scale_inv)``."""
        return fp8_matmul(*a, *b, out_dtype, emulate=self.emulate or a[0].device.type == "cpu")

    def transposed(self, quantized: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A tensorwise or tiled operand's quantisation reused for its transpose."""
        q, scale_inv = quantized
        return q.t(), scale_inv if scale_inv.dim() < 2 else scale_inv.t()

    def granularity(self, role: Role) -> Granularity:
        """The scales' granularity of a ``role`` operand of these GEMMs: the recipe's."""
        return self.recipe.granularity(role)

    def reuses_transpose(self, role: Role) -> bool:
        """Whether the transpose of a ``role`` operand has the same scales (tensor, 128x128 tiles)."""
        return self.granularity(role) in ("tensor", "128x128")


@dataclass(frozen=True)
class FP8Settings:
    """A model's FP8 choices for its linear layers: the recipe, ``emulate`` and the cp axis
    splitting the tokens (None: size 1)."""

    recipe: FP8Recipe
    emulate: bool = False
    cp: AxisGroup | None = None

    def gemms(self, out_dim: GemmDim, in_dim: GemmDim, tag: str) -> FP8GEMMs:
        """A layer's :class:`FP8GEMMs` with these choices."""
        return FP8GEMMs(self.recipe, out_dim=out_dim, in_dim=in_dim, cp=self.cp, emulate=self.emulate, tag=tag)


@dataclass(frozen=True)
class LinearPlan:
    """What a linear layer does besides its GEMMs: ``comm`` over ``axis`` (module docstring),
    counted under ``tag``; the GEMMs' ``dtypes``; ``fp8`` (None: no FP8); ``queue``, where
    backward defers wgrad while it is deferring (None: never)."""

    comm: Comm = "local"
    axis: AxisGroup = field(default_factory=lambda: AxisGroup.single("tp"))
    tag: str = ""
    dtypes: GemmDtypes = GemmDtypes()
    fp8: FP8GEMMs | None = None
    queue: WgradQueue | None = None

    @property
    def plain(self) -> bool:
        """Nothing beyond ``F.linear`` and autograd's weight gradient would differ (and no weight
        gradient can be deferred)."""
        deferring = self.queue is not None and self.queue.enabled
        return self.comm == "local" and self.dtypes.native and self.fp8 is None and not deferring


def _unflatten(rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The GEMM's ``[T, N]`` result as ``[..., N]`` of an input of ``shape``, not an autograd view
    (a custom function's output may be changed in place, as ``F.linear``'s: ``aten::_unsafe_view``)."""
    return torch.ops.aten._unsafe_view(rows, (*shape[:-1], rows.shape[-1]))


def _gemm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ bᵀ`` in ``dtype`` (None: as they are), cast to ``out_dtype``."""
    if dtype is not None:
        a, b = a.to(dtype), b.to(dtype)
    return a.mm(b.t()).to(out_dtype)


class LinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with the three GEMMs and the communication of a
    :class:`LinearPlan` (module docstring). Per rank: ``x [..., in]`` (``[s/t, b, in]`` with
    ``sequence``), ``weight [out, in]`` -> ``[..., out]``."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan, record: bool):
        ctx.plan, ctx.has_bias = plan, bias is not None
        # the parameter itself, where its gradient goes (a recomputed forward's saved weight is a
        # detached alias without main_grad); its values are read from the saved tensors
        ctx.param = weight
        full = start_sequence_gather(x, plan.axis, plan.tag)() if plan.comm == "sequence" else x
        rows = full.flatten(0, -2)
        fp8 = plan.fp8
        if fp8 is None:
            if plan.dtypes.forward is None:
                y = F.linear(full, weight, bias)
            else:
                y = _unflatten(_gemm(rows, weight, plan.dtypes.forward, full.dtype), full.shape)
                y = y + bias if bias is not None else y
            ctx.save_for_backward(x, weight)
            return y
        fp8.recording = record
        tokens = fp8.tokens(full.shape)
        x_q = fp8.quantize(rows, tokens, fp8.in_dim, "input")
        w_q = fp8.weight(weight, transposed=False)
        y = _unflatten(fp8.matmul(x_q, w_q, full.dtype), full.shape)
        if bias is not None:
            y = y + bias
        ctx.tokens = tokens
        if plan.comm == "sequence":  # the shard, gathered again in backward
            ctx.save_for_backward(x, weight)
        else:  # wgrad's FP8 operand xᵀ [K, T]
            xt = (
                fp8.transposed(x_q)
                if fp8.reuses_transpose("input")
                else fp8.quantize(rows.t(), fp8.in_dim, tokens, "input")
            )
            ctx.save_for_backward(xt[0], xt[1], weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        plan: LinearPlan = ctx.plan
        fp8 = plan.fp8
        saved = ctx.saved_tensors
        weight = saved[-1]
        gy = grad.flatten(0, -2)  # [T, N]; N may be 0 (a shard of vocabulary padding)
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        regather = None
        if plan.comm == "sequence" and want_w:
            regather = start_sequence_gather(saved[0], plan.axis, plan.tag + "_regather")
        grad_x = None
        finish: Callable[[], torch.Tensor] | None = None
        gy_q = None
        if fp8 is not None:
            fp8.recording = True
            gy_q = fp8.quantize(gy, ctx.tokens, fp8.out_dim, "grad_output")
        if want_x:
            k = weight.shape[1]
            if fp8 is None:
                grad_x = _gemm(gy, weight.t(), plan.dtypes.dgrad, grad.dtype)
            else:
                assert gy_q is not None
                grad_x = fp8.matmul(gy_q, fp8.weight(weight, transposed=True), grad.dtype)
            grad_x = grad_x.view(*grad.shape[:-1], k)
            if plan.comm == "all_reduce":
                finish = _waiting(all_reduce_async(grad_x, plan.axis, tag=plan.tag), grad_x)
            elif plan.comm == "sequence":
                finish = start_sequence_reduce_scatter(grad_x, plan.axis, plan.tag)
        grad_weight = None
        if want_w:
            job = _wgrad_job(plan, ctx, weight, gy, gy_q, saved, regather)
            if plan.queue is not None and plan.queue.deferring:
                plan.queue.put(lambda: accumulate_wgrad(ctx.param, job), ctx.param)
            else:
                grad_weight = _to_autograd(ctx.param, job)
        grad_bias = gy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if finish is not None:
            grad_x = finish()
        return grad_x, grad_weight, grad_bias, None, None


def _waiting(handle: Handle, result: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function that waits for ``handle`` and gives ``result``."""

    def finish() -> torch.Tensor:
        handle.wait()
        return result

    return finish


WgradJob = Callable[[torch.Tensor | None], torch.Tensor | None]


def _wgrad_job(plan: LinearPlan, ctx, weight, gy, gy_q, saved, regather) -> WgradJob:
    """The weight-gradient GEMM ``dyᵀ x`` as a closure over what it needs: given a float32 or
    float64 ``main_grad`` it adds into it (on CUDA, 16-bit operands accumulate in the GEMM) and
    returns None; given None it returns the gradient in the weight's dtype."""
    fp8 = plan.fp8
    if fp8 is None:
        x = regather() if regather is not None else saved[0]
        x_rows = x.flatten(0, -2)
        dtype = plan.dtypes.wgrad

        def run(into: torch.Tensor | None) -> torch.Tensor | None:
            if dtype is None and into is not None:
                add_weight_grad(into, gy, x_rows)
                return None
            grad = _gemm(gy.t(), x_rows.t(), dtype, weight.dtype if into is None else into.dtype)
            return _into(into, grad)

        return run
    tokens = ctx.tokens
    if regather is not None:
        x_rows = regather().flatten(0, -2)
        if fp8.reuses_transpose("input"):
            xt = fp8.transposed(fp8.quantize(x_rows, tokens, fp8.in_dim, "input"))
        else:
            xt = fp8.quantize(x_rows.t(), fp8.in_dim, tokens, "input")
    else:
        xt = (saved[0], saved[1])
    if fp8.reuses_transpose("grad_output"):
        gyt = fp8.transposed(gy_q)
    else:
        gyt = fp8.quantize(gy.t(), fp8.out_dim, tokens, "grad_output")

    def run_fp8(into: torch.Tensor | None) -> torch.Tensor | None:
        return _into(into, fp8.matmul(gyt, xt, weight.dtype if into is None else into.dtype))

    return run_fp8


def _into(into: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor | None:
    """``grad``, or None after adding it into ``into``."""
    if into is None:
        return grad
    into.add_(grad)
    return None


def accumulate_wgrad(weight: torch.Tensor, job: WgradJob) -> None:
    """Run a deferred weight gradient into ``main_grad``, else add it into ``weight.grad``."""
    main = getattr(weight, "main_grad", None)
    if main is not None:
        job(main)
        return
    grad = job(None)
    assert grad is not None
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad.add_(grad)


def _to_autograd(weight: torch.Tensor, job: WgradJob) -> torch.Tensor | None:
    """The gradient autograd gets: None after adding it into ``main_grad`` (when the weight has
    one and this torch marks it complete without a gradient, :func:`fuse_here`)."""
    if fuse_here(weight):
        return job(weight.main_grad)  # type: ignore[attr-defined]  # GradBuffer's attribute
    return job(None)


@outside_compile
def _apply(x, weight, bias, plan: LinearPlan, record: bool) -> torch.Tensor:
    """:class:`LinearFunction` run eagerly, never traced (a compiled layer is split around it)."""
    return LinearFunction.apply(x, weight, bias, plan, record)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, plan: LinearPlan | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``plan`` runs it (module docstring). A plain plan under
    ``torch.compile`` or for a weight without ``main_grad`` is ``F.linear`` itself."""
    plan = plan or LinearPlan()
    if plan.plain and not fuse_here(weight):
        return F.linear(x, weight, bias)
    if plan.comm != "local" and plan.axis.size == 1:
        plan = dataclasses.replace(plan, comm="local")
    return _apply(x, weight, bias, plan, torch.is_grad_enabled())


def end_fp8_step(layers: list[FP8GEMMs], axes: list[AxisGroup]) -> None:
    """End of a training step for delayed scaling: every layer's pending amaxes, stacked, all-reduced
    (MAX) over ``axes`` (every rank running those layers: tp, and dp x cp), then moved into each
    history (:meth:`ptdp.engine.fp8.DelayedScaling.step`). Every rank of ``axes`` calls it with the
    same layers. Every layer's FP8 weights are dropped (:meth:`FP8GEMMs.end_step`)."""
    for layer in layers:
        layer.end_step()
    delayed = [layer.delayed for layer in layers if layer.delayed is not None]
    if not delayed:
        return
    pending = torch.stack([d.pending for d in delayed])
    for axis in axes:
        all_reduce(pending, axis, op="max", tag="fp8_amax_history")
    for d, row in zip(delayed, pending):
        d.pending.copy_(row)
        d.step()
