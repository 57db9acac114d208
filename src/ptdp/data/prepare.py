"""Corpus -> tokenizer + train/valid token files, cached on disk by a content key.

``prepare_data`` runs two streaming passes over the corpus, so only a bounded tokenizer-training
sample is ever held in memory:

1. scan: list documents, drop exact duplicates (so no text lands in both splits), split train /
   validation by a hash of the document id (:mod:`ptdp.data.split`), keep a deterministic sample
   of about ``TOKENIZER_SAMPLE_CHARS`` characters of *train* documents; train the tokenizer on it.
2. tokenize: read the documents again, encode them in chunks (multi-threaded batch encoder), append
   ``<|endoftext|>`` to each, stream them into ``train.bin/.idx`` and ``valid.bin/.idx``.

The result lives in ``cache_dir/<key>``, where the key hashes the corpus fingerprint (paths, sizes,
mtimes), vocab size, valid fraction, sample size, tokenizers version and ``FORMAT_VERSION``. The
folder is built under a temp name and renamed into place with ``meta.json`` already inside, so a
folder with ``meta.json`` is always complete; when two processes race, the first rename wins and
the other uses the winner's folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import tokenizers

from ptdp.data.corpus import (
    DEFAULT_SUFFIXES,
    Document,
    PathLike,
    corpus_fingerprint,
    default_corpus_paths,
    iter_documents,
    list_corpus_files,
)
from ptdp.data.errors import DataError
from ptdp.data.indexed import IndexedTokens, IndexedWriter, token_dtype
from ptdp.data.split import assign_splits, check_valid_fraction, stable_unit
from ptdp.data.tokenizer import (
    check_vocab_size,
    encode_documents,
    eos_id,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

FORMAT_VERSION = 1
META_FILE = "meta.json"
#: Characters of train text the tokenizer is trained on (about 1.2 s on 2 cores for ~8 MB of code).
TOKENIZER_SAMPLE_CHARS = 10_000_000
#: Characters of text per call to the batch encoder.
ENCODE_CHUNK_CHARS = 2_000_000

Log = Callable[[str], None]


@dataclass(frozen=True)
class PreparedData:
    """A prepared corpus on disk. ``vocab_size`` is the trained size (<= the requested one)."""

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

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> "PreparedData":
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
            **{k: int(meta[k]) for k in _COUNT_FIELDS},
        )

    def tokenizer(self):
        """The trained ``tokenizers.Tokenizer``."""
        return load_tokenizer(self.tokenizer_path)

    def train_tokens(self) -> IndexedTokens:
        return IndexedTokens(self.train_prefix)

    def valid_tokens(self) -> IndexedTokens:
        return IndexedTokens(self.valid_prefix)


_COUNT_FIELDS = (
    "vocab_size", "eos_id", "num_train_docs", "num_valid_docs", "num_train_tokens", "num_valid_tokens",
)


def cache_key(fingerprint: str, vocab_size: int, valid_fraction: float) -> str:
    """Hex key naming the cache folder for this corpus and these settings."""
    spec = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "vocab_size": vocab_size,
        "valid_fraction": float(valid_fraction),
        "tokenizer_sample_chars": TOKENIZER_SAMPLE_CHARS,
        "tokenizers_version": tokenizers.__version__,
    }
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def prepare_data(
    paths: Sequence[PathLike] | None,
    vocab_size: int,
    cache_dir: str | os.PathLike[str],
    valid_fraction: float = 0.02,
    log: Log | None = print,
) -> PreparedData:
    """Prepare (or reuse) tokenizer and token files for a corpus; see the module docstring.

    ``paths=None``: the ``.py`` files of the standard library. ``vocab_size``: tokenizer size to
    train (>= 258). ``valid_fraction``: expected share of documents held out, in (0, 1).
    """
    log = log or (lambda _msg: None)
    check_vocab_size(vocab_size)
    check_valid_fraction(valid_fraction)
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    roots = default_corpus_paths() if paths is None else [Path(p) for p in paths]
    suffixes = DEFAULT_SUFFIXES if paths is None else None
    key = cache_key(corpus_fingerprint(roots, suffixes), vocab_size, valid_fraction)
    cache_dir = Path(cache_dir)
    final = cache_dir / key
    if (final / META_FILE).is_file():
        log(f"[data] using cached data {final}")
        return PreparedData.load(final)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _build(tmp, roots, suffixes, vocab_size, valid_fraction, key, log)
        try:
            os.rename(tmp, final)
        except OSError as err:
            if not (final / META_FILE).is_file():
                raise DataError(
                    f"cannot move prepared data into {str(final)!r} ({err}); the folder exists "
                    f"without {META_FILE}: delete it and retry"
                ) from err
            log(f"[data] another process prepared {final} first; using it")
        else:
            log(f"[data] prepared data in {final}")
        return PreparedData.load(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _unique_documents(roots, suffixes, duplicates: list[int] | None = None) -> Iterator[Document]:
    """Documents with exact-duplicate texts dropped (the first occurrence is kept).

    ``duplicates``: if given, ``duplicates[0]`` is incremented per dropped document.
    """
    seen: set[bytes] = set()
    for doc in iter_documents(roots, suffixes):
        digest = hashlib.sha1(doc.text.encode("utf-8", "surrogatepass")).digest()
        if digest in seen:
            if duplicates is not None:
                duplicates[0] += 1
            continue
        seen.add(digest)
        yield doc


def _scan(roots, suffixes, valid_fraction: float) -> tuple[list[str], list[bool], list[str], int]:
    """Pass 1: (doc_ids, is_valid, tokenizer sample texts from train docs, duplicates dropped)."""
    total_bytes = sum(f.size for f in list_corpus_files(roots, suffixes))
    keep_prob = min(1.0, TOKENIZER_SAMPLE_CHARS / max(total_bytes, 1))
    doc_ids: list[str] = []
    candidates: list[tuple[int, str]] = []  # (document number, text), likely-train documents
    sampled_chars, duplicates = 0, [0]
    for doc in _unique_documents(roots, suffixes, duplicates):
        doc_ids.append(doc.doc_id)
        room = TOKENIZER_SAMPLE_CHARS - sampled_chars
        if room > 0 and stable_unit(doc.doc_id) >= valid_fraction:
            if stable_unit(doc.doc_id, "tokenizer-sample") < keep_prob or not candidates:
                candidates.append((len(doc_ids) - 1, doc.text[:room]))
                sampled_chars += len(candidates[-1][1])
    is_valid = assign_splits(doc_ids, valid_fraction)
    sample = [text for i, text in candidates if not is_valid[i]]
    if not sample:  # every sampled document was moved to validation: take the first train one
        first_train = is_valid.index(False)
        doc = next(d for j, d in enumerate(_unique_documents(roots, suffixes)) if j == first_train)
        sample = [doc.text[:TOKENIZER_SAMPLE_CHARS]]
    return doc_ids, is_valid, sample, duplicates[0]


def _tokenize(roots, suffixes, doc_ids, is_valid, tokenizer, out_dir: Path, dtype) -> tuple:
    """Pass 2: encode every document into train/valid token files; return the two writers."""
    with IndexedWriter(out_dir / "train", dtype) as train, IndexedWriter(out_dir / "valid", dtype) as valid:
        texts: list[str] = []
        sides: list[bool] = []

        def flush() -> None:
            for tokens, side in zip(encode_documents(tokenizer, texts), sides):
                (valid if side else train).add(tokens)
            texts.clear()
            sides.clear()

        chars, n = 0, 0
        for n, doc in enumerate(_unique_documents(roots, suffixes), start=1):
            if n > len(doc_ids) or doc_ids[n - 1] != doc.doc_id:
                raise DataError(f"corpus changed while being prepared (at {doc.doc_id!r}); retry")
            texts.append(doc.text)
            sides.append(is_valid[n - 1])
            chars += len(doc.text)
            if chars >= ENCODE_CHUNK_CHARS:
                flush()
                chars = 0
        flush()
        if n != len(doc_ids):
            raise DataError(f"corpus changed while being prepared ({len(doc_ids)} -> {n} documents); retry")
    return train, valid


def _build(out_dir: Path, roots, suffixes, vocab_size, valid_fraction, key, log: Log) -> None:
    """Write tokenizer.json, train/valid token files and (last) meta.json into ``out_dir``."""
    t0 = time.perf_counter()
    log(f"[data] preparing {[str(r) for r in roots]} (vocab_size={vocab_size}) into {out_dir.parent}")
    doc_ids, is_valid, sample, duplicates = _scan(roots, suffixes, valid_fraction)
    n_valid = sum(is_valid)
    t1 = time.perf_counter()
    log(f"[data] {len(doc_ids)} unique documents ({duplicates} duplicates dropped): "
        f"{len(doc_ids) - n_valid} train, {n_valid} validation ({t1 - t0:.1f}s)")
    tokenizer = train_tokenizer(sample, vocab_size, length=len(sample))
    save_tokenizer(tokenizer, out_dir / "tokenizer.json")
    t2 = time.perf_counter()
    log(f"[data] trained tokenizer: {tokenizer.get_vocab_size()} tokens on "
        f"{sum(map(len, sample)) / 1e6:.1f}M chars ({t2 - t1:.1f}s)")
    train, valid = _tokenize(roots, suffixes, doc_ids, is_valid, tokenizer, out_dir,
                             token_dtype(tokenizer.get_vocab_size()))
    t3 = time.perf_counter()
    log(f"[data] tokenized: {train.num_tokens} train tokens, {valid.num_tokens} validation tokens "
        f"({t3 - t2:.1f}s)")
    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "sources": [str(r) for r in roots],
        "suffixes": list(suffixes) if suffixes is not None else None,
        "requested_vocab_size": vocab_size,
        "valid_fraction": valid_fraction,
        "tokenizers_version": tokenizers.__version__,
        "tokenizer_file": "tokenizer.json",
        "train_prefix": "train",
        "valid_prefix": "valid",
        "token_dtype": str(train.dtype),
        "duplicates_dropped": duplicates,
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_id": eos_id(tokenizer),
        "num_train_docs": train.num_docs,
        "num_valid_docs": valid.num_docs,
        "num_train_tokens": train.num_tokens,
        "num_valid_tokens": valid.num_tokens,
        "prepare_seconds": round(t3 - t0, 3),
    }
    tmp_meta = out_dir / f".{META_FILE}.tmp"
    tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp_meta, out_dir / META_FILE)
