"""FP8 numerics: formats, the scales of each recipe, quantisation and the FP8 GEMM (pure torch).

Formats (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433), Megatron-Core's
``--fp8-format``: ``e4m3`` (every operand ``torch.float8_e4m3fn``, max 448) and ``hybrid`` (e4m3
for inputs and weights, ``torch.float8_e5m2``, max 57344, for output gradients).

Recipes (``--fp8-recipe``) as the granularity of a GEMM operand's scales. An operand is ``[R, K]``
with ``K`` the GEMM's inner dim (the caller transposes it so): ``tensorwise`` and ``delayed`` one
scale (current: from this tensor's amax; delayed: from past amaxes, :class:`DelayedScaling`),
``rowwise`` one per row ``[R, 1]`` (amax over ``K``), ``blockwise`` DeepSeek-V3's tiles
(arXiv:2412.19437 §3.3): ``1x128`` for inputs and output gradients ``[R, ceil(K/128)]``,
``128x128`` for weights ``[ceil(R/128), ceil(K/128)]``; a partial last tile holds the elements
present (the same amax as zero padding).

Scale, in float32 as Transformer Engine computes it: ``scale = fp8_max / (amax * 2**margin)``;
amax 0 (nothing to scale) or not finite (the tensor holds inf/NaN) gives 1; clamped to float32's
normal range, so ``scale`` and ``scale_inv = 1 / scale`` are finite and nonzero. Quantise
multiplies by ``scale`` (in float32, float64 for float64 input), saturates finite values to
±fp8_max and rounds once to nearest, ties to even; NaN stays NaN, ±inf becomes NaN in e4m3 (which has no
infinity; torch's cast would give ±448) and stays ±inf in e5m2: a non-finite input never becomes
finite, so the GEMM's output is not finite and ptdp's step check skips the step. Dequantise
multiplies by ``scale_inv``.

Layout invariance: amaxes are computed apart from scales so that a caller can all-reduce them (MAX)
over the ranks holding parts of the elements one scale covers; then every layout quantises the
same elements with the same scale. ``tensor``: every rank holding a shard of the tensor; ``row``:
the ranks splitting ``K`` (a row-parallel layer's input and weight; wgrad's token dim under
sequence or context parallelism), none for a split of ``R``; tiles: none when every shard boundary
falls on a multiple of 128 of the global dim, else the ranks sharing a cut tile; delayed: a
step's amax over every rank that quantises the tensor in the step (its shards' ranks, and the
data-parallel ranks, which see other microbatches). Nothing here communicates or reads a value
to the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

Format = Literal["e4m3", "hybrid"]
Recipe = Literal["tensorwise", "delayed", "rowwise", "blockwise"]
AmaxAlgo = Literal["max", "most_recent"]
Role = Literal["input", "weight", "grad_output"]
Granularity = Literal["tensor", "row", "1x128", "128x128"]

FORMATS: tuple[Format, ...] = ("e4m3", "hybrid")
RECIPES: tuple[Recipe, ...] = ("tensorwise", "delayed", "rowwise", "blockwise")
AMAX_ALGOS: tuple[AmaxAlgo, ...] = ("max", "most_recent")
ROLES: tuple[Role, ...] = ("input", "weight", "grad_output")
#: the side of a blockwise tile (DeepSeek-V3's 1x128 and 128x128)
TILE = 128
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class FP8Recipe:
    """One FP8 configuration, Megatron-Core's flags; ValueError naming the value for a bad one."""

    format: Format = "e4m3"
    """``--fp8-format``: ``e4m3`` everywhere, or ``hybrid`` (e5m2 output gradients)."""
    recipe: Recipe = "tensorwise"
    """``--fp8-recipe``: the scales' granularity and whether they come from past amaxes."""
    margin: int = 0
    """``--fp8-margin``: scales are divided by ``2**margin`` (headroom below fp8_max); >= 0."""
    amax_history_len: int = 1
    """``--fp8-amax-history-len``: past amaxes a delayed scale is computed from; >= 1."""
    amax_compute_algo: AmaxAlgo = "most_recent"
    """``--fp8-amax-compute-algo``: a delayed scale from the history's ``max`` or ``most_recent``."""

    def __post_init__(self) -> None:
        for name, value, choices in (
            ("format", self.format, FORMATS),
            ("recipe", self.recipe, RECIPES),
            ("amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS),
        ):
            if value not in choices:
                raise ValueError(f"FP8 {name} {value!r} is not one of {', '.join(choices)}")
        for name, number, least in (("margin", self.margin, 0), ("amax_history_len", self.amax_history_len, 1)):
            if type(number) is not int or number < least:
                raise ValueError(f"FP8 {name} must be an integer >= {least}, got {number!r}")

    def dtype(self, role: Role) -> torch.dtype:
        """The float8 dtype of an operand of ``role``: e5m2 for ``grad_output`` under ``hybrid``."""
        _check_role(role)
        return torch.float8_e5m2 if self.format == "hybrid" and role == "grad_output" else torch.float8_e4m3fn

    def granularity(self, role: Role) -> Granularity:
        """The scales' granularity for an operand of ``role`` (module docstring)."""
        _check_role(role)
        if self.recipe == "rowwise":
            return "row"
        if self.recipe == "blockwise":
            return "128x128" if role == "weight" else "1x128"
        return "tensor"


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"FP8 role {role!r} is not one of {', '.join(ROLES)}")


def _check_fp8(dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an FP8 dtype (float8_e4m3fn or float8_e5m2)")


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype``: 448 (e4m3fn), 57344 (e5m2)."""
    _check_fp8(dtype)
    return torch.finfo(dtype).max


def compute_amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """float32 max of ``|x|`` per scaled group of the operand ``x`` ``[R, K]`` (any shape for
    ``tensor``): ``[]``, ``[R, 1]``, ``[R, ceil(K/128)]`` or ``[ceil(R/128), ceil(K/128)]``.
    NaN anywhere in a group gives NaN, inf gives inf; an empty group gives 0. ValueError for
    another granularity or a non-2-D operand of a per-row or tile granularity."""
    if granularity == "tensor":
        if x.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        return x.abs().amax().float()
    if granularity not in ("row", "1x128", "128x128"):
        raise ValueError(f"FP8 granularity {granularity!r} is not one of tensor, row, 1x128, 128x128")
    if x.dim() != 2:
        raise ValueError(f"a {granularity} amax needs a 2-D operand [R, K], got shape {tuple(x.shape)}")
    rows, k = x.shape
    # groups of row_tile x k_tile elements (a row: 1 x K, one group even for K = 0)
    row_tile = TILE if granularity == "128x128" else 1
    k_tile = max(k, 1) if granularity == "row" else TILE
    row_tiles, k_tiles = -(-rows // row_tile), max(-(-k // k_tile), int(granularity == "row"))
    if x.numel() == 0:
        return torch.zeros((row_tiles, k_tiles), dtype=torch.float32, device=x.device)
    pad = (0, k_tiles * k_tile - k, 0, row_tiles * row_tile - rows)
    padded = torch.nn.functional.pad(x.abs(), pad)
    return padded.view(row_tiles, row_tile, k_tiles, k_tile).amax(dim=(1, 3)).float()


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """float32 scales ``fp8_max(dtype) / (amax * 2**margin)`` of the float32 ``amax`` (any shape,
    e.g. all-reduced): 1 where amax is 0 or not finite; clamped to [float32 tiny, float32 max]."""
    _check_fp8(dtype)
    amax = amax.float()
    # a tensor numerator: ``float / tensor`` is ``reciprocal() * float`` in torch (two roundings)
    # (2**256 is inf in float32 already, and a Python float overflows at 2**1024)
    scale = torch.full_like(amax, fp8_max(dtype)) / (amax * 2.0 ** min(margin, 256))
    info = torch.finfo(torch.float32)
    scale = scale.clamp(info.tiny, info.max)
    return torch.where((amax > 0) & amax.isfinite(), scale, torch.ones_like(scale))


def _expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``scale`` (one value, or one per row or tile of a 2-D ``shape``) expanded to ``shape``."""
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.dim() != len(shape):
        raise ValueError(f"scales of shape {tuple(scale.shape)} do not fit an operand of shape {tuple(shape)}")
    for dim, n in enumerate(shape):
        groups = scale.size(dim)
        if groups == n or groups == 1:
            continue
        if groups != -(-n // TILE):
            raise ValueError(
                f"scales of shape {tuple(scale.shape)} do not fit an operand of shape {tuple(shape)}: dim {dim} "
                f"needs {n}, 1 or ceil({n}/{TILE}) = {-(-n // TILE)} scales"
            )
        scale = scale.repeat_interleave(TILE, dim=dim).narrow(dim, 0, n)
    return scale


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` saturated to ±fp8_max and rounded once to the float8 ``dtype`` (nearest,
    ties to even); same shape as ``x``.

    ``scale``: float32, one value or one per row/tile of a 2-D ``x`` (:func:`compute_amax`'s
    shapes). The product is float32 (float64 for float64 ``x``). NaN stays NaN; ±inf gives NaN in
    e4m3fn, ±inf in e5m2 (never a finite value)."""
    limit = fp8_max(dtype)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    saturated = (x.to(work) * _expand(scale, x.shape).to(work)).clamp(-limit, limit)
    if work == torch.float64:
        saturated = _round_to_odd_float32(saturated)
    infinite = torch.full_like(saturated, float("nan")) if dtype == torch.float8_e4m3fn else x.float()
    return torch.where(x.isinf(), infinite, saturated).to(dtype)


def _round_to_odd_float32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded to odd (toward zero, last bit set if inexact): torch casts
    float64 to float8 through float32, and rounding to odd first makes those two roundings one
    (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
    rounding to odd", IEEE TC 2008). Finite input within float32's range."""
    nearest = x.float()
    toward_zero = torch.where(nearest.double().abs() > x.abs(), nearest.nextafter(torch.zeros_like(nearest)), nearest)
    odd = (toward_zero.view(torch.int32) | 1).view(torch.float32)
    return torch.where(nearest.double() == x, nearest, odd)


def dequantize(x_q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x_q * scale_inv`` in ``dtype`` (float32 or float64); ``scale_inv`` as in :func:`quantize`."""
    _check_fp8(x_q.dtype)
    return x_q.to(dtype) * _expand(scale_inv, x_q.shape).to(dtype)


def quantize_current(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: Granularity,
    *,
    margin: int = 0,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling: ``(x_q, scale_inv)`` with the scales of ``amax`` (this rank's by default;
    pass the all-reduced one when ``x`` is a shard). ``scale_inv``: float32, :func:`compute_amax`'s shape."""
    group_amax = compute_amax(x, granularity) if amax is None else amax
    scale = scale_from_amax(group_amax, dtype, margin)
    return quantize(x, scale, dtype), scale.reciprocal()


def _scaled_mm_kind(
    a_q: torch.Tensor, a_scale_inv: torch.Tensor, b_q: torch.Tensor, b_scale_inv: torch.Tensor
) -> str | None:
    if a_scale_inv.numel() == 1 and b_scale_inv.numel() == 1:
        return "tensor"
    if a_scale_inv.shape == (a_q.size(0), 1) and b_scale_inv.shape == (b_q.size(0), 1):
        return "row"
    k_tiles = -(-a_q.size(1) // TILE)
    if a_scale_inv.shape == (a_q.size(0), k_tiles) and b_scale_inv.shape == (-(-b_q.size(0) // TILE), k_tiles):
        return "block"  # DeepSeek-V3's 1x128 activations times 128x128 weights
    if a_scale_inv.shape == (a_q.size(0), k_tiles) and b_scale_inv.shape == (b_q.size(0), k_tiles):
        return "block_1x128"  # two 1x128 operands: the weight gradient
    return None


def _kernel_call(
    a_q: torch.Tensor, a_scale_inv: torch.Tensor, b_q: torch.Tensor, b_scale_inv: torch.Tensor, out_dtype, kind: str
) -> torch.Tensor:
    """``torch._scaled_mm`` of ``a_q @ b_qᵀ`` with the scales as it takes them for ``kind``: one each,
    a column and a row (rowwise), or 1x128 scales outer-dim-major and 128x128 ones transposed with
    ``b``, or two 1x128 operands' scales outer-dim-major (blockwise, cuBLAS's layout)."""
    if kind == "tensor":
        scale_a, scale_b = a_scale_inv.reshape(()), b_scale_inv.reshape(())
    elif kind == "row":
        scale_a, scale_b = a_scale_inv.contiguous(), b_scale_inv.reshape(1, -1).contiguous()
    elif kind == "block":
        scale_a, scale_b = a_scale_inv.t().contiguous().t(), b_scale_inv.contiguous().t()
    else:
        scale_a, scale_b = a_scale_inv.t().contiguous().t(), b_scale_inv.t().contiguous()
    return torch._scaled_mm(
        a_q.contiguous(), b_q.contiguous().t(), scale_a.float(), scale_b.float(), out_dtype=out_dtype
    )


@functools.cache
def _kernel_runs(
    device: torch.device, kind: str, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype
) -> bool:
    """Whether ``torch._scaled_mm`` runs this combination here and equals the emulation (tried once
    on random 128 x 256 and 256 x 256 operands with random scales, within the output's rounding and
    a float32 accumulation's): a kernel that raises or reads the scales in another layout is not used."""
    gen = torch.Generator().manual_seed(0)
    m, k, n = 128, 256, 256
    groups = {
        "tensor": ((1,), (1,)),
        "row": ((m, 1), (n, 1)),
        "block": ((m, k // TILE), (n // TILE, k // TILE)),
        "block_1x128": ((m, k // TILE), (n, k // TILE)),
    }
    a = (torch.randn(m, k, generator=gen) * 4).to(a_dtype).to(device)
    b = (torch.randn(n, k, generator=gen) * 4).to(b_dtype).to(device)
    a_inv, b_inv = (torch.rand(shape, generator=gen).add(0.5).to(device) for shape in groups[kind])
    a_inv, b_inv = (a_inv.reshape(()), b_inv.reshape(())) if kind == "tensor" else (a_inv, b_inv)
    try:
        got = _kernel_call(a, a_inv, b, b_inv, out_dtype, kind)
    except (RuntimeError, ValueError, NotImplementedError, TypeError):
        return False
    want = dequantize(a, a_inv, torch.float64) @ dequantize(b, b_inv, torch.float64).t()
    # the output's rounding and a float32 accumulation over k (a wrong scale layout is off by tens of %)
    rounding = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[out_dtype] + k * 2.0**-23
    scale = (
        dequantize(a.float().abs().to(a.dtype), a_inv, torch.float64)
        @ dequantize(b.float().abs().to(b.dtype), b_inv, torch.float64).t()
    )
    return bool(((got.double() - want).abs() <= rounding * scale + 1e-30).all())


def has_scaled_mm_kernel(
    a_q: torch.Tensor, a_scale_inv: torch.Tensor, b_q: torch.Tensor, b_scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> bool:
    """Whether :func:`fp8_matmul` of these operands runs ``torch._scaled_mm``: tensorwise, rowwise
    or blockwise (1x128 by 128x128 or by 1x128, on CUDA with ``K`` and ``N`` multiples of 128) scales, an output
    dtype it produces, CUDA shapes with ``K`` and ``N`` multiples of 16, and a kernel this torch runs
    on this device equal to the emulation (tried once per combination, then cached)."""
    kind = _scaled_mm_kind(a_q, a_scale_inv, b_q, b_scale_inv)
    if (
        kind is None
        or out_dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or 0 in (*a_q.shape, b_q.size(0))
    ):
        return False
    if a_q.device.type == "cuda" and (a_q.size(1) % 16 or b_q.size(0) % 16):
        return False
    if kind.startswith("block") and (a_q.device.type != "cuda" or a_q.size(1) % TILE or b_q.size(0) % TILE):
        return False
    return _kernel_runs(a_q.device, kind, a_q.dtype, b_q.dtype, out_dtype)


def fp8_matmul(
    a_q: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_q: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool = False,
) -> torch.Tensor:
    """``dequantize(a_q) @ dequantize(b_q).T`` ``[M, N]`` in ``out_dtype``: ``a_q`` ``[M, K]``,
    ``b_q`` ``[N, K]`` (a weight as ``nn.Linear`` holds it), float8; their float32 ``scale_inv`` of
    any granularity (:func:`compute_amax`'s shapes).

    Through ``torch._scaled_mm`` where :func:`has_scaled_mm_kernel`, unless ``emulate``; otherwise
    emulated: dequantised to float32 (float64 for a float64 ``out_dtype``), multiplied (on CUDA
    without TensorFloat-32), cast. On
    the CPU, torch's kernel is this emulation (bitwise equal with a float32 output), except where
    it hands same-dtype tensorwise operands to oneDNN (CPUs with AMX, mkldnn enabled): scales
    applied inside its kernel, equal to float32 rounding, not bitwise. ValueError for shapes that
    do not multiply or non-FP8 operands."""
    _check_fp8(a_q.dtype)
    _check_fp8(b_q.dtype)
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.size(1) != b_q.size(1):
        raise ValueError(f"fp8_matmul needs a [M, K] and b [N, K], got {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    if not emulate and has_scaled_mm_kernel(a_q, a_scale_inv, b_q, b_scale_inv, out_dtype):
        kind = _scaled_mm_kind(a_q, a_scale_inv, b_q, b_scale_inv)
        assert kind is not None
        return _kernel_call(a_q, a_scale_inv, b_q, b_scale_inv, out_dtype, kind)
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    a, b = dequantize(a_q, a_scale_inv, work), dequantize(b_q, b_scale_inv, work)
    if a.device.type != "cuda" or work != torch.float32:
        return (a @ b.t()).to(out_dtype)
    precision = torch.get_float32_matmul_precision()  # no TensorFloat-32 rounding of the operands
    torch.set_float32_matmul_precision("highest")
    try:
        return (a @ b.t()).to(out_dtype)
    finally:
        torch.set_float32_matmul_precision(precision)


class DelayedScaling:
    """Delayed scaling's amax history for the three operands of one layer's GEMMs (:data:`ROLES`),
    Transformer Engine's: a step quantises with scales from past steps' amaxes, so it needs no
    amax before it quantises.

    ``history``: float32 ``[amax_history_len, 3]``, row 0 the most recent step, a column per role;
    ``pending``: float32 ``[3]``, the max of this step's finite amaxes so far (all-reduce it, MAX,
    over the ranks of the module docstring before :meth:`step`). Zeros at first: scale 1. A non-finite
    amax is not recorded: the step it comes from is skipped and must not change later scales."""

    def __init__(self, recipe: FP8Recipe, device: torch.device | str = "cpu") -> None:
        if recipe.recipe != "delayed":
            raise ValueError(f"DelayedScaling needs the delayed FP8 recipe, got {recipe.recipe!r}")
        self.recipe = recipe
        self.history = torch.zeros(recipe.amax_history_len, len(ROLES), dtype=torch.float32, device=device)
        self.pending = torch.zeros(len(ROLES), dtype=torch.float32, device=device)

    def scale(self, role: Role) -> torch.Tensor:
        """This step's float32 scale (0-dim) for ``role``, from the history only."""
        _check_role(role)
        column = self.history[:, ROLES.index(role)]
        past = column.amax() if self.recipe.amax_compute_algo == "max" else column[0]
        return scale_from_amax(past, self.recipe.dtype(role), self.recipe.margin)

    def observe(self, role: Role, amax: torch.Tensor) -> None:
        """Fold a 0-dim ``amax`` of ``role`` seen in this step into :attr:`pending` (ignored if not finite)."""
        _check_role(role)
        i = ROLES.index(role)
        amax = amax.float().reshape(())
        self.pending[i] = torch.where(amax.isfinite(), torch.maximum(self.pending[i], amax), self.pending[i])

    def step(self) -> None:
        """End of a training step: :attr:`pending` becomes the history's row 0 (the oldest row
        drops out) and is reset to zeros."""
        self.history.copy_(torch.cat([self.pending[None], self.history[:-1]]))
        self.pending.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of ``history`` and ``pending``, for a checkpoint (resumes bitwise)."""
        return {"amax_history": self.history.clone(), "pending": self.pending.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a :meth:`state_dict` in; ValueError if its history length or roles differ."""
        history, pending = state["amax_history"], state["pending"]
        if history.shape != self.history.shape or pending.shape != self.pending.shape:
            raise ValueError(
                f"FP8 amax history of shape {tuple(history.shape)} does not fit this recipe's "
                f"{tuple(self.history.shape)} (amax_history_len x roles {', '.join(ROLES)})"
            )
        self.history.copy_(history)
        self.pending.copy_(pending)
