"""Document-level train/validation split by a stable hash of the document id.

A document goes to validation when ``stable_unit(doc_id) < valid_fraction``. The hash is SHA-1
(never Python's salted ``hash()``), so every process and machine computes the same split, and a
document keeps its side when other documents are added or removed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ptdp.errors import DataError


def stable_unit(doc_id: str, salt: str = "split") -> float:
    """Map ``doc_id`` to a float in [0, 1) via SHA-1 of ``salt + NUL + doc_id``."""
    digest = hashlib.sha1(f"{salt}\0{doc_id}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def check_valid_fraction(valid_fraction: float) -> None:
    """Raise :class:`DataError` unless 0 < valid_fraction < 1."""
    if not isinstance(valid_fraction, (int, float)) or not 0.0 < valid_fraction < 1.0:
        raise DataError(f"valid_fraction must be in (0, 1), got {valid_fraction!r}")


def assign_splits(doc_ids: Sequence[str], valid_fraction: float) -> list[bool]:
    """``is_valid`` for each document, with at least one train and one validation document.

    If the hash puts no document in validation, the one with the smallest hash moves there; if it
    puts every document there, the one with the largest hash moves to train. Needs >= 2 documents.
    """
    check_valid_fraction(valid_fraction)
    if len(doc_ids) < 2:
        raise DataError(
            f"need at least 2 documents to split into train and validation, got {len(doc_ids)}; "
            f"give a folder of several text files, or a .jsonl file with one document per line"
        )
    units = [stable_unit(d) for d in doc_ids]
    is_valid = [u < valid_fraction for u in units]
    if not any(is_valid):
        is_valid[min(range(len(units)), key=units.__getitem__)] = True
    if all(is_valid):
        is_valid[max(range(len(units)), key=units.__getitem__)] = False
    return is_valid
