"""FP8 training as Transformer Engine runs it on H100/H200 (``ptdp plan --fp8``; planner only).

Precision ``"fp8"`` is bf16 mixed-precision training whose weight GEMMs run in FP8 (Micikevicius et
al., "FP8 Formats for Deep Learning", arXiv:2209.05433; Transformer Engine with Megatron-Core,
delayed scaling, E4M3 forward / E5M2 backward). The QKV, projection, fc1 and fc2 GEMMs run at the
FP8 peak and keep 1-byte inputs for backward; everything else stays bf16 (MFU against the bf16 peak).
Each of those weights also has an FP8 copy and its transpose, kept for the whole step
(:data:`FP8_WEIGHT_COPY_BYTES`). Communication is unchanged.
"""

from __future__ import annotations

from ptdp.config.model import ModelConfig
from ptdp.errors import ConfigError

#: Bytes per weight of an FP8 GEMM held besides the bf16 weight: the FP8 weight (1) and its
#: transpose (1).
FP8_WEIGHT_COPY_BYTES = 2.0


def fp8_precision(gpu, precision: str) -> str:
    """``"fp8"`` for ``--fp8`` on ``gpu`` (a :class:`~ptdp.planner.inputs.hardware.GPUType`) at the
    requested ``precision``; ConfigError when the GPU has no FP8 peak in the catalog (A100, V100)
    or the precision is not bf16 (FP8 training keeps bf16 activations and weights)."""
    if "fp8" not in gpu.peak_flops:
        raise ConfigError(
            f"--fp8: {gpu.name} has no FP8 tensor cores (its catalog peaks: "
            f"{', '.join(sorted(gpu.peak_flops))}); FP8 training needs an H100/H200-class GPU"
        )
    if precision != "bf16":
        raise ConfigError(
            f"--fp8 plans bf16 training with FP8 GEMMs; the requested precision is {precision} "
            f"(drop --fp16/--fp32 or give --bf16)"
        )
    return "fp8"


def layer_fp8_weights(model: ModelConfig, tp: int) -> int:
    """Weights of one layer's four FP8 GEMMs on one tp rank: QKV ``(a + 2 kv) d h / t``, projection
    ``a d h / t``, fc1 ``n ffn h / t`` (n = 2 for SwiGLU), fc2 ``ffn h / t``."""
    h, a = model.hidden_size, model.num_attention_heads
    d, kv = h // a, model.kv_heads
    up = 2 if model.swiglu else 1
    return ((a + 2 * kv) * d * h + a * d * h + (up + 1) * model.ffn * h) // tp


def fp8_weight_copy_bytes(model: ModelConfig, tp: int, layers: int, precision: str) -> float:
    """Bytes of the FP8 weight copies on one tp rank of a stage of ``layers`` layers (0 unless
    ``precision`` is "fp8")."""
    if precision != "fp8":
        return 0.0
    return FP8_WEIGHT_COPY_BYTES * layers * layer_fp8_weights(model, tp)
