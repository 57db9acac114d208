"""Byte-level BPE tokenizer (HF ``tokenizers``): train, save, load, encode documents.

Token ids: ``<|endoftext|>`` is 0, the 256 byte symbols 1..256, merges follow; any string
round-trips exactly. Training gives byte-identical JSON for the same texts and vocab size, whatever
the thread count: with the full byte alphabet as ``initial_alphabet`` every symbol id is fixed
before training and the trainer breaks count ties by id. The tokenizers version is in the data
cache key in case another version trains differently.

A tokenizer trained elsewhere (``--tokenizer-model``, :func:`load_tokenizer_model`) is used as given.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from ptdp.errors import DataError

EOS_TOKEN = "<|endoftext|>"
#: End-of-document tokens of common tokenizers (GPT-2 and ours, Llama 2 / Mistral, Llama 3, Gemma),
#: looked for in this order when ``tokenizer_config.json`` names none.
KNOWN_EOS_TOKENS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
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


def load_tokenizer(path: str | os.PathLike[str], eos_token: str = EOS_TOKEN) -> Tokenizer:
    """Load a tokenizer JSON written by :func:`save_tokenizer`; it must know ``eos_token``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file does not exist: {str(path)!r}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exception on bad JSON
        raise DataError(f"cannot read tokenizer file {str(path)!r}: {err}") from err
    eos_id(tokenizer, eos_token)
    return _whole_documents(tokenizer)


def _whole_documents(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` with the truncation and padding a ``tokenizer.json`` may carry switched off (on
    this object only, not in the file): every document is encoded whole, unpadded."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def eos_id(tokenizer: Tokenizer, eos_token: str = EOS_TOKEN) -> int:
    """The id of ``eos_token``; :class:`DataError` if the tokenizer lacks it."""
    token_id = tokenizer.token_to_id(eos_token)
    if token_id is None:
        raise DataError(f"tokenizer has no {eos_token!r} token")
    return token_id


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str], eos_token: str = EOS_TOKEN) -> list[np.ndarray]:
    """Token ids of each text followed by ``eos_token``'s: a list of int64 arrays of shape [n_i+1].

    Uses the batch encoder (multi-threaded unless ``TOKENIZERS_PARALLELISM=false``), without the
    tokenizer's own special tokens (no BOS). A literal special token inside a text is encoded as
    ordinary text, so only real document ends carry the EOS id.
    """
    eos = eos_id(tokenizer, eos_token)
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


@dataclass(frozen=True)
class TokenizerModel:
    """A tokenizer trained elsewhere, as ``--tokenizer-model`` names it.

    ``path``: the ``tokenizer.json`` read; ``sha256``: hex digest of its bytes (part of the data
    cache key: another file re-tokenizes); ``eos_token``: the token appended to every document;
    ``vocab_size``: largest id + 1 (added tokens included), the model's vocabulary before padding.
    ``added_json``: the tokenizer JSON with ``eos_token`` added (``--eod-token`` absent from the
    file), written instead of the file; None: the file is used as is.
    """

    path: Path
    tokenizer: Tokenizer
    sha256: str
    eos_token: str
    vocab_size: int
    added_json: str | None = None


def load_tokenizer_model(path: str | os.PathLike[str], eod_token: str | None = None) -> TokenizerModel:
    """Read a Hugging Face ``tokenizer.json`` (or the one in folder ``path``) as given, untouched.

    End-of-document token: ``eod_token`` (added as a special token if absent), else a
    ``tokenizer_config.json``'s ``eos_token`` the tokenizer knows, else the first of
    :data:`KNOWN_EOS_TOKENS` it knows. Truncation and padding settings are not applied.

    Raises:
        DataError: naming ``path`` when it does not exist, has no ``tokenizer.json``, is not a
            tokenizers JSON file, or has no end-of-document token.
    """
    given = Path(path).expanduser()
    file = given / "tokenizer.json" if given.is_dir() else given
    if not given.exists():
        raise DataError(
            f"--tokenizer-model {str(given)!r} does not exist (expected a Hugging Face tokenizer.json "
            f"or a folder holding one)"
        )
    if not file.is_file():
        others = sorted(p.name for p in given.iterdir() if p.name in _OTHER_FORMATS) if given.is_dir() else []
        hint = (
            f"; it has {', '.join(others)}: only the tokenizers library's tokenizer.json is read (transformers' "
            f"AutoTokenizer.from_pretrained(folder).save_pretrained(folder) writes one)"
            if others
            else ""
        )
        what = "a folder without a tokenizer.json" if given.is_dir() else "not a regular file"
        raise DataError(f"--tokenizer-model {str(given)!r} is {what}{hint}")
    try:
        data = file.read_bytes()
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"--tokenizer-model {str(file)!r} is not a Hugging Face tokenizer.json: {first}") from None
    added_json = None
    if eod_token is not None and tokenizer.token_to_id(eod_token) is None:
        tokenizer.add_special_tokens([AddedToken(eod_token, special=True, normalized=False)])
        added_json = tokenizer.to_str()
    eos = eod_token if eod_token is not None else _find_eos(tokenizer, file)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return TokenizerModel(
        file, _whole_documents(tokenizer), hashlib.sha256(data).hexdigest(), eos, max(vocab.values()) + 1, added_json
    )


_OTHER_FORMATS = frozenset({"tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model"})


def tokenizer_config_beside(path: str | os.PathLike[str]) -> Path | None:
    """The ``tokenizer_config.json`` beside a tokenizer file (or in a folder holding one), if any:
    it names the end-of-document token and the other special tokens of a downloaded model."""
    given = Path(path).expanduser()
    config = (given if given.is_dir() else given.parent) / "tokenizer_config.json"
    return config if config.is_file() else None


def end_of_document_token(tokenizer: Tokenizer, file: Path) -> str | None:
    """The end-of-document token of the tokenizer read from ``file`` as :func:`load_tokenizer_model`
    picks it (a ``tokenizer_config.json`` beside ``file``, else :data:`KNOWN_EOS_TOKENS`), or None."""
    try:
        return _find_eos(tokenizer, file)
    except DataError:
        return None


def named_special_token(file: Path, key: str) -> object:
    """What the ``tokenizer_config.json`` beside the tokenizer ``file`` names as ``key`` (e.g.
    ``eos_token``; ``{"content": ...}`` in older files gives its content), as read: a token is a
    string, anything else names none; None without such a file or key, or for an unreadable one."""
    config = file.with_name("tokenizer_config.json")
    if not config.is_file():
        return None
    try:
        named = json.loads(config.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return named.get("content") if isinstance(named, dict) else named


def _find_eos(tokenizer: Tokenizer, file: Path) -> str:
    """The end-of-document token (see :func:`load_tokenizer_model`); DataError naming ``file`` if none."""
    named = named_special_token(file, "eos_token")
    for token in ([named] if isinstance(named, str) else []) + list(KNOWN_EOS_TOKENS):
        if tokenizer.token_to_id(token) is not None:
            return token
    raise DataError(
        f"--tokenizer-model {str(file)!r} has no end-of-document token: none of {list(KNOWN_EOS_TOKENS)}"
        + (f" nor tokenizer_config.json's eos_token {named!r}" if named else "")
        + " is in its vocabulary, and every document must end with one: name it with --eod-token TEXT "
        "(added to the vocabulary when absent), or in a tokenizer_config.json beside it as eos_token"
    )
