"""Byte-level BPE tokenizer (HF ``tokenizers``): train, save, load, encode documents.

Token ids: ``<|endoftext|>`` is id 0, the 256 byte symbols are ids 1..256, merges follow. Any
string round-trips exactly (``decode(encode(text)) == text``).

Determinism (checked by ``tests/test_data_tokenizer.py``, also across processes): training gives
byte-identical JSON for the same texts and vocab size, whatever the thread count. Why: with the full
256-symbol byte alphabet given as ``initial_alphabet`` (and no continuing-subword prefix or
end-of-word suffix) every symbol id is fixed before training, and the trainer breaks count ties by
symbol ids, so the hash-map iteration order inside the trainer never shows. Setting
``RAYON_NUM_THREADS=1`` gives the same JSON, only slower (measured with tokenizers 0.23). The
tokenizers version is part of the data cache key in case another version trains differently.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ptdp.data.errors import DataError

EOS_TOKEN = "<|endoftext|>"
#: 1 special token + 256 byte symbols + at least one merge.
MIN_VOCAB_SIZE = 1 + 256 + 1


def check_vocab_size(vocab_size: int) -> None:
    """Raise :class:`DataError` unless ``vocab_size`` is an int >= ``MIN_VOCAB_SIZE``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise DataError(f"vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs 1 special token + 256 "
            f"byte symbols + at least 1 merge = {MIN_VOCAB_SIZE}"
        )


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` tokens on ``texts``.

    The result may have fewer tokens when the texts run out of pairs to merge.
    ``length``: number of texts, only for the trainer's bookkeeping.
    """
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike[str]) -> Path:
    """Write the tokenizer JSON atomically (temp file, then ``os.replace``); return the path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tokenizer.save(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a tokenizer JSON written by :func:`save_tokenizer`; it must know ``<|endoftext|>``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file does not exist: {str(path)!r}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exception on bad JSON
        raise DataError(f"cannot read tokenizer file {str(path)!r}: {err}") from err
    eos_id(tokenizer)
    return tokenizer


def eos_id(tokenizer: Tokenizer) -> int:
    """The id of ``<|endoftext|>``; :class:`DataError` if the tokenizer lacks it."""
    token_id = tokenizer.token_to_id(EOS_TOKEN)
    if token_id is None:
        raise DataError(f"tokenizer has no {EOS_TOKEN!r} token")
    return token_id


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text followed by ``<|endoftext|>``: a list of int64 arrays of shape [n_i+1].

    Uses the batch encoder (multi-threaded). A literal ``<|endoftext|>`` inside a text is encoded
    as ordinary text, so only real document ends carry the EOS id.
    """
    eos = eos_id(tokenizer)
    previous = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        encodings = encode(list(texts), add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = previous
    out = []
    for enc in encodings:
        ids = np.empty(len(enc.ids) + 1, dtype=np.int64)
        ids[:-1] = enc.ids
        ids[-1] = eos
        out.append(ids)
    return out
