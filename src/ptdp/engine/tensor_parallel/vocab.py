"""How the vocabulary is padded for tensor parallelism (pure arithmetic, no torch).

Megatron-LM pads the embedding to a multiple of ``make_vocab_size_divisible_by * tp`` so that each
tp rank holds an equal slice of rows whose count is a multiple of ``make_vocab_size_divisible_by``
(GEMM-friendly shapes); the padded rows are zero and never looked up or predicted.
"""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of ``divisible_by * tp`` (Megatron's padding rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
