"""A prepared corpus on disk (:class:`PreparedData`, read from its ``meta.json``) and the content
key that names its cache folder (:func:`cache_key`).

:func:`ptdp.data.prepare.prepare_data` builds the folder; see :mod:`ptdp.data.prepare` for what the
key covers and how a folder is made complete before it is used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from ptdp.data.indexed import IndexedTokens
from ptdp.data.tokenizer import EOS_TOKEN, TokenizerModel, load_tokenizer
from ptdp.errors import DataError

FORMAT_VERSION = 1
META_FILE = "meta.json"
#: Characters of train text the tokenizer is trained on.
TOKENIZER_SAMPLE_CHARS = 10_000_000


@dataclass(frozen=True)
class PreparedData:
    """A prepared corpus on disk. ``vocab_size``: the tokenizer's size (a trained one's is <= the
    requested one); ``eos_token`` ends every document (``eos_id`` is its id)."""

    cache_dir: Path
    tokenizer_path: Path
    train_prefix: Path
    valid_prefix: Path
    vocab_size: int
    eos_id: int
    num_train_docs: int
    num_valid_docs: int
    num_train_tokens: int
    num_valid_tokens: int
    eos_token: str = EOS_TOKEN

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> PreparedData:
        """Read ``directory/meta.json`` (written by :func:`prepare_data`)."""
        directory = Path(directory)
        meta_path = directory / META_FILE
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise DataError(f"not a prepared data folder (no {META_FILE}): {str(directory)!r}") from None
        except (OSError, ValueError) as err:
            raise DataError(f"cannot read {str(meta_path)!r}: {err}") from err
        if meta.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{str(meta_path)!r} has format_version {meta.get('format_version')!r}, "
                f"expected {FORMAT_VERSION}; delete the folder to re-prepare"
            )
        return cls(
            cache_dir=directory,
            tokenizer_path=directory / meta["tokenizer_file"],
            train_prefix=directory / meta["train_prefix"],
            valid_prefix=directory / meta["valid_prefix"],
            eos_token=meta.get("eos_token", EOS_TOKEN),
            **{k: int(meta[k]) for k in _COUNT_FIELDS},
        )

    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` the token files were made with."""
        return load_tokenizer(self.tokenizer_path, self.eos_token)

    def train_tokens(self) -> IndexedTokens:
        return IndexedTokens(self.train_prefix)

    def valid_tokens(self) -> IndexedTokens:
        return IndexedTokens(self.valid_prefix)


_COUNT_FIELDS = (
    "vocab_size",
    "eos_id",
    "num_train_docs",
    "num_valid_docs",
    "num_train_tokens",
    "num_valid_tokens",
)


def cache_key(
    fingerprint: str,
    vocab_size: int,
    valid_fraction: float,
    tokenizer: TokenizerModel | None = None,
    text_key: str = "text",
) -> str:
    """Hex key naming the cache folder for this corpus and these settings (``tokenizer``: a given
    one, whose content hash replaces the trained tokenizer's settings)."""
    spec: dict = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "valid_fraction": float(valid_fraction),
        "tokenizers_version": tokenizers.__version__,
    }
    if tokenizer is None:
        spec |= {"vocab_size": vocab_size, "tokenizer_sample_chars": TOKENIZER_SAMPLE_CHARS}
    else:
        spec |= {"tokenizer_sha256": tokenizer.sha256, "eos_token": tokenizer.eos_token}
    if text_key != "text":  # keys of earlier versions stay valid for the default
        spec["text_key"] = text_key
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
