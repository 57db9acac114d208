"""Rules of sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, §4.2.2) and context
parallelism (Megatron-Core's load-balanced causal split; Dubey et al. 2024, arXiv:2407.21783,
§3.3.2)."""

from __future__ import annotations

from ptdp.config.model import ModelConfig
from ptdp.errors import V, Violation


def sequence_parallel_violations(m: ModelConfig, tp: int, sequence_parallel: bool) -> list[Violation]:
    """Rules of sequence parallelism (Korthikanti et al. 2022, §4.2.2)."""
    if not sequence_parallel:
        return []
    if tp < 2:
        return [
            V(
                "sequence parallel",
                f"sequence_parallel needs tensor_model_parallel_size > 1, got {tp} (rule: the "
                f"sequence is split over the tp ranks)",
            )
        ]
    if m.seq_length % tp:
        return [
            V(
                "sequence parallel",
                f"seq_length={m.seq_length} is not divisible by tensor_model_parallel_size={tp} "
                f"(rule: s % tp == 0 with sequence_parallel; each tp rank holds s / tp positions)",
            )
        ]
    return []


def context_parallel_violations(seq_length: int, cp: int) -> list[Violation]:
    """Rules of context parallelism (Megatron-Core's load-balanced causal split; Llama 3, Dubey et
    al. 2024, §3.3.2): ``cp >= 1`` and ``seq_length % (2 cp) == 0``, each cp rank holding chunks
    ``i`` and ``2 cp - 1 - i`` of ``seq_length / (2 cp)`` tokens."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        return [
            V("option", f"context_parallel_size={cp!r} must be a positive integer (1: no context parallelism)", cp=cp)
        ]
    if cp > 1 and seq_length % (2 * cp):
        return [
            V(
                "seq % (2 * cp)",
                f"seq_length={seq_length} is not divisible by 2*context_parallel_size = 2*{cp} = "
                f"{2 * cp} (rule: seq_length % (2 * cp) == 0; each cp rank holds two of 2*cp equal chunks for "
                f"causal load balance)",
                seq_length=seq_length,
                cp=cp,
            )
        ]
    return []


def context_parallel_model_violations(m: ModelConfig, cp: int, tp: int, sequence_parallel: bool) -> list[Violation]:
    """What the model needs under context parallelism (cp > 1): with sequence parallelism each cp
    rank's ``s / cp`` positions split evenly over tp, ``seq_length % (cp * tp) == 0``."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp <= 1:
        return []
    out = []
    if sequence_parallel and isinstance(tp, int) and tp > 1 and m.seq_length % (cp * tp):
        out.append(
            V(
                "sequence parallel",
                f"seq_length={m.seq_length} is not divisible by context_parallel_size * "
                f"tensor_model_parallel_size = {cp}*{tp} = {cp * tp} (rule: s % (cp * tp) == 0 with "
                f"sequence_parallel; each tp rank holds s / (cp * tp) positions of its cp rank's s / cp)",
                seq_length=m.seq_length,
                cp=cp,
                tp=tp,
            )
        )
    return out
