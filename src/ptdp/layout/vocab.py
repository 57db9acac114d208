"""How the vocabulary is padded for tensor parallelism, and when the loss keeps its logits (pure
arithmetic, no torch: the planner and the model share these rules).

Megatron-LM pads the embedding to a multiple of ``make_vocab_size_divisible_by * tp`` so that each
tp rank holds an equal slice of rows whose count is a multiple of ``make_vocab_size_divisible_by``
(GEMM-friendly shapes); the padded rows are zero and never looked up or predicted.
"""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of ``divisible_by * tp`` (Megatron's padding rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


SAVED_LOGITS_BYTES = 2**28
"""The most bytes of logits the output layer + loss keeps for backward (256 MiB per microbatch)."""


def keeps_logits(tokens: int, local_vocab: int, value_bytes: int) -> bool:
    """Whether the chunked output layer + cross entropy keeps a microbatch's logits for backward:
    when ``tokens x local_vocab`` values of ``value_bytes`` bytes (the compute dtype: 2 for bf16,
    4 for float32) fit in :data:`SAVED_LOGITS_BYTES`. Kept, backward costs two GEMMs (input and
    weight gradients) as in a plain output layer; otherwise it recomputes the logits chunk by chunk
    (a third GEMM) and keeps only one float32 log-sum-exp per token. Example: GPT-2's
    ``V_pad = 50,304`` at tp = 1 in bf16 keeps up to 2,668 tokens (one 2,048-token sequence)."""
    return tokens * local_vocab * value_bytes <= SAVED_LOGITS_BYTES
