"""Compute model: FLOPs and memory traffic of a transformer layer, and their achieved speed.

Sources: [N21] Narayanan et al., SC21, arXiv:2104.04473 (eq. 3); [K22] Korthikanti et al.,
arXiv:2205.05198 (§5-6); [D23] Dao, "FlashAttention-2", arXiv:2307.08691; Williams et al.,
"Roofline", CACM 2009. Per GPU (t = tp) and per microbatch of ``T = b s`` tokens unless "per step".

Forward GEMMs of one layer, as (M, N, K, batch), FLOPs ``2 M N K batch``: QKV ``(T, (a + 2 kv) d / t, h)``;
scores ``(s, s, d)`` and context ``(s, d, s)`` x ``b a / t``; projection ``(T, h, a d / t)``; fc1
``(T, n ffn / t, h)`` (n = 2 for SwiGLU); fc2 ``(T, h, ffn / t)``; GPT: ``24 T h^2 / t + 4 b s^2 h / t``
([N21] §5.1). Backward = 2 x forward. A GEMM takes ``max(FLOP time, byte time)`` (roofline);
elementwise kernels take bytes / achieved HBM bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.planner.inputs.moe_model import MoEModel, moe_layer_share

#: Bytes moved in the forward pass per element of the h-wide residual stream, per layer, by
#: the memory-bound kernels of a Megatron-style layer (16-bit values, 1-byte dropout masks):
#: two LayerNorms (read 2 + write 2 each = 8) and two fused bias-dropout-residual adds (read the
#: branch output 2 and the residual 2, write 2 and a mask 1 = 7 each = 14). Llama-style (RMSNorm,
#: no dropout): 8 + 2 * 6 = 20.
HIDDEN_BYTES_GPT = 22.0
HIDDEN_BYTES_LLAMA = 20.0
#: Bytes per element of the ffn/t-wide MLP activation: fused bias + GELU reads 2, writes 2;
#: SwiGLU reads the 2 halves (4) and writes 2.
FFN_BYTES_GELU = 4.0
FFN_BYTES_SWIGLU = 6.0
#: Bytes per query and key element (``(a + kv) d / t`` per token) of the query/key norms of
#: ``--qk-layernorm``: read 2, write 2.
QK_NORM_BYTES = 4.0
#: Bytes per attention-score element (b a s^2 / t of them) in the forward: fused scale + mask +
#: softmax reads 2 and writes 2; dropout reads 2, writes 2 and a 1-byte mask. Without dropout 4.
SCORE_BYTES_DROPOUT = 9.0
SCORE_BYTES_NO_DROPOUT = 4.0
#: Bytes per logit element (T V / t of them) of the fp32 vocab-parallel cross entropy, forward and
#: backward together: cast to fp32 (2 + 4), max (4), subtract and exp (8 + 8), sum (4),
#: normalise (8), gradient (8 + 8), cast back (4 + 2), about 64.
LOGIT_BYTES = 64.0
#: Share of the s x s score and context FLOPs a causal flash kernel executes: it skips the key
#: blocks wholly above the diagonal ([D23] §3.1.1), half of them for s much larger than a block.
FLASH_CAUSAL_FRACTION = 0.5
#: Backward FLOPs of a flash kernel over its forward: it recomputes the scores and runs five GEMMs
#: (S, dP, dV, dQ, dK) for the forward's two ([D23] §4.1: "2.5 times that of the forward").
FLASH_BACKWARD_RATIO = 2.5
#: Indices of the weight GEMMs in :func:`layer_gemms` (QKV, projection, fc1, fc2): those that run
#: in FP8 under Transformer Engine; the score and context GEMMs (1, 2) stay 16-bit.
LINEAR_GEMMS = (0, 3, 4, 5)
#: Bytes per element of an FP8 cast of an activation: read 2 (bf16), write 1 (FP8) and 1 (its
#: FP8 transpose), Transformer Engine's fused cast-transpose.
FP8_CAST_BYTES = 4.0
#: Bytes per element of the dequantisation of an FP8 operand in an emulated GEMM
#: (:func:`ptdp.engine.fp8.fp8_matmul`): the cast to float32 reads 1 and writes 4, the product
#: with the scales reads 4 and writes 4.
FP8_DEQUANTIZE_BYTES = 13.0
#: Bytes per element of ``ptdp train``'s quantisation (:func:`ptdp.engine.fp8.quantize`, eager
#: kernels) beyond reading its input and casting it to float32: the product with the scales
#: (read 4, write 4), the clamp (read 4, write 4), the infinity mask (write 1) and the NaN fill
#: (write 4), the select (read 9, write 4), the cast to FP8 (read 4, write 1).
FP8_QUANTIZE_BYTES = 39.0
#: Bytes per element a blockwise scale tile expansion adds (``repeat_interleave`` to the
#: operand's shape: write 4, read 4 by the product) to a quantisation or dequantisation.
FP8_TILE_SCALE_BYTES = 8.0
#: Dimensions ``torch._scaled_mm`` needs ``K`` and ``N`` to be multiples of (CUDA); other FP8
#: GEMMs are emulated.
FP8_KERNEL_MULTIPLE = 16
#: Backward memory traffic of an elementwise kernel relative to its forward: it reads the saved
#: input(s) and the output gradient and writes the input gradient, about twice the forward's
#: one read and one write.
BACKWARD_TRAFFIC_RATIO = 2.0


def layer_gemms(model: ModelConfig, tp: int, micro_batch_size: int) -> tuple[tuple[int, int, int, int], ...]:
    """Forward GEMMs of one layer on one tp rank for one microbatch: ``(M, N, K, batch)``.

    Order: QKV, scores, context, projection, fc1, fc2 (see the module docstring).
    """
    b, s, h, a = micro_batch_size, model.seq_length, model.hidden_size, model.num_attention_heads
    d, kv, t = model.head_dim, model.kv_heads, tp
    tokens, heads = b * s, b * a // t
    up = (2 if model.swiglu else 1) * model.ffn // t
    return (
        (tokens, (a + 2 * kv) * d // t, h, 1),
        (s, s, d, heads),
        (s, d, s, heads),
        (tokens, h, a * d // t, 1),
        (tokens, up, h, 1),
        (tokens, h, model.ffn // t, 1),
    )


def module_recompute_time(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    sequence_parallel: bool,
    modules: tuple[str, ...],
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
) -> float:
    """Seconds ``--recompute-modules`` ``layernorm`` and ``mlp`` add to one layer's backward on one
    tp rank, one microbatch: the two norms (read the input, write the output: ``2 x 2 e h`` bytes
    per token, /t with sequence parallelism) and the MLP's forward (fc1, fc2 and the activation's
    ``FFN_BYTES`` per element). ``core_attn`` is :func:`layer_compute_times`' third item."""
    tokens, h, t = micro_batch_size * model.seq_length, model.hidden_size, tp
    out = 0.0
    if "layernorm" in modules:
        out += 2 * 4.0 * tokens * h / (t if sequence_parallel else 1) / bandwidth
    if "mlp" in modules:
        gemms = _gemms_time(model, tp, micro_batch_size, MLP_SHARES, peak_flops, bandwidth, peak_fraction, half_dim)
        ffn = FFN_BYTES_SWIGLU if model.swiglu else FFN_BYTES_GELU
        out += gemms + ffn * tokens * model.ffn / t / bandwidth
    return out


#: Share of each of :func:`layer_gemms` that recomputing the MLP (``--recompute-modules mlp``) runs again
MLP_SHARES = (0.0, 0.0, 0.0, 0.0, 1.0, 1.0)


def _gemms_flops(model: ModelConfig, shares: tuple[float, ...]) -> float:
    """FLOPs of ``shares`` (one per :func:`layer_gemms` GEMM) of one layer's forward, one token row."""
    return sum(share * gemm_flops(*g) for share, g in zip(shares, layer_gemms(model, 1, 1)))


def _gemms_time(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    shares: tuple[float, ...],
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
) -> float:
    """Seconds of ``shares`` (one per :func:`layer_gemms` GEMM) of one layer's forward GEMMs."""
    timed = partial(
        gemm_time, peak_flops=peak_flops, bandwidth=bandwidth, peak_fraction=peak_fraction, half_dim=half_dim
    )
    return sum(share * timed(*g) for share, g in zip(shares, layer_gemms(model, tp, micro_batch_size)) if share)


def op_sac_shares(model: ModelConfig) -> tuple[float, ...]:
    """Share of each of :func:`layer_gemms` that torchtitan's per-op checkpointing runs again in
    backward (the even-numbered matmuls of Q, K, V, O, fc1 [, fc3], fc2: K, the projection, and
    SwiGLU's up half of fc1 or, without it, fc2); the attention core (SDPA) is kept."""
    kv, a = model.kv_heads, model.num_attention_heads
    return (kv / (a + 2 * kv), 0.0, 0.0, 1.0, 0.5 if model.swiglu else 0.0, 0.0 if model.swiglu else 1.0)


def op_sac_recompute_time(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    sequence_parallel: bool,
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
) -> float:
    """Seconds one layer's per-op checkpointing (``--selective-ac-option op``) adds to a
    microbatch's backward on one tp rank: the recomputed matmuls (:func:`op_sac_shares`) and every
    memory-bound kernel of the forward (norms, rotary, activation)."""
    shares = op_sac_shares(model)
    matmuls = _gemms_time(model, tp, micro_batch_size, shares, peak_flops, bandwidth, peak_fraction, half_dim)
    elementwise, scores = layer_elementwise_bytes(model, tp, micro_batch_size, sequence_parallel=sequence_parallel)
    return matmuls + (elementwise - scores) / bandwidth


def gemm_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    """FLOPs of ``batch`` products of an ``[m, k]`` and a ``[k, n]`` matrix: ``2 m n k batch``."""
    return 2.0 * m * n * k * batch


def layer_forward_flops(model: ModelConfig, tp: int, micro_batch_size: int) -> float:
    """Forward FLOPs of one layer, one tp rank, one microbatch; GPT: ``(24 T h^2 + 4 b s^2 h) / t``."""
    return sum(gemm_flops(*g) for g in layer_gemms(model, tp, micro_batch_size))


def attention_core_flops(model: ModelConfig, tp: int, micro_batch_size: int) -> float:
    """Forward FLOPs of the score and context GEMMs: ``4 b s^2 a d / t`` (full s x s, as computed
    without a causal-skipping kernel, and as the papers count model FLOPs); what selective
    recompute repeats [K22] §5 with the unfused kernel."""
    g = layer_gemms(model, tp, micro_batch_size)
    return gemm_flops(*g[1]) + gemm_flops(*g[2])


def logits_forward_flops(model: ModelConfig, tp: int, micro_batch_size: int, padded_vocab: int | None = None) -> float:
    """Forward FLOPs of the output layer on one tp rank: ``2 T h V / t``."""
    vocab = padded_vocab if padded_vocab is not None else model.vocab_size
    return gemm_flops(micro_batch_size * model.seq_length, vocab // tp, model.hidden_size)


@lru_cache(maxsize=65536)
def model_flops_per_step(model: ModelConfig, global_batch_size: int, moe: MoEConfig | None = None) -> float:
    """Model FLOPs of one step (no recompute), all GPUs: 3 x forward over ``B s`` tokens.

    For GPT this is exactly [K22] §6: ``72 B s l h^2 (1 + s/(6h) + V/(12 h l))``; for other
    shapes the same count from :func:`layer_gemms` at tp = 1 (V unpadded, as in the papers). With
    ``moe`` an MoE layer's MLP counts what a token runs (:func:`moe_mlp_forward_flops`). A planned
    model (:class:`~ptdp.planner.inputs.moe_model.MoEModel`) counts its multi-head latent attention
    (full ``s x s`` scores) and its multi-token-prediction modules (each an MoE layer, the ``[h, 2h]``
    projection and the output layer once more, beside their layers).
    """
    per_sequence = model.num_layers * layer_forward_flops(model, 1, 1) + logits_forward_flops(model, 1, 1)
    dense_mlp = sum(gemm_flops(*g) for g in layer_gemms(model, 1, 1)[4:])
    moe_change = 0.0
    if moe is not None and moe.enabled:
        moe_change = moe_mlp_forward_flops(model, moe, 1) - dense_mlp
        per_sequence += sum(moe.moe_layers(model.num_layers)) * moe_change
    if isinstance(model, MoEModel):
        attention = 0.0
        if model.mla is not None:
            dense_attention = sum(gemm_flops(*g) for g in layer_gemms(model, 1, 1)[:4])
            mla = model.mla.forward_gemms(model.hidden_size, model.num_attention_heads, model.seq_length, 1, 1)
            attention = sum(gemm_flops(*g) for g in mla) - dense_attention
            per_sequence += model.num_layers * attention
        if model.mtp_layers:  # their layers are counted above
            s, h = model.seq_length, model.hidden_size
            per_sequence += model.mtp_layers * (gemm_flops(s, h, 2 * h) + logits_forward_flops(model, 1, 1))
    return 3.0 * global_batch_size * per_sequence


def moe_mlp_forward_flops(model: ModelConfig, moe: MoEConfig, micro_batch_size: int) -> float:
    """Forward FLOPs of an MoE layer's MLP over one microbatch's ``T = b s`` tokens, the activated
    weights only: the router ``2 T h E``, each token's ``k`` routed experts and the shared expert,
    each ``2 T (n + 1) h F`` (n = 2 for SwiGLU; F its width). Megatron-Core's count leaves the
    router out."""
    tokens, h = micro_batch_size * model.seq_length, model.hidden_size
    mats = 3 if model.swiglu else 2
    experts = moe.moe_router_topk * moe.expert_ffn(model.ffn) + moe.shared_ffn
    return 2.0 * tokens * h * ((moe.num_experts or 0) + mats * experts)


@lru_cache(maxsize=65536)
def hardware_flops_per_step(
    model: ModelConfig, global_batch_size: int, recompute: str, modules: tuple[str, ...] = ()
) -> float:
    """FLOPs executed in one step, all GPUs, counting the recompute forward.

    Full recompute: ``4 x`` layer forward + ``3 x`` logits, i.e. [N21] eq. 3 for GPT:
    ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``. Selective: model FLOPs + the attention core once
    more (nothing with a flash kernel, which is not recomputed), and with ``modules`` holding mlp
    the MLP's GEMMs (``modules``: Megatron-Core's ``--recompute-modules``). "op": the matmuls per-op
    checkpointing runs again (:func:`op_sac_shares`). None: model FLOPs.
    """
    extra = 0.0
    if recompute == "full":
        extra = layer_forward_flops(model, 1, 1)
    elif recompute == "selective":
        kept = modules or ("core_attn",)
        dense = 1.0 - moe_layer_share(model)
        extra = dense * _gemms_flops(model, MLP_SHARES) if "mlp" in kept else 0.0
        extra += attention_core_flops(model, 1, 1) if "core_attn" in kept and not model.flash_attention else 0.0
    elif recompute == "op":
        extra = _gemms_flops(model, op_sac_shares(model))
    moe = model.moe if isinstance(model, MoEModel) and model.moe.enabled else None
    total = model_flops_per_step(model, global_batch_size, moe)
    if isinstance(model, MoEModel) and recompute == "full":  # each layer's forward, its sub-layers' included
        logits = logits_forward_flops(model, 1, 1) * (1 + model.mtp_layers)
        return total + global_batch_size * (total / (3.0 * global_batch_size) - logits)
    if moe is not None and recompute == "selective" and "moe" in modules:
        extra += sum(moe.moe_layers(model.num_layers)) / model.num_layers * moe_mlp_forward_flops(model, moe, 1)
    return total + global_batch_size * model.num_layers * extra


def gemm_efficiency(m: int, n: int, k: int, *, peak_fraction: float, half_dim: float) -> float:
    """Achieved fraction of peak of a compute-bound ``[m, k] x [k, n]`` GEMM (dimensionless).

    ``peak_fraction * prod(x / (x + half_dim) for x in (m, n, k))``: a dimension of ``half_dim`` runs at
    half speed (idle tensor-core tile / wave). Symmetric in (m, n, k), so backward GEMMs run at the
    forward's efficiency.
    """
    return peak_fraction * (m / (m + half_dim)) * (n / (n + half_dim)) * (k / (k + half_dim))


def gemm_time(
    m: int,
    n: int,
    k: int,
    batch: int,
    *,
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
    bytes_per_element: float = 2.0,
) -> float:
    """Seconds of ``batch`` GEMMs: roofline ``max(FLOPs / (peak * efficiency), bytes / bandwidth)``.

    bytes: read both operands and write the result once, ``(m k + k n + m n) batch`` elements.
    ``bandwidth`` is the achieved HBM bandwidth (bytes/s).
    """
    eff = gemm_efficiency(m, n, k, peak_fraction=peak_fraction, half_dim=half_dim)
    compute = gemm_flops(m, n, k, batch) / (peak_flops * eff)
    memory = (m * k + k * n + m * n) * batch * bytes_per_element / bandwidth
    return compute if compute > memory else memory


def layer_elementwise_bytes(
    model: ModelConfig, tp: int, micro_batch_size: int, *, sequence_parallel: bool
) -> tuple[float, float]:
    """Forward bytes of the memory-bound kernels of one layer: ``(total, attention-score part)``.

    ``T h * HIDDEN_BYTES`` (/t with sequence parallelism, [K22] §4.2.2) + ``T ffn / t * FFN_BYTES`` +
    ``b a s^2 / t * SCORE_BYTES`` (+ ``T (a + kv) d / t * QK_NORM_BYTES`` with ``qk_layernorm``); the
    score part (0 with a flash kernel) is what selective recompute repeats.
    """
    b, s, h, t = micro_batch_size, model.seq_length, model.hidden_size, tp
    tokens = b * s
    hidden = HIDDEN_BYTES_LLAMA if model.llama_style else HIDDEN_BYTES_GPT
    ffn = FFN_BYTES_SWIGLU if model.swiglu else FFN_BYTES_GELU
    score = SCORE_BYTES_NO_DROPOUT if model.llama_style else SCORE_BYTES_DROPOUT
    scores = 0.0 if model.flash_attention else score * b * model.num_attention_heads / t * s * s
    total = hidden * tokens * h / (t if sequence_parallel else 1) + ffn * tokens * model.ffn / t + scores
    if model.qk_layernorm:
        total += QK_NORM_BYTES * tokens * (model.num_attention_heads + model.kv_heads) * model.head_dim / t
    return total, scores


@dataclass(frozen=True)
class FP8Gemms:
    """How a layer's four weight GEMMs (:data:`LINEAR_GEMMS`) run in FP8
    (:func:`ptdp.planner.time.stages.fp8_gemms` builds it for a candidate and a GPU).

    Attributes:
        recipe: ``ptdp train``'s ``--fp8-recipe``; None: Transformer Engine's delayed scaling as
            Megatron-Core runs it (the published runs).
        native_peak: FLOP/s of the GPU's FP8 tensor cores (``torch._scaled_mm``); 0: every GEMM
            emulated (no FP8 peak, a CPU, or blockwise, planned emulated).
        efficiency: share of the GEMM efficiency an FP8 kernel reaches (below 1 for rowwise).
        emulated_peak: FLOP/s of the float32 GEMM an emulated one runs (TF32 where the GPU has it).
        value_bytes: bytes of the activation values the operands are cast from (4: float32 parameters).
    """

    recipe: str | None
    native_peak: float
    efficiency: float = 1.0
    emulated_peak: float = 0.0
    value_bytes: float = 2.0


def fp8_gemm_time(
    m: int, n: int, k: int, batch: int, fp8: FP8Gemms, *, bandwidth: float, peak_fraction: float, half_dim: float
) -> float:
    """Seconds of a forward ``[m, k] x [k, n]`` GEMM of FP8 operands (its backward: twice).

    On the FP8 tensor cores (``fp8.native_peak``, ``k`` and ``n`` multiples of
    :data:`FP8_KERNEL_MULTIPLE`): :func:`gemm_time` with 1-byte operands at ``fp8.efficiency`` x
    ``peak_fraction``. Else emulated as ``ptdp train`` does: both operands dequantised
    (:data:`FP8_DEQUANTIZE_BYTES` per element), a float32 GEMM at ``fp8.emulated_peak``, the result
    cast to the activations' dtype (read 4, write ``value_bytes`` per element).
    """
    if fp8.native_peak and not (k % FP8_KERNEL_MULTIPLE or n % FP8_KERNEL_MULTIPLE):
        return gemm_time(
            m,
            n,
            k,
            batch,
            peak_flops=fp8.native_peak,
            bandwidth=bandwidth,
            peak_fraction=peak_fraction * fp8.efficiency,
            half_dim=half_dim,
            bytes_per_element=1.0,
        )
    gemm = gemm_time(
        m,
        n,
        k,
        batch,
        peak_flops=fp8.emulated_peak,
        bandwidth=bandwidth,
        peak_fraction=peak_fraction,
        half_dim=half_dim,
        bytes_per_element=4.0,
    )
    dequantize = FP8_DEQUANTIZE_BYTES + (FP8_TILE_SCALE_BYTES if fp8.recipe == "blockwise" else 0.0)
    passes = dequantize * (m * k + n * k) + (4.0 + fp8.value_bytes if fp8.value_bytes != 4.0 else 0.0) * m * n
    return gemm + passes * batch / bandwidth


def fp8_quantize_bytes(recipe: str, value_bytes: float) -> float:
    """Bytes per element of one quantisation of an activation operand in ``ptdp train`` under
    ``recipe``, its amax included: the amax (``|x|`` written and read: ``3 e``; per row or tile the
    padded copy too: ``5 e``; delayed scaling computes it to record its history), the cast to
    float32 (``e + 4``, none for float32 values), the infinity mask's read (``e``),
    :data:`FP8_QUANTIZE_BYTES`, and blockwise :data:`FP8_TILE_SCALE_BYTES` (``e = value_bytes``)."""
    e = value_bytes
    amax = (5.0 if recipe in ("rowwise", "blockwise") else 3.0) * e
    cast = 0.0 if e == 4.0 else e + 4.0
    tiles = FP8_TILE_SCALE_BYTES if recipe == "blockwise" else 0.0
    return amax + cast + e + FP8_QUANTIZE_BYTES + tiles


def fp8_cast_bytes(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    recipe: str | None = None,
    *,
    sequence_parallel: bool = False,
    value_bytes: float = 2.0,
) -> tuple[float, float]:
    """(forward, backward) bytes of one layer's FP8 casts of activations on one tp rank for one
    microbatch. Weights are cast once per step (not counted).

    ``recipe`` None (Transformer Engine, which fuses the other casts into the norms and activations):
    :data:`FP8_CAST_BYTES` per element of the attention output (``a d / t`` per token) forward, and
    backward of the output gradients of fc2 and the projection (h each) and of QKV (``(a + 2 kv) d / t``).

    A ``ptdp train`` recipe quantises every operand on its own (:func:`fp8_quantize_bytes` per
    element, ``q``): forward the projection and fc2 inputs (``(a d + ffn) / t`` per token) and the
    QKV and fc1 inputs (h each, all T tokens: gathered first with sequence parallelism); backward
    the four output gradients (``2 h + ((a + 2 kv) d + n ffn) / t``). Tensorwise and delayed
    quantise an operand once and copy its FP8 transpose for wgrad (read 1, write 1): ``q + 2``;
    rowwise and blockwise quantise it and its transpose apart: ``2 q``. With sequence parallelism
    QKV and fc1 quantise their input once forward and once again in backward, after gathering it
    again (its transpose: ``q``, tensorwise ``q + 2``).
    """
    h, a = model.hidden_size, model.num_attention_heads
    d, kv, t, tokens = model.head_dim, model.kv_heads, tp, micro_batch_size * model.seq_length
    if recipe is None:
        forward = tokens * a * d / t
        backward = tokens * (2 * h + (a + 2 * kv) * d / t)
        return FP8_CAST_BYTES * forward, FP8_CAST_BYTES * backward
    up = 2 if model.swiglu else 1
    column = tokens * 2 * h  # QKV and fc1 inputs
    row = tokens * (a * d + model.ffn) / t  # projection and fc2 inputs
    grads = tokens * (2 * h + ((a + 2 * kv) * d + up * model.ffn) / t)
    q = fp8_quantize_bytes(recipe, value_bytes)
    copy = 2.0 if recipe in ("tensorwise", "delayed") else 0.0
    per_operand = q + copy if copy else 2 * q
    forward = row * per_operand + column * (q if sequence_parallel else per_operand)
    backward = grads * per_operand + (column * (q + copy) if sequence_parallel else 0.0)
    return forward, backward


def flash_attention_time(
    model: ModelConfig, tp: int, micro_batch_size: int, *, peak_flops: float, peak_fraction: float, half_dim: float
) -> float:
    """Forward seconds of a causal flash attention kernel on one tp rank, one microbatch:
    ``FLASH_CAUSAL_FRACTION`` of the score and context FLOPs at the efficiency of an ``(s, s, d)``
    GEMM (compute-bound, no s x s bytes); its backward is ``FLASH_BACKWARD_RATIO`` x this."""
    s, d = model.seq_length, model.head_dim
    eff = gemm_efficiency(s, s, d, peak_fraction=peak_fraction, half_dim=half_dim)
    return FLASH_CAUSAL_FRACTION * attention_core_flops(model, tp, micro_batch_size) / (peak_flops * eff)


@lru_cache(maxsize=65536)
def layer_compute_times(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    sequence_parallel: bool,
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
    fp8: FP8Gemms | None = None,
) -> tuple[float, float, float]:
    """Seconds of one layer on one tp rank for one microbatch, communication excluded:
    ``(forward, backward, attention-core forward)``.

    forward = Σ roofline GEMM times + elementwise bytes / bandwidth; backward = 2 x GEMM times +
    ``BACKWARD_TRAFFIC_RATIO`` x elementwise; the third item is what selective recompute adds (0 with
    ``model.flash_attention``, whose fused kernel is :func:`flash_attention_time`). With ``fp8`` the
    weight GEMMs run in FP8 (:func:`fp8_gemm_time`), plus :func:`fp8_cast_bytes`.
    """
    timed = partial(
        gemm_time, peak_flops=peak_flops, bandwidth=bandwidth, peak_fraction=peak_fraction, half_dim=half_dim
    )
    shapes = layer_gemms(model, tp, micro_batch_size)
    gemms = [timed(*g) for g in shapes]
    elementwise, scores = layer_elementwise_bytes(model, tp, micro_batch_size, sequence_parallel=sequence_parallel)
    cast_forward = cast_backward = 0.0
    if fp8 is not None:
        for i in LINEAR_GEMMS:
            gemms[i] = fp8_gemm_time(
                *shapes[i], fp8, bandwidth=bandwidth, peak_fraction=peak_fraction, half_dim=half_dim
            )
        cast_forward, cast_backward = fp8_cast_bytes(
            model,
            tp,
            micro_batch_size,
            fp8.recipe,
            sequence_parallel=sequence_parallel,
            value_bytes=fp8.value_bytes,
        )
    linear = sum(gemms[i] for i in LINEAR_GEMMS)
    if model.flash_attention:
        attention = flash_attention_time(
            model, tp, micro_batch_size, peak_flops=peak_flops, peak_fraction=peak_fraction, half_dim=half_dim
        )
        forward = linear + attention + (elementwise + cast_forward) / bandwidth
        backward = (
            2.0 * linear
            + FLASH_BACKWARD_RATIO * attention
            + (BACKWARD_TRAFFIC_RATIO * elementwise + cast_backward) / bandwidth
        )
        return forward, backward, 0.0
    forward = sum(gemms) + (elementwise + cast_forward) / bandwidth
    backward = 2.0 * sum(gemms) + (BACKWARD_TRAFFIC_RATIO * elementwise + cast_backward) / bandwidth
    core = gemms[1] + gemms[2] + scores / bandwidth
    return forward, backward, core


@lru_cache(maxsize=65536)
def layer_wgrad_time(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
    fp8: FP8Gemms | None = None,
) -> float:
    """Seconds of one layer's weight-gradient GEMMs ``dW = dyᵀ x`` on one tp rank for one
    microbatch: those of QKV, the projection, fc1 and fc2 (:data:`LINEAR_GEMMS`), each as long as
    its forward GEMM (the same ``M N K``, :func:`gemm_time` or :func:`fp8_gemm_time`), the part of
    :func:`layer_compute_times`' backward a zero-bubble schedule's W runs. A planned MoE model: the
    MLP's only in its dense layers (the experts' are
    :attr:`ptdp.planner.time.moe_time.SublayerTimes.wgrad`), the dense
    attention's shapes standing for multi-head latent attention's projections."""
    shapes = layer_gemms(model, tp, micro_batch_size)

    def timed(m: int, n: int, k: int, batch: int) -> float:
        if fp8 is not None:
            return fp8_gemm_time(
                m, n, k, batch, fp8, bandwidth=bandwidth, peak_fraction=peak_fraction, half_dim=half_dim
            )
        return gemm_time(
            m, n, k, batch, peak_flops=peak_flops, bandwidth=bandwidth, peak_fraction=peak_fraction, half_dim=half_dim
        )

    attention = timed(*shapes[0]) + timed(*shapes[3])
    mlp = timed(*shapes[4]) + timed(*shapes[5])
    return attention + (1.0 - moe_layer_share(model)) * mlp


@lru_cache(maxsize=65536)
def logits_compute_time(
    model: ModelConfig,
    tp: int,
    micro_batch_size: int,
    padded_vocab: int,
    peak_flops: float,
    bandwidth: float,
    peak_fraction: float,
    half_dim: float,
) -> float:
    """Seconds of the output layer and cross entropy, forward + backward, one tp rank, one
    microbatch: 3 roofline GEMMs of ``(T, V/t, h)`` + ``T V / t * LOGIT_BYTES`` / bandwidth."""
    tokens = micro_batch_size * model.seq_length
    gemm = gemm_time(
        tokens,
        padded_vocab // tp,
        model.hidden_size,
        1,
        peak_flops=peak_flops,
        bandwidth=bandwidth,
        peak_fraction=peak_fraction,
        half_dim=half_dim,
    )
    return 3.0 * gemm + LOGIT_BYTES * tokens * padded_vocab / tp / bandwidth
