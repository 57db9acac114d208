"""FP8 training of the transformer layers' GEMMs (a section of the configuration schema,
:mod:`ptdp.config.fields`), with Megatron-Core's flag names. Without ``fp8_format`` no GEMM runs in
FP8 and the others must keep their defaults (:mod:`ptdp.config.rules.fp8`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ptdp.config.fields import opt

FP8Format = Literal["e4m3", "hybrid"]
FP8RecipeName = Literal["tensorwise", "delayed", "rowwise", "blockwise"]
AmaxComputeAlgo = Literal["max", "most_recent"]


@dataclass(frozen=True)
class FP8Config:
    """Which formats and scales the QKV, attention-projection, fc1 and fc2 GEMMs use in FP8
    (forward, input gradient and weight gradient); the embedding, output layer, norms, attention,
    router, main weights, gradients and optimizer state keep their dtypes."""

    fp8_format: FP8Format | None = opt(
        None,
        "--fp8-format",
        "run the layers' linear GEMMs in FP8: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 "
        "output gradients); default: none",
        "fp8",
        plan=True,
        plan_searched=False,
        shortcuts=(("--fp8", "hybrid", "same as --fp8-format hybrid (Transformer Engine's default format)"),),
    )
    """FP8 formats (Micikevicius et al., arXiv:2209.05433): ``e4m3`` for every operand, or
    ``hybrid`` (e4m3 inputs and weights, e5m2 output gradients); None: no FP8."""
    fp8_recipe: FP8RecipeName = opt(
        "delayed",
        "--fp8-recipe",
        "the scales: tensorwise (each tensor's current amax), delayed (past steps' amaxes), rowwise "
        "(one per row), blockwise (DeepSeek-V3's 1x128 activation and 128x128 weight tiles)",
        "fp8",
        plan=True,
        plan_searched=False,
    )
    """Granularity of the scales and whether they come from this tensor (current scaling) or
    the amax history (``delayed``, Megatron-Core's default)."""
    fp8_margin: int = opt(
        0,
        "--fp8-margin",
        "scales divided by 2**margin (headroom below the format's max)",
        "fp8",
        metavar="N",
        plan=True,
    )
    """Scales are ``fp8_max / (amax * 2**margin)``; >= 0."""
    fp8_amax_history_len: int = opt(
        1,
        "--fp8-amax-history-len",
        "with --fp8-recipe delayed: past steps whose amaxes a scale is computed from",
        "fp8",
        metavar="N",
        plan=True,
    )
    """Steps of amax history kept per GEMM operand under ``delayed``; >= 1."""
    fp8_amax_compute_algo: AmaxComputeAlgo = opt(
        "most_recent",
        "--fp8-amax-compute-algo",
        "with --fp8-recipe delayed: a scale from the history's max or its most recent amax",
        "fp8",
        plan=True,
    )
    """How a delayed scale reads the history: its ``max`` or the ``most_recent`` step."""
    fp8_emulate: bool = opt(
        False,
        "--fp8-emulate",
        "emulate the FP8 GEMMs (quantise, dequantise, multiply in float32/float64) even where "
        "torch._scaled_mm has a kernel (always on CPUs)",
        "fp8",
    )
    """Run every FP8 GEMM as its exact emulation (:func:`ptdp.engine.fp8.fp8_matmul`); the CPU
    always does."""

    @property
    def enabled(self) -> bool:
        """Whether the layers' GEMMs run in FP8."""
        return self.fp8_format is not None
