"""The linear layer of a rank's stacked experts (:mod:`ptdp.engine.moe.experts`) as one autograd
function with explicit GEMMs per local expert: forward ``y_e = x_e W_eᵀ``, input gradient
``dx_e = dy_e W_e`` and weight gradient ``dW_e = dy_eᵀ x_e``. Forward and input gradient run in
FP8 under a recipe (:class:`ExpertFP8`) or in the operands' dtype (one ``torch._grouped_mm``
where it takes them); the weight gradient runs in the activations' dtype (with FP8 as torchao's
``rowwise_with_gw_hp``), at once or, while a :class:`~ptdp.engine.tensor_parallel.linear.WgradQueue`
defers, as a closure over ``dy`` and ``x`` (no autograd graph kept), added into ``main_grad``.

FP8 scales, computed over the same elements on every layout: an expert's rows arrive from several
micro-batches (ep spans data-parallel ranks) or from part of one (sequence or context
parallelism), so a scale over an expert's tokens would depend on the layout. Activations and their
gradients are therefore scaled per token: one scale per row (``tensorwise``, ``delayed``,
``rowwise``) or per 1x128 tile (``blockwise``), all-reduced over etp where etp splits the inner
dim (fc2's input, fc1's output gradient). Each expert's weight has the recipe's weight scales:
one per expert (``tensorwise``; ``delayed`` runs as current scaling), per row, or 128x128 tiles,
all-reduced over etp as :func:`ptdp.engine.fp8_layout.shared_amax` says. Backward keeps the input
in its own dtype (for the weight gradient, as without FP8) and the weights' FP8 copies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ptdp.engine.comm import AxisGroup
from ptdp.engine.fp8 import FP8Recipe, Granularity, Role, compute_amax, fp8_matmul, quantize, scale_from_amax
from ptdp.engine.fp8_layout import GemmDim, all_max, whole
from ptdp.engine.tensor_parallel.linear import FP8GEMMs, WgradQueue, accumulate_wgrad
from ptdp.engine.tensor_parallel.wgrad import add_weight_grad

Quantized = tuple[torch.Tensor, torch.Tensor]


#: dtypes ``torch._grouped_mm`` takes (CPU and CUDA); others run the loop
GROUPED_DTYPES = (torch.float32, torch.bfloat16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (``torch._grouped_mm``'s backward
    refuses expanded gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``torch._grouped_mm`` exists and takes these operands: float32 or bfloat16, rows of a
    multiple of 16 bytes, and on CUDA data 16-byte aligned (a sharded optimizer's parameters are
    views at any offset of one flat buffer)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in GROUPED_DTYPES or weight.dtype != x.dtype:
        return False
    item = x.element_size()
    if x.is_cuda and (x.data_ptr() % 16 or weight.data_ptr() % 16):
        return False
    return all((n * item) % 16 == 0 for n in weight.shape[1:])


def expert_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, splits: list[int] | None, grouped: bool
) -> torch.Tensor:
    """``x`` ``[N, in]`` sorted by expert times each expert's ``weight[e]`` ``[out, in]`` transposed:
    ``[N, out]``. ``counts`` ``[E_l]`` rows per expert on the device; ``splits`` the same on the host
    (needed by the loop). ``grouped`` and :func:`grouped_supported`: one ``torch._grouped_mm``."""
    if grouped and grouped_supported(x, weight):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))
    if splits is None:
        splits = counts.tolist()
    pieces = x.split(splits)
    return torch.cat([piece @ weight[e].t() for e, piece in enumerate(pieces)])


class ExpertFP8(FP8GEMMs):
    """One stacked expert linear's FP8 state on this rank: ``out_dim`` and ``in_dim`` are one
    expert's N and K as this rank holds them (split over etp). The weights' FP8 operands are kept
    per expert from their first use until the weights change or :meth:`end_step`."""

    def __init__(self, recipe: FP8Recipe, *, out_dim: GemmDim, in_dim: GemmDim, emulate: bool, tag: str) -> None:
        current = dataclasses.replace(recipe, recipe="tensorwise") if recipe.recipe == "delayed" else recipe
        super().__init__(current, out_dim=out_dim, in_dim=in_dim, emulate=emulate, tag=tag)
        self._stacked: dict[bool, tuple[tuple[int, int], list[Quantized]]] = {}

    def granularity(self, role: Role) -> Granularity:
        """The recipe's, except a tensor scale of an activation or gradient becomes one per row."""
        g = self.recipe.granularity(role)
        return "row" if g == "tensor" and role != "weight" else g

    def weights(self, weight: torch.Tensor, transposed: bool) -> list[Quantized]:
        """Each local expert's quantised ``W_e [N, K]`` (forward) or ``W_eᵀ [K, N]`` (``transposed``,
        dgrad) of the stacked ``weight [E_l, N, K]``, from this step's copies while it is unchanged."""
        key = (weight.data_ptr(), weight._version)
        kept = self._stacked.get(transposed)
        if kept is not None and kept[0] == key:
            return kept[1]
        w = weight.detach()
        if transposed and self.reuses_transpose("weight"):
            quantized = [
                (q.t().contiguous(), s.t().contiguous() if s.dim() == 2 else s) for q, s in self.weights(w, False)
            ]
        elif self.granularity("weight") == "tensor":  # one all-reduce for every expert
            amax = torch.stack([compute_amax(e, "tensor") for e in w])
            amax = all_max(amax, self.out_dim.axes + self.in_dim.axes, f"fp8_amax_{self.tag}")
            dtype = self.recipe.dtype("weight")
            scales = scale_from_amax(amax, dtype, self.recipe.margin)
            quantized = [(quantize(e.t() if transposed else e, s, dtype), s.reciprocal()) for e, s in zip(w, scales)]
        else:
            rows, cols = (self.in_dim, self.out_dim) if transposed else (self.out_dim, self.in_dim)
            quantized = [self.quantize(e.t() if transposed else e, rows, cols, "weight") for e in w]
        self._stacked[transposed] = (key, quantized)
        return quantized

    def end_step(self) -> None:
        super().end_step()
        self._stacked.clear()

    def grouped_matmul(
        self, a: Quantized, b: list[Quantized], splits: list[int], out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows ``splits[e]`` of the quantised ``a [R, K]`` times expert ``e``'s ``b[e]`` (``[N, K]``)
        transposed: ``[R, N]``. A per-expert tensor scale meets per-row activation scales as a
        column of equal values (``torch._scaled_mm``'s rowwise kernel)."""
        (q, s), out, start = a, [], 0
        for (bq, bs), n in zip(b, splits):
            rows = slice(start, start + n)
            a_s = s[rows] if s.dim() == 2 else s
            b_s = (
                bs.reshape(1, 1).expand(bq.shape[0], 1)
                if bs.numel() == 1 and a_s.dim() == 2 and a_s.shape[1] == 1
                else bs
            )
            out.append(fp8_matmul(q[rows], a_s, bq, b_s, out_dtype, emulate=self.emulate or q.device.type == "cpu"))
            start += n
        return torch.cat(out)


@dataclass(frozen=True)
class ExpertPlan:
    """How :class:`ExpertLinearFunction` runs: ``fp8`` (None: the operands' dtype), ``grouped``
    (one ``torch._grouped_mm`` where it takes the operands, else a loop), ``queue`` (where the
    weight gradient goes while it defers; None: never)."""

    fp8: ExpertFP8 | None = None
    grouped: bool = False
    queue: WgradQueue | None = None


class ExpertLinearFunction(torch.autograd.Function):
    """``x [R, K]`` sorted by local expert (``counts`` on the device, ``splits`` the same on the
    host) times each expert's ``weight[e] [N, K]`` transposed: ``[R, N]`` (module docstring). No
    communication beyond FP8's amax all-reduces over etp."""

    @staticmethod
    def forward(ctx, x, weight, counts, splits: list[int], plan: ExpertPlan):
        ctx.splits, ctx.plan, ctx.param = splits, plan, weight
        ctx.save_for_backward(x, weight, counts)
        if plan.fp8 is None:
            return expert_linear(x, weight, counts, splits, plan.grouped)
        x_q = plan.fp8.quantize(x, whole(x.shape[0]), plan.fp8.in_dim, "input")
        return plan.fp8.grouped_matmul(x_q, plan.fp8.weights(weight, transposed=False), splits, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, counts = ctx.saved_tensors
        plan: ExpertPlan = ctx.plan
        splits: list[int] = ctx.splits
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            if plan.fp8 is None:
                grad_x = expert_linear(grad, weight.transpose(-2, -1), counts, splits, plan.grouped)
            else:
                g_q = plan.fp8.quantize(grad, whole(grad.shape[0]), plan.fp8.out_dim, "grad_output")
                grad_x = plan.fp8.grouped_matmul(g_q, plan.fp8.weights(weight, transposed=True), splits, grad.dtype)
        if ctx.needs_input_grad[1]:

            def job(into: torch.Tensor | None) -> torch.Tensor | None:
                pieces = zip(grad.split(splits), x.split(splits))
                if into is None:
                    return torch.stack([g.t() @ a for g, a in pieces]).to(weight.dtype)
                for e, (g, a) in enumerate(pieces):  # float32 accumulation in the GEMM on CUDA
                    add_weight_grad(into[e], g, a)
                return None

            if plan.queue is not None and plan.queue.deferring:
                plan.queue.put(lambda: accumulate_wgrad(ctx.param, job), ctx.param)
            else:
                grad_w = job(None)
        return grad_x, grad_w, None, None, None


def expert_dims(
    hidden: int, ffn: int, halves: int, etp: AxisGroup
) -> tuple[tuple[GemmDim, GemmDim], tuple[GemmDim, GemmDim]]:
    """((N, K) of fc1, (N, K) of fc2) of one expert on this etp rank: fc1 ``[halves f, h]`` holds
    the rank's ``f / etp`` of each half, fc2 ``[h, f]`` its ``f / etp`` columns."""
    share, r = ffn // etp.size, etp.rank
    mine = [(j * ffn + r * share, j * ffn + (r + 1) * share) for j in range(halves)]
    axes = (etp,) if etp.size > 1 else ()
    return (
        (GemmDim(halves * ffn, tuple(mine), axes), whole(hidden)),
        (whole(hidden), GemmDim(ffn, tuple(mine[:1]), axes)),
    )
