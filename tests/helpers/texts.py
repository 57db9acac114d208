"""Deterministic code-like text for tokenizer tests."""

from __future__ import annotations

import random


def make_texts(seed: int = 0, n_docs: int = 60) -> list[str]:
    """Deterministic code-like text, ~60 KB."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnop_") for _ in range(rng.randint(2, 9))) for _ in range(300)]
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(rng.randint(10, 40)):
            indent = "    " * rng.randint(0, 3)
            lines.append(indent + " ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) + ":")
        docs.append("\n".join(lines) + "\n")
    return docs
