"""Which gradient codec a run uses over the data-parallel group, and from which iteration on
(pure: no torch). The reduction itself is :mod:`ptdp.engine.data_parallel.compression`."""

from __future__ import annotations

from dataclasses import dataclass

CODECS = ("none", "fp16", "bf16", "1bit")
"""fp32 (exact), 16-bit floats, or signs with one scale per 64 elements and error feedback."""


@dataclass(frozen=True)
class CodecChoice:
    """A run's codec and its exact warmup.

    Attributes:
        name: one of :data:`CODECS`.
        warmup_iters: iterations reduced exactly (fp32) before the codec starts; None: the
            learning-rate warmup for ``1bit`` (error feedback starts from gradients the model
            already shaped; Tang et al., "1-bit Adam", arXiv:2102.02888), 0 for fp16/bf16.
    """

    name: str = "none"
    warmup_iters: int | None = None

    def exact_iters(self, lr_warmup_iters: int) -> int:
        """Iterations (0-based steps ``< this``) whose gradients are reduced exactly in fp32."""
        if self.name == "none":
            return 0
        if self.warmup_iters is not None:
            return self.warmup_iters
        return lr_warmup_iters if self.name == "1bit" else 0
