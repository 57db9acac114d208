"""Encoding the corpus in worker processes (``--tokenizer-workers``), in the corpus' order.

Chunks of documents go to ``spawn`` processes; each loads the tokenizer JSON once and runs
:func:`ptdp.data.tokenizer.encode_documents` with ``TOKENIZERS_PARALLELISM=false`` (N workers use
about N cores). Results come back in submission order, so the token files are byte-identical to the
serial path's whatever the worker count. At most ``2 * workers`` chunks are in flight.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np

from ptdp.data.tokenizer import encode_documents, load_tokenizer
from ptdp.errors import DataError

Tag = TypeVar("Tag")
#: Corpora at least this large (bytes on disk) are encoded by several processes when
#: ``--tokenizer-workers`` is not given.
PARALLEL_MIN_BYTES = 64 * 2**20
#: The most worker processes chosen without ``--tokenizer-workers``.
AUTO_MAX_WORKERS = 8


def worker_count(requested: int | None, corpus_bytes: int) -> int:
    """Processes to encode with: ``requested`` (>= 1), or without one ``min(AUTO_MAX_WORKERS,
    cores)`` for a corpus of at least ``PARALLEL_MIN_BYTES``, else 1 (this process alone).

    Raises:
        DataError: ``requested`` is not an int >= 1.
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise DataError(f"--tokenizer-workers must be an integer >= 1, got {requested!r}")
        return requested
    if corpus_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(AUTO_MAX_WORKERS, os.cpu_count() or 1))


def encode_chunks(
    chunks: Iterable[tuple[list[str], Tag]], tokenizer, tokenizer_path: Path, eos_token: str, workers: int
) -> Iterator[tuple[list[np.ndarray], Tag]]:
    """For each ``(texts, tag)`` of ``chunks``, in order: (each text's int64 ids followed by
    ``eos_token``'s id, ``tag``). ``workers == 1``: encoded here with ``tokenizer``; more: by that
    many processes, each with the tokenizer read from ``tokenizer_path``."""
    if workers == 1:
        for texts, tag in chunks:
            yield encode_documents(tokenizer, texts, eos_token), tag
        return
    context = multiprocessing.get_context("spawn")
    pending: collections.deque[tuple[Future, Tag]] = collections.deque()
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(str(tokenizer_path), eos_token)
    ) as pool:
        for texts, tag in chunks:
            pending.append((pool.submit(_encode, texts), tag))
            if len(pending) >= 2 * workers:
                yield _collect(*pending.popleft())
        while pending:
            yield _collect(*pending.popleft())


def _collect(future: Future, tag: Tag) -> tuple[list[np.ndarray], Tag]:
    flat, lengths = future.result()
    return (np.split(flat, np.cumsum(lengths)[:-1]) if lengths.size else []), tag


_WORKER: dict = {}


def _start_worker(tokenizer_path: str, eos_token: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER["tokenizer"] = load_tokenizer(tokenizer_path, eos_token)
    _WORKER["eos_token"] = eos_token


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """In a worker: the documents' ids concatenated, and each one's length (one array pickles
    faster than many)."""
    arrays = encode_documents(_WORKER["tokenizer"], texts, _WORKER["eos_token"])
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    return (np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)), lengths
