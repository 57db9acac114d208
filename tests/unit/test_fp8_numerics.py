"""FP8 numerics (``engine/fp8.py``) against references written here from the definitions: the two
float8 formats decoded bit by bit and rounded to nearest-even by search, each recipe's scales
``fp8_max / (amax * 2**margin)`` in numpy float32 over loops of rows and tiles, saturation and
inf/NaN, the quantise/dequantise error bound, delayed scaling's history as a Python list, layout
invariance (the max of the shards' amaxes), checkpoints, and ``torch._scaled_mm`` against the
emulation (exact with a float32 output: which cases run is in each case's id and skip reason)."""

from __future__ import annotations

import io
import itertools
import math

import numpy as np
import pytest
import torch

from helpers.host_sync import count_host_syncs
from ptdp.engine import fp8
from ptdp.engine.fp8 import DelayedScaling, FP8Recipe

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: (exponent bits, mantissa bits, bias, has infinities) of each format (arXiv:2209.05433, Table 1)
LAYOUT = {E4M3: (4, 3, 7, False), E5M2: (5, 2, 15, True)}
MAX = {E4M3: 448.0, E5M2: 57344.0}
INF, NAN = math.inf, math.nan


def decode(byte: int, dtype: torch.dtype) -> float:
    """The value of one float8 bit pattern, from the format's definition."""
    e_bits, m_bits, bias, has_inf = LAYOUT[dtype]
    sign = -1.0 if byte >> 7 else 1.0
    exp, man = (byte >> m_bits) & ((1 << e_bits) - 1), byte & ((1 << m_bits) - 1)
    top = (1 << e_bits) - 1
    if has_inf and exp == top:
        return sign * INF if man == 0 else NAN
    if not has_inf and exp == top and man == (1 << m_bits) - 1:
        return NAN
    if exp == 0:
        return sign * man / (1 << m_bits) * 2.0 ** (1 - bias)
    return sign * (1 + man / (1 << m_bits)) * 2.0 ** (exp - bias)


#: every finite value of each format with its bit pattern, ascending
FINITE = {
    dtype: sorted((decode(b, dtype), b) for b in range(256) if math.isfinite(decode(b, dtype)) and b != 0x80)
    for dtype in LAYOUT
}


def ref_quantize(values, dtype: torch.dtype) -> np.ndarray:
    """The quantised values of already scaled ``values``, by the module's stated semantics: NaN
    stays NaN; ±inf is NaN in e4m3fn, ±inf in e5m2; finite values saturate to ±max, then round to
    the nearest value of the table, ties to the even bit pattern (by search, not bit tricks)."""
    v = np.asarray(values, dtype=np.float64)
    table = np.array([value for value, _ in FINITE[dtype]])
    even = np.array([byte % 2 == 0 for _, byte in FINITE[dtype]])
    finite = np.where(np.isfinite(v), v, 0.0).clip(-MAX[dtype], MAX[dtype])
    hi = np.searchsorted(table, finite).clip(1, len(table) - 1)
    lo = hi - 1
    d_lo, d_hi = finite - table[lo], table[hi] - finite
    pick = np.where((d_hi < d_lo) | ((d_hi == d_lo) & even[hi]), hi, lo)
    out = table[pick]
    out = np.where(np.isinf(v), v if LAYOUT[dtype][3] else NAN, out)
    return np.where(np.isnan(v), NAN, out)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN, +0 to -0."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0)))


def bits32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def ref_scale(amax: float, dtype: torch.dtype, margin: int = 0) -> np.float32:
    """``fp8_max / (amax * 2**margin)`` in float32; 1 for amax 0 or not finite; clamped to
    float32's normal range."""
    a = np.float32(amax)
    if not np.isfinite(a) or a == 0:
        return np.float32(1)
    with np.errstate(over="ignore", divide="ignore"):
        s = np.float32(MAX[dtype]) / (a * np.float32(2.0**margin))
    info = np.finfo(np.float32)
    return np.float32(min(max(s, info.tiny), info.max))


def ref_group_amax(x: torch.Tensor, rows: int, cols: int) -> np.ndarray:
    """amax of every ``rows x cols`` group of a 2-D ``x`` by loops (last groups partial)."""
    r, k = x.shape
    out = np.zeros((-(-r // rows), -(-k // cols)), dtype=np.float32)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            block = [
                abs(v) for v in x[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].double().flatten().tolist()
            ]
            out[i, j] = np.float32(NAN if any(math.isnan(v) for v in block) else max(block, default=0.0))
    return out


# ---- the recipe -------------------------------------------------------------------------------


def test_recipe_defaults_roles_and_granularities():
    r = FP8Recipe()
    assert (r.format, r.recipe, r.margin, r.amax_history_len, r.amax_compute_algo) == (
        "e4m3",
        "tensorwise",
        0,
        1,
        "most_recent",
    )
    assert [FP8Recipe(format="e4m3").dtype(role) for role in fp8.ROLES] == [E4M3, E4M3, E4M3]
    assert [FP8Recipe(format="hybrid").dtype(role) for role in fp8.ROLES] == [E4M3, E4M3, E5M2]
    expect = {
        "tensorwise": ["tensor"] * 3,
        "delayed": ["tensor"] * 3,
        "rowwise": ["row"] * 3,
        "blockwise": ["1x128", "128x128", "1x128"],
    }
    for recipe, grains in expect.items():
        assert [FP8Recipe(recipe=recipe).granularity(role) for role in fp8.ROLES] == grains
    with pytest.raises(ValueError, match="role 'bias'"):
        r.dtype("bias")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"format": "e5m2"}, ["format", "'e5m2'", "e4m3, hybrid"]),
        ({"recipe": "mxfp8"}, ["recipe", "'mxfp8'", "tensorwise, delayed, rowwise, blockwise"]),
        ({"amax_compute_algo": "mean"}, ["amax_compute_algo", "'mean'", "max, most_recent"]),
        ({"margin": -1}, ["margin", ">= 0", "-1"]),
        ({"margin": 1.5}, ["margin", "1.5"]),
        ({"margin": True}, ["margin", "True"]),
        ({"amax_history_len": 0}, ["amax_history_len", ">= 1", "0"]),
    ],
)
def test_recipe_rejects_bad_values_naming_them(kwargs, words):
    with pytest.raises(ValueError) as err:
        FP8Recipe(**kwargs)
    for word in words:
        assert word in str(err.value)


# ---- the formats and quantisation ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_reference_decoding_matches_torch(dtype):
    """The test's decoder agrees with torch's on all 256 patterns (so the references stand on it)."""
    torch_values = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    assert same(torch_values, torch.tensor([decode(b, dtype) for b in range(256)], dtype=torch.float64))
    assert fp8.fp8_max(dtype) == MAX[dtype] == FINITE[dtype][-1][0]


def probe_values(dtype: torch.dtype) -> list[float]:
    """Every finite value, every midpoint between neighbours (ties), points a quarter of the way,
    values beyond max, subnormal and tiny ones, and the non-finite ones."""
    vals = [v for v, _ in FINITE[dtype]]
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])]
    quarters = [a + (b - a) / 4 for a, b in zip(vals, vals[1:])] + [b - (b - a) / 4 for a, b in zip(vals, vals[1:])]
    near = [m * (1 + d) for m in mids for d in (2.0**-30, -(2.0**-30))]  # a float32 rounds them to the tie
    big = MAX[dtype]
    extremes = [big * 1.03, -big * 1.2, 1e30, -3.0e38, 1e-30, -1e-45, INF, -INF, NAN]
    return vals + mids + quarters + near + extremes


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_quantize_rounds_saturates_and_keeps_nonfinite(dtype, src):
    """Scale 1: each value rounds to nearest (ties to even) once, from its own precision (a
    float64 just off a tie is not rounded to the tie first), saturates at ±max, NaN stays NaN,
    ±inf -> NaN (e4m3fn) / ±inf (e5m2): never torch's ±448 for an infinity."""
    x = torch.tensor(probe_values(dtype), dtype=src)
    got = fp8.quantize(x, torch.tensor(1.0), dtype)
    assert got.dtype == dtype
    assert same(got.double(), torch.from_numpy(ref_quantize(x.double().numpy(), dtype)))
    inf_q = fp8.quantize(torch.tensor([INF, -INF]), torch.tensor(1.0), dtype).double()
    assert inf_q.isnan().all() if dtype == E4M3 else inf_q.tolist() == [INF, -INF], inf_q


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_saturates_after_scaling(dtype):
    """A finite value whose product with the scale passes max, or overflows float32, saturates."""
    x = torch.tensor([1.0, -1.0, 3.0e38, -3.0e38, 0.5], dtype=torch.float32)
    got = fp8.quantize(x, torch.tensor(MAX[dtype] * 2), dtype).double().tolist()
    assert got == [MAX[dtype], -MAX[dtype], MAX[dtype], -MAX[dtype], MAX[dtype]]


def test_quantize_of_bfloat16_input():
    x = torch.tensor([0.1, -3.0, 500.0, INF], dtype=torch.bfloat16)
    got = fp8.quantize(x, torch.tensor(2.0), E4M3).double()
    want = ref_quantize(x.double().numpy() * 2.0, E4M3)
    assert np.isnan(want[3]) and same(got, torch.from_numpy(want))


# ---- scales -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_tensorwise_scale_and_margin(dtype, margin):
    gen = torch.Generator().manual_seed(margin)
    for amax in [1.0, 0.37, 448.0, 3.1e-5, 7.5e4, 1e-38, 1e-44, 3.0e38, 0.0, INF, NAN]:
        x = torch.randn(7, 5, generator=gen)
        x = x / x.abs().max() * amax if math.isfinite(amax) and amax > 0 else torch.full((7, 5), amax)
        got = fp8.compute_amax(x, "tensor")
        assert got.dtype == torch.float32 and got.shape == ()
        ref_amax = np.float32(NAN if math.isnan(amax) else x.abs().max().item())
        assert same(got, torch.tensor(ref_amax))
        scale = fp8.scale_from_amax(got, dtype, margin)
        assert scale.dtype == torch.float32
        assert bits32(scale).item() == np.float32(ref_scale(ref_amax, dtype, margin)).view(np.int32), (amax, scale)
        assert math.isfinite(scale.reciprocal().item()) and scale.reciprocal().item() > 0


def test_margin_halves_the_scale_each_step():
    amax = torch.tensor(3.0)
    scales = [fp8.scale_from_amax(amax, E4M3, m).item() for m in range(5)]
    assert scales == [ref_scale(3.0, E4M3, m) for m in range(5)]
    assert all(a == 2 * b for a, b in zip(scales, scales[1:]))


def test_scale_edges_zero_nonfinite_and_clamps():
    amax = torch.tensor([0.0, INF, NAN, 1e-45, 3.4e38, -0.0])
    info = torch.finfo(torch.float32)
    got = fp8.scale_from_amax(amax, E4M3).tolist()
    assert got[0] == got[1] == got[2] == got[5] == 1.0
    assert got[3] == info.max  # 448 / 1e-45 overflows float32: clamped
    assert got[4] == np.float32(448) / np.float32(3.4e38)


def test_empty_tensor_amax_is_zero():
    cases = [
        ((0,), "tensor", ()),
        ((0, 5), "row", (0, 1)),
        ((3, 0), "row", (3, 1)),
        ((3, 0), "1x128", (3, 0)),
        ((0, 300), "1x128", (0, 3)),
        ((130, 0), "128x128", (2, 0)),
    ]
    for shape, grain, want in cases:
        got = fp8.compute_amax(torch.empty(shape), grain)
        assert got.shape == want and not got.any()


def test_rowwise_scales_per_row():
    """``row``: one amax per row of the operand [R, K] (over K), a zero row and a NaN row kept."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 37, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0.0
    x[6, 5] = NAN
    x[7, 2] = -INF
    got = fp8.compute_amax(x, "row")
    assert got.shape == (9, 1)
    assert same(got, torch.from_numpy(ref_group_amax(x, 1, 37)))
    scales = fp8.scale_from_amax(got, E4M3, 1)
    want = [ref_scale(a, E4M3, 1) for a in ref_group_amax(x, 1, 37)[:, 0]]
    assert bits32(scales[:, 0]).tolist() == [np.float32(s).view(np.int32) for s in want]
    q = fp8.quantize(x, scales, E4M3).double()
    ref = ref_quantize(x.numpy() * np.array(want, dtype=np.float32)[:, None], E4M3)
    assert same(q, torch.from_numpy(ref))


BLOCK_SHAPES = [(1, 1), (5, 130), (129, 257), (256, 128), (300, 200), (128, 384)]


@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=[f"{r}x{k}" for r, k in BLOCK_SHAPES])
@pytest.mark.parametrize("grain", ["1x128", "128x128"])
def test_blockwise_tiles_with_partial_edges(shape, grain):
    """``1x128``: [R, ceil(K/128)]; ``128x128``: [ceil(R/128), ceil(K/128)]; a partial last tile's
    amax is over its elements; every element is quantised with its own tile's scale."""
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    r, k = shape
    x = torch.randn(r, k, generator=gen) * torch.rand(r, k, generator=gen).pow(8) * 1000
    rows = 1 if grain == "1x128" else 128
    got = fp8.compute_amax(x, grain)
    assert got.shape == (-(-r // rows), -(-k // 128))
    ref = ref_group_amax(x, rows, 128)
    assert same(got, torch.from_numpy(ref))
    scales = fp8.scale_from_amax(got, E4M3)
    ref_scales = np.vectorize(lambda a: ref_scale(a, E4M3))(ref).astype(np.float32)
    assert torch.equal(bits32(scales), torch.from_numpy(ref_scales.view(np.int32)))
    per_element = ref_scales[np.arange(r)[:, None] // rows, np.arange(k)[None, :] // 128]
    want = ref_quantize(x.numpy() * per_element, E4M3)  # float32 products, as the module's
    q = fp8.quantize(x, scales, E4M3)
    assert same(q.double(), torch.from_numpy(want))
    inv = scales.reciprocal().numpy()[np.arange(r)[:, None] // rows, np.arange(k)[None, :] // 128]
    deq = fp8.dequantize(q, scales.reciprocal(), torch.float64)
    assert torch.equal(deq, torch.from_numpy(want * inv.astype(np.float64)))


def test_scale_shape_mismatch_and_bad_arguments():
    x = torch.randn(4, 300)
    with pytest.raises(ValueError, match=r"dim 1 needs 300, 1 or ceil\(300/128\) = 3"):
        fp8.quantize(x, torch.ones(4, 2), E4M3)
    with pytest.raises(ValueError, match="do not fit"):
        fp8.dequantize(x.to(E4M3), torch.ones(4))
    with pytest.raises(ValueError, match="granularity 'column'"):
        fp8.compute_amax(x, "column")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"2-D operand \[R, K\], got shape \(2, 2, 300\)"):
        fp8.compute_amax(x.view(2, 2, 300), "row")
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        fp8.quantize(x, torch.tensor(1.0), torch.bfloat16)
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        fp8.dequantize(x, torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("grain", ["tensor", "row", "1x128", "128x128"])
def test_roundtrip_error_bound(dtype, grain):
    """quantise -> dequantise of values in the format's normal range: relative error at most
    half an ulp, 2^-4 (e4m3) / 2^-3 (e5m2), plus float32's roundings of x*scale, 1/scale and
    the product (within the issue's 2^-3 / 2^-2)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(200, 300, generator=gen) * torch.logspace(-1.5, 1.5, 300)
    q, inv = fp8.quantize_current(x, dtype, grain)
    back = fp8.dequantize(q, inv)
    expand = fp8._expand(inv, x.shape)
    normal = (x.abs() / expand >= torch.finfo(dtype).smallest_normal) & (x != 0)
    assert normal.float().mean() > 0.9
    rel = ((back - x).abs() / x.abs())[normal]
    half_ulp = 2.0**-4 if dtype == E4M3 else 2.0**-3
    assert rel.max().item() <= half_ulp + 2.0**-20
    assert rel.max().item() <= 2 * half_ulp  # the bound
    assert (
        rel.max().item() > half_ulp * 0.85
    )  # nearly reached (sup: half_ulp / (1 + half_ulp)): a coarser rounding shows


# ---- layout invariance --------------------------------------------------------------------------


def test_tensorwise_amax_of_shards_gives_the_whole_tensors_scale():
    """Shards in any split: the MAX of the shards' amaxes (what an all-reduce gives) is the whole
    tensor's amax, and each shard quantised with it is that part of the whole's quantisation."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=gen) * 5
    q_whole, inv_whole = fp8.quantize_current(x, E4M3, "tensor", margin=1)
    for dim, sizes in [(0, [16, 48]), (1, [32, 32, 32]), (1, [7, 89])]:
        shards = x.split(sizes, dim=dim)
        reduced = torch.stack([fp8.compute_amax(s, "tensor") for s in shards]).amax()
        parts = [fp8.quantize_current(s, E4M3, "tensor", margin=1, amax=reduced) for s in shards]
        assert all(bits32(inv).item() == bits32(inv_whole).item() for _, inv in parts)
        assert torch.equal(torch.cat([q for q, _ in parts], dim).view(torch.uint8), q_whole.view(torch.uint8))
    local = fp8.quantize_current(x[:, :32], E4M3, "tensor")[1]
    assert local.item() != inv_whole.item()  # the reduction matters here


def test_rowwise_amax_over_k_shards_and_gemm_sum():
    """Rowwise with K split (a row-parallel layer): the elementwise MAX of the shards' row amaxes
    is the whole rows'; the float64 emulated GEMMs of the shards add up to the whole GEMM. A split
    of the rows needs no reduction."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(24, 256, generator=gen) * torch.logspace(-1, 1, 256)
    w = torch.randn(40, 256, generator=gen)
    xq, x_inv = fp8.quantize_current(x, E4M3, "row")
    wq, w_inv = fp8.quantize_current(w, E4M3, "row")
    whole = fp8.fp8_matmul(xq, x_inv, wq, w_inv, torch.float64, emulate=True)
    out = torch.zeros_like(whole)
    x_amax = torch.stack([fp8.compute_amax(s, "row") for s in x.split(64, 1)]).amax(0)
    w_amax = torch.stack([fp8.compute_amax(s, "row") for s in w.split(64, 1)]).amax(0)
    assert torch.equal(x_amax, fp8.compute_amax(x, "row")) and torch.equal(w_amax, fp8.compute_amax(w, "row"))
    for xs, ws in zip(x.split(64, 1), w.split(64, 1)):
        a, a_inv = fp8.quantize_current(xs, E4M3, "row", amax=x_amax)
        b, b_inv = fp8.quantize_current(ws, E4M3, "row", amax=w_amax)
        assert torch.equal(a_inv, x_inv) and torch.equal(b_inv, w_inv)
        out += fp8.fp8_matmul(a, a_inv, b, b_inv, torch.float64, emulate=True)
    assert torch.allclose(out, whole, rtol=0, atol=1e-12 * whole.abs().max().item())
    rows = [fp8.quantize_current(s, E4M3, "row")[0] for s in x.split([5, 19])]
    assert torch.equal(torch.cat(rows).view(torch.uint8), xq.view(torch.uint8))
    local = fp8.compute_amax(x[:, :64], "row")
    assert not torch.equal(local, x_amax)  # the reduction matters here


def test_blockwise_shards_on_tile_boundaries_need_no_reduction():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(256, 384, generator=gen).pow(3)
    for grain in ("1x128", "128x128"):
        whole = fp8.compute_amax(x, grain)
        assert torch.equal(torch.cat([fp8.compute_amax(s, grain) for s in x.split(128, 1)], 1), whole)
        assert torch.equal(torch.cat([fp8.compute_amax(s, grain) for s in x.split(128, 0)], 0), whole)


# ---- the GEMM -----------------------------------------------------------------------------------

PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)]
GEMM_SHAPES = [(16, 64, 32), (33, 1000, 17), (64, 4096, 48)]
OUTS = [torch.float32, torch.bfloat16, torch.float16]


def operands(m, k, n, a_dtype, b_dtype, grain, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    b = torch.randn(n, k, generator=gen) * 3
    b_grain = "128x128" if grain == "1x128" else grain
    return (*fp8.quantize_current(a, a_dtype, grain), *fp8.quantize_current(b, b_dtype, b_grain))


def ref_gemm(aq, a_inv, bq, b_inv, work):
    a = aq.to(work) * fp8._expand(a_inv, aq.shape).to(work)
    b = bq.to(work) * fp8._expand(b_inv, bq.shape).to(work)
    return a @ b.t()


@pytest.mark.parametrize("grain", ["tensor", "row", "1x128"])
@pytest.mark.parametrize("pair", PAIRS, ids=["e4m3-e4m3", "e4m3-e5m2", "e5m2-e4m3", "e5m2-e5m2"])
def test_emulation_is_dequantise_then_matmul(grain, pair):
    """The emulation: exact float64 dequantisation (q * scale_inv) and a float64 GEMM for a float64
    output; float32 dequantisation and GEMM cast to a 16-bit output."""
    aq, a_inv, bq, b_inv = operands(40, 300, 24, *pair, grain)
    got = fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.float64, emulate=True)
    assert torch.equal(got, ref_gemm(aq, a_inv, bq, b_inv, torch.float64))
    got16 = fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.bfloat16, emulate=True)
    assert torch.equal(got16, ref_gemm(aq, a_inv, bq, b_inv, torch.float32).bfloat16())


def scaled_mm_cases():
    for grain, pair, out, shape in itertools.product(["tensor", "row"], PAIRS, OUTS, GEMM_SHAPES):
        name = f"{grain}-{str(pair[0])[12:]}x{str(pair[1])[12:]}-{str(out)[6:]}-{'x'.join(map(str, shape))}"
        yield pytest.param(grain, pair, out, shape, id=name)


@pytest.mark.parametrize(("grain", "pair", "out", "shape"), list(scaled_mm_cases()))
def test_scaled_mm_equals_emulation_bitwise(grain, pair, out, shape):
    """torch's CPU kernel with oneDNN off is the emulation itself: bitwise equal for every output
    dtype. Skipped (reason printed) where this torch has no CPU kernel for the case."""
    aq, a_inv, bq, b_inv = operands(*shape, *pair, grain)
    with torch.backends.mkldnn.flags(enabled=False):
        if not fp8.has_scaled_mm_kernel(aq, a_inv, bq, b_inv, out):
            pytest.skip(f"torch {torch.__version__} has no CPU _scaled_mm for {grain} {pair} -> {out}")
        kernel = fp8.fp8_matmul(aq, a_inv, bq, b_inv, out)
    assert torch.equal(kernel, fp8.fp8_matmul(aq, a_inv, bq, b_inv, out, emulate=True))


@pytest.mark.parametrize("pair", PAIRS, ids=["e4m3-e4m3", "e4m3-e5m2", "e5m2-e4m3", "e5m2-e5m2"])
@pytest.mark.parametrize("grain", ["tensor", "row"])
def test_scaled_mm_with_onednn(grain, pair):
    """With oneDNN on (torch's default), tensorwise operands of one dtype on a CPU with AMX (of
    two dtypes: with AMX-FP16) run in oneDNN's FP8 matmul, which applies the scales inside its own
    kernel: equal to float32 rounding (relative to sum |a||b|), not bitwise. Every other case is
    bitwise the emulation."""
    m, k, n = 33, 1000, 17
    aq, a_inv, bq, b_inv = operands(m, k, n, *pair, grain, seed=1)
    if not fp8.has_scaled_mm_kernel(aq, a_inv, bq, b_inv, torch.float32):
        pytest.skip(f"torch {torch.__version__} has no CPU _scaled_mm for {grain} {pair}")
    kernel = fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.float32)
    emulated = fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.float32, emulate=True)
    amx = torch.cpu._is_amx_tile_supported() if pair[0] == pair[1] else torch.cpu._is_amx_fp16_supported()
    onednn = grain == "tensor" and amx
    if not onednn:
        assert torch.equal(kernel, emulated)
        return
    magnitude = ref_gemm(aq.abs(), a_inv, bq.abs(), b_inv, torch.float64)
    assert ((kernel.double() - emulated.double()).abs() <= 2.0**-20 * magnitude).all()  # seen: < 4 * 2^-24


def test_matmul_path_choice(monkeypatch):
    """``emulate`` never calls ``_scaled_mm``; tensorwise/rowwise on the CPU do; blockwise scales,
    a float64 output or mixed granularities are emulated."""
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real(*args, **kwargs)

    aq, a_inv, bq, b_inv = operands(16, 64, 32, E4M3, E5M2, "tensor")  # a CPU kernel since torch 2.6
    ar, ar_inv, br, br_inv = operands(16, 64, 32, E4M3, E4M3, "row")
    # the once-per-combination kernel probes run first, so only the GEMMs themselves are counted
    fp8.has_scaled_mm_kernel(aq, a_inv, bq, b_inv, torch.bfloat16)
    fp8.has_scaled_mm_kernel(ar, ar_inv, br, br_inv, torch.float32)
    monkeypatch.setattr(torch, "_scaled_mm", counting)
    fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.float32, emulate=True)
    assert calls == []
    fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.bfloat16)
    assert calls == [torch.bfloat16]
    calls.clear()
    fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.float64)
    assert not fp8.has_scaled_mm_kernel(aq, a_inv, bq, b_inv, torch.float64)
    fp8.fp8_matmul(ar, ar_inv, bq, b_inv, torch.float32)  # rowwise x tensorwise
    fp8.fp8_matmul(*operands(16, 300, 32, E4M3, E4M3, "1x128"), torch.float32)
    assert calls == []
    fp8.fp8_matmul(ar, ar_inv, br, br_inv, torch.float32)
    assert calls == ([torch.float32] if fp8.has_scaled_mm_kernel(ar, ar_inv, br, br_inv, torch.float32) else [])


def test_nonfinite_operand_gives_nonfinite_gemm():
    """An inf in an operand (NaN in e4m3) reaches the output: the step's check sees it."""
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(16, 64, generator=gen), torch.randn(32, 64, generator=gen)
    a[3, 7] = INF
    for grain in ("tensor", "row"):
        for emulate in (True, False):
            aq, a_inv = fp8.quantize_current(a, E4M3, grain)
            bq, b_inv = fp8.quantize_current(b, E4M3, grain)
            out = fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.float32, emulate=emulate)
            assert not out[3].isfinite().any() and out[[0, 1, 2, 4]].isfinite().all()


def test_matmul_rejects_bad_operands():
    q = torch.ones(4, 8).to(E4M3)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[N, K\], got \(4, 8\) and \(8, 4\)"):
        fp8.fp8_matmul(q, one, q.t(), one, torch.float32)
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        fp8.fp8_matmul(q.float(), one, q, one, torch.float32)


# ---- delayed scaling ----------------------------------------------------------------------------


def ref_delayed(recipe: FP8Recipe, steps: list[dict[str, list[float]]]) -> list[dict[str, float]]:
    """Each step's scales by the rule on the host: history (newest first, ``len`` long, zeros at
    first), reduced by max or most recent; a step's finite amaxes (max over its observations)
    enter after the step."""
    history = {role: [0.0] * recipe.amax_history_len for role in fp8.ROLES}
    out = []
    for seen in steps:
        scales = {}
        for role in fp8.ROLES:
            past = max(history[role]) if recipe.amax_compute_algo == "max" else history[role][0]
            scales[role] = float(ref_scale(past, recipe.dtype(role), recipe.margin))
        out.append(scales)
        for role in fp8.ROLES:
            finite = [float(np.float32(a)) for a in seen.get(role, []) if math.isfinite(a)]
            history[role] = [max(finite, default=0.0)] + history[role][:-1]
    return out


def random_steps(n: int, seed: int) -> list[dict[str, list[float]]]:
    rng = np.random.default_rng(seed)
    steps = []
    for i in range(n):
        step = {role: [float(v) for v in rng.lognormal(0, 3, size=rng.integers(1, 4))] for role in fp8.ROLES}
        if i % 5 == 3:
            step["input"].append(INF)
            step["weight"].append(NAN)
        steps.append(step)
    return steps


def run_delayed(state: DelayedScaling, steps) -> list[dict[str, float]]:
    out = []
    for seen in steps:
        out.append({role: state.scale(role).item() for role in fp8.ROLES})
        for role, amaxes in seen.items():
            for a in amaxes:
                state.observe(role, torch.tensor(a))
        state.step()
    return out


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 3, 16])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_delayed_history(algo, length, fmt):
    recipe = FP8Recipe(format=fmt, recipe="delayed", amax_history_len=length, amax_compute_algo=algo, margin=1)
    steps = random_steps(30, seed=length)
    got = run_delayed(DelayedScaling(recipe), steps)
    assert got == ref_delayed(recipe, steps)
    assert got[0] == {role: 1.0 for role in fp8.ROLES}


def test_delayed_rolls_oldest_out():
    recipe = FP8Recipe(recipe="delayed", amax_history_len=3, amax_compute_algo="max")
    state = DelayedScaling(recipe)
    for a in [8.0, 4.0, 2.0, 1.0]:
        state.observe("input", torch.tensor(a))
        state.step()
    assert state.history[:, 0].tolist() == [1.0, 2.0, 4.0]
    assert state.scale("input").item() == np.float32(448) / np.float32(4)
    assert not state.pending.any()


def test_delayed_rejects_other_recipes_and_roles():
    with pytest.raises(ValueError, match="delayed FP8 recipe, got 'tensorwise'"):
        DelayedScaling(FP8Recipe())
    state = DelayedScaling(FP8Recipe(recipe="delayed"))
    with pytest.raises(ValueError, match="role 'output'"):
        state.observe("output", torch.tensor(1.0))  # type: ignore[arg-type]


def test_delayed_state_dict_resumes_bitwise():
    recipe = FP8Recipe(format="hybrid", recipe="delayed", amax_history_len=4, amax_compute_algo="max")
    steps = random_steps(12, seed=9)
    straight = DelayedScaling(recipe)
    expected = run_delayed(straight, steps)
    first = DelayedScaling(recipe)
    run_delayed(first, steps[:7])
    first.observe("weight", torch.tensor(123.0))  # mid-step: pending travels too
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    resumed = DelayedScaling(recipe)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert torch.equal(bits32(resumed.history), bits32(first.history))
    assert torch.equal(bits32(resumed.pending), bits32(first.pending))
    resumed.pending.zero_()
    assert run_delayed(resumed, steps[7:]) == expected[7:]
    assert torch.equal(bits32(resumed.history), bits32(straight.history))
    with pytest.raises(ValueError, match=r"shape \(4, 3\) does not fit this recipe's \(2, 3\)"):
        DelayedScaling(FP8Recipe(recipe="delayed", amax_history_len=2)).load_state_dict(first.state_dict())


def test_no_host_reads():
    """Scales, quantisation, the emulated GEMM and delayed scaling read nothing to the host."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 256, generator=gen), torch.randn(16, 256, generator=gen)
    state = DelayedScaling(FP8Recipe(recipe="delayed", amax_history_len=4, amax_compute_algo="max"))
    with count_host_syncs() as count:
        for grain in ("tensor", "row", "1x128"):
            xq, x_inv = fp8.quantize_current(x, E4M3, grain)
            wq, w_inv = fp8.quantize_current(w, E4M3, "128x128" if grain == "1x128" else grain)
            fp8.fp8_matmul(xq, x_inv, wq, w_inv, torch.float32, emulate=True)
            fp8.dequantize(xq, x_inv)
        state.observe("input", fp8.compute_amax(x, "tensor"))
        fp8.quantize(x, state.scale("input"), E4M3)
        state.step()
    assert count.count == 0, count.calls


# ---- on a GPU (skipped without CUDA; not yet run: no GPU lent so far) --------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
def test_cuda_quantize_equals_cpu(dtype, src):
    """Quantisation is the same bits on CUDA as on the CPU (saturation and inf/NaN are explicit,
    not the device's cast), and so are the amaxes and scales."""
    x = torch.tensor(probe_values(dtype), dtype=src)
    scale = fp8.scale_from_amax(torch.tensor(3.0), dtype, 1)
    cpu = fp8.quantize(x, scale, dtype).view(torch.uint8)
    cuda = fp8.quantize(x.cuda(), scale.cuda(), dtype).view(torch.uint8).cpu()
    assert torch.equal(cuda, cpu)
    y = torch.randn(300, 200, dtype=torch.float32).to(src)
    for grain in ("tensor", "row", "1x128", "128x128"):
        amax = fp8.compute_amax(y, grain)
        assert torch.equal(fp8.compute_amax(y.cuda(), grain).cpu(), amax)
        assert torch.equal(
            bits32(fp8.scale_from_amax(amax.cuda(), dtype).cpu()), bits32(fp8.scale_from_amax(amax, dtype))
        )


@pytest.mark.gpu
@pytest.mark.parametrize("grain", ["tensor", "row", "1x128"])
@pytest.mark.parametrize("pair", PAIRS, ids=["e4m3-e4m3", "e4m3-e5m2", "e5m2-e4m3", "e5m2-e5m2"])
def test_cuda_fp8_matmul_against_emulation(grain, pair):
    """On CUDA, ``_scaled_mm`` (where it runs: printed) equals the float32 emulation to float32
    rounding of sum |a||b| (its own accumulation order); the rest is the emulation itself."""
    aq, a_inv, bq, b_inv = (t.cuda() for t in operands(64, 256, 128, *pair, grain))
    kernel = fp8.has_scaled_mm_kernel(aq, a_inv, bq, b_inv, torch.float32)
    print(f"CUDA _scaled_mm {grain} {pair}: {'kernel' if kernel else 'emulated'}")
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        got = fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.float32)
        emulated = fp8.fp8_matmul(aq, a_inv, bq, b_inv, torch.float32, emulate=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    magnitude = ref_gemm(aq.abs(), a_inv, bq.abs(), b_inv, torch.float64)
    assert ((got.double() - emulated.double()).abs() <= 2.0**-20 * magnitude).all()
    if not kernel:
        assert torch.equal(got, emulated)


def _fake_scaled_mm(shuffle: bool):
    """A stand-in ``torch._scaled_mm`` reading the scales as cuBLAS does (blockwise: 1x128 scales
    ``[M, K/128]``, the weight's ``[K/128, N/128]`` or ``[K/128, N]`` with ``b`` ``[K, N]``), or with
    ``shuffle`` the row scales reversed (a kernel reading another layout)."""

    def expand(scale, rows, cols):
        scale = scale.float()
        if scale.numel() == 1:
            return scale.reshape(()).expand(rows, cols)
        if scale.size(0) not in (rows, 1):
            scale = scale.repeat_interleave(fp8.TILE, dim=0)[:rows]
        if scale.size(1) not in (cols, 1):
            scale = scale.repeat_interleave(fp8.TILE, dim=1)[:, :cols]
        return scale.expand(rows, cols)

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        (m, k), n = a.shape, b.shape[1]
        sa = expand(scale_a, m, k)
        if shuffle:
            sa = sa.flip(0)
        return ((a.float() * sa) @ (b.float() * expand(scale_b, k, n))).to(out_dtype)

    return scaled_mm


@pytest.mark.parametrize("kind", ["block", "block_1x128", "row", "tensor"])
def test_a_kernel_is_used_only_where_it_equals_the_emulation(monkeypatch, kind):
    """The once-per-combination trial of ``torch._scaled_mm`` compares it with the emulation on
    random operands and scales: a kernel reading the scales otherwise is never used."""
    for shuffle, want in ((False, True), (True, kind == "tensor")):  # a tensor scale has no layout
        fp8._kernel_runs.cache_clear()
        monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(shuffle))
        assert fp8._kernel_runs(torch.device("cpu"), kind, E4M3, E4M3, torch.float32) is want, shuffle
    fp8._kernel_runs.cache_clear()


def test_blockwise_kinds_by_scale_shapes():
    """1x128 by 128x128 (forward, input gradient) and 1x128 by 1x128 (weight gradient) scales; no
    blockwise kernel off CUDA."""
    aq, a_inv, wq, w_inv = operands(16, 256, 256, E4M3, E4M3, "1x128")  # the weight 128x128
    assert fp8._scaled_mm_kind(aq, a_inv, wq, w_inv) == "block"
    bq, b_inv = fp8.quantize_current(torch.randn(256, 256), E4M3, "1x128")
    assert fp8._scaled_mm_kind(aq, a_inv, bq, b_inv) == "block_1x128"
    assert not fp8.has_scaled_mm_kernel(aq, a_inv, wq, w_inv, torch.float32)  # CUDA only
