"""Corpus -> tokenizer + train/valid token files, cached on disk by a content key.

Two streaming passes (only a bounded tokenizer sample is held in memory):

1. scan: list documents, drop exact duplicates, split train/validation by a hash of the document
   id (:mod:`ptdp.data.split`), sample about ``TOKENIZER_SAMPLE_CHARS`` of train text and train
   the tokenizer on it, unless ``--tokenizer-model`` gives one (copied byte for byte).
2. tokenize: encode the documents in chunks (threads, or processes: :mod:`ptdp.data.encode`),
   each followed by the end-of-document token, into ``train.bin/.idx`` and ``valid.bin/.idx``.

The key of ``cache_dir/<key>`` hashes the corpus fingerprint (paths, sizes, mtimes), valid
fraction, text key, tokenizers version, ``FORMAT_VERSION`` and the tokenizer (vocab and sample
size, or the given file's SHA-256 and end-of-document token). The folder is built under a temp name
and renamed into place with ``meta.json`` inside, so it is always complete; racing processes use
the first rename's folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tqdm import tqdm

from ptdp.data.corpus import (
    DEFAULT_SUFFIXES,
    Document,
    PathLike,
    corpus_fingerprint,
    default_corpus_paths,
    iter_documents,
    list_corpus_files,
)
from ptdp.data.encode import encode_chunks, worker_count
from ptdp.data.indexed import IndexedWriter, token_dtype
from ptdp.data.prepared_data import FORMAT_VERSION, META_FILE, TOKENIZER_SAMPLE_CHARS, PreparedData, cache_key
from ptdp.data.split import assign_splits, check_valid_fraction, stable_unit
from ptdp.data.tokenizer import (
    EOS_TOKEN,
    TokenizerModel,
    check_vocab_size,
    eos_id,
    load_tokenizer_model,
    save_tokenizer,
    tokenizer_config_beside,
    train_tokenizer,
)
from ptdp.errors import DataError

#: Characters of text per call to the batch encoder.
ENCODE_CHUNK_CHARS = 2_000_000

__all__ = ["ENCODE_CHUNK_CHARS", "prepare_data"]

Log = Callable[[str], None]


def prepare_data(
    paths: Sequence[PathLike] | None,
    vocab_size: int,
    cache_dir: str | os.PathLike[str],
    valid_fraction: float = 0.02,
    log: Log | None = print,
    *,
    tokenizer_model: PathLike | None = None,
    eod_token: str | None = None,
    text_key: str = "text",
    workers: int | None = None,
    progress: bool = True,
) -> PreparedData:
    """Prepare (or reuse) tokenizer and token files for a corpus; see the module docstring.

    ``paths=None``: the standard library's ``.py`` files. ``vocab_size``: tokenizer size to train
    (>= 258). ``valid_fraction``: expected held-out share, in (0, 1). ``tokenizer_model`` /
    ``eod_token``: a given tokenizer (:func:`ptdp.data.tokenizer.load_tokenizer_model`). ``text_key``:
    the text field or column. ``workers``: encoding processes (the files do not depend on it).

    Raises:
        DataError: unusable settings, tokenizer or corpus (the message names the value or path).
    """
    log = log or (lambda _msg: None)
    if eod_token is not None and tokenizer_model is None:
        raise DataError(
            f"eod_token={eod_token!r} needs a tokenizer_model (ptdp's own ends documents with {EOS_TOKEN!r})"
        )
    tokenizer = load_tokenizer_model(tokenizer_model, eod_token) if tokenizer_model is not None else None
    if tokenizer is None:
        check_vocab_size(vocab_size)
    check_valid_fraction(valid_fraction)
    worker_count(workers, 0)  # a bad count fails before any reading
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    roots = default_corpus_paths() if paths is None else [Path(p) for p in paths]
    source = _Source(roots, DEFAULT_SUFFIXES if paths is None else None, text_key)
    key = cache_key(corpus_fingerprint(roots, source.suffixes), vocab_size, valid_fraction, tokenizer, text_key)
    cache_dir = Path(cache_dir)
    final = cache_dir / key
    if (final / META_FILE).is_file():
        log(f"[data] using cached data {final}")
        return PreparedData.load(final)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _build(tmp, source, _Settings(vocab_size, valid_fraction, key, tokenizer, workers, progress), log)
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


def _name_eos_token(tokenizer: Path, eos_token: str, out: Path) -> None:
    """Write ``out``: the ``tokenizer_config.json`` beside ``tokenizer`` (if any) naming
    ``eos_token`` as its ``eos_token``, so that a checkpoint and its Hugging Face export name the
    token documents ended with."""
    beside = tokenizer_config_beside(tokenizer)
    try:
        config = json.loads(beside.read_text(encoding="utf-8")) if beside else {}
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    out.write_text(json.dumps(config | {"eos_token": eos_token}, indent=2), encoding="utf-8")


@dataclass(frozen=True)
class _Source:
    """The corpus: its roots, the suffixes read (None: all text), the text's field in records."""

    roots: list[Path]
    suffixes: tuple[str, ...] | None
    text_key: str

    def documents(self) -> Iterator[Document]:
        return iter_documents(self.roots, self.suffixes, self.text_key)


@dataclass(frozen=True)
class _Settings:
    vocab_size: int
    valid_fraction: float
    key: str
    tokenizer: TokenizerModel | None
    workers: int | None
    progress: bool


def _unique_documents(source: _Source, duplicates: list[int] | None = None) -> Iterator[Document]:
    """Documents with exact-duplicate texts dropped (the first occurrence is kept).

    ``duplicates``: if given, ``duplicates[0]`` is incremented per dropped document.
    """
    seen: set[bytes] = set()
    for doc in source.documents():
        digest = hashlib.sha1(doc.text.encode("utf-8", "surrogatepass")).digest()
        if digest in seen:
            if duplicates is not None:
                duplicates[0] += 1
            continue
        seen.add(digest)
        yield doc


def _scan(
    source: _Source, valid_fraction: float, sample_chars: int, progress: bool = False
) -> tuple[list[str], list[bool], list[str], int]:
    """Pass 1: (doc_ids, is_valid, up to ``sample_chars`` characters of train documents to train a
    tokenizer on, duplicates dropped)."""
    total_bytes = sum(f.size for f in list_corpus_files(source.roots, source.suffixes))
    keep_prob = min(1.0, sample_chars / max(total_bytes, 1))
    doc_ids: list[str] = []
    candidates: list[tuple[int, str]] = []  # (document number, text), likely-train documents
    sampled_chars, duplicates = 0, [0]
    documents = tqdm(
        _unique_documents(source, duplicates),
        unit="doc",
        desc="[data] scanning",
        mininterval=1.0,
        leave=False,
        disable=None if progress else True,
    )
    for doc in documents:
        doc_ids.append(doc.doc_id)
        room = sample_chars - sampled_chars
        if room > 0 and stable_unit(doc.doc_id) >= valid_fraction:
            if stable_unit(doc.doc_id, "tokenizer-sample") < keep_prob or not candidates:
                candidates.append((len(doc_ids) - 1, doc.text[:room]))
                sampled_chars += len(candidates[-1][1])
    is_valid = assign_splits(doc_ids, valid_fraction)
    sample = [text for i, text in candidates if not is_valid[i]]
    if not sample and sample_chars:  # every sampled document was moved to validation: take the first train one
        first_train = is_valid.index(False)
        doc = next(d for j, d in enumerate(_unique_documents(source)) if j == first_train)
        sample = [doc.text[:sample_chars]]
    return doc_ids, is_valid, sample, duplicates[0]


def _chunks(source: _Source, doc_ids: list[str], is_valid: list[bool]) -> Iterator[tuple[list[str], list[bool]]]:
    """Pass 2's reading: (texts, is_valid of each) of about ``ENCODE_CHUNK_CHARS`` characters at a
    time; DataError if the documents differ from pass 1's."""
    texts: list[str] = []
    sides: list[bool] = []
    chars, n = 0, 0
    for n, doc in enumerate(_unique_documents(source), start=1):
        if n > len(doc_ids) or doc_ids[n - 1] != doc.doc_id:
            raise DataError(f"corpus changed while being prepared (at {doc.doc_id!r}); retry")
        texts.append(doc.text)
        sides.append(is_valid[n - 1])
        chars += len(doc.text)
        if chars >= ENCODE_CHUNK_CHARS:
            yield texts, sides
            texts, sides, chars = [], [], 0
    yield texts, sides
    if n != len(doc_ids):
        raise DataError(f"corpus changed while being prepared ({len(doc_ids)} -> {n} documents); retry")


def _tokenize(
    source: _Source,
    doc_ids,
    is_valid,
    tokenizer,
    tokenizer_file: Path,
    eos_token: str,
    out_dir: Path,
    dtype,
    workers: int,
    progress: bool,
) -> tuple:
    """Pass 2: encode every document into train/valid token files; return the two writers."""
    with (
        IndexedWriter(out_dir / "train", dtype) as train,
        IndexedWriter(out_dir / "valid", dtype) as valid,
        tqdm(
            total=len(doc_ids),
            unit="doc",
            desc="[data] tokenizing",
            disable=None if progress else True,
            mininterval=1.0,
            leave=False,
        ) as bar,
    ):
        encoded = encode_chunks(_chunks(source, doc_ids, is_valid), tokenizer, tokenizer_file, eos_token, workers)
        for arrays, sides in encoded:
            for tokens, side in zip(arrays, sides):
                (valid if side else train).add(tokens)
            bar.update(len(sides))
    return train, valid


def _build(out_dir: Path, source: _Source, settings: _Settings, log: Log) -> None:
    """Write tokenizer.json, train/valid token files and (last) meta.json into ``out_dir``."""
    t0 = time.perf_counter()
    given = settings.tokenizer
    what = f"tokenizer {str(given.path)!r}" if given else f"vocab_size={settings.vocab_size}"
    log(f"[data] preparing {[str(r) for r in source.roots]} ({what}) into {out_dir.parent}")
    sample_chars = 0 if given else TOKENIZER_SAMPLE_CHARS
    doc_ids, is_valid, sample, duplicates = _scan(source, settings.valid_fraction, sample_chars, settings.progress)
    n_valid = sum(is_valid)
    t1 = time.perf_counter()
    log(
        f"[data] {len(doc_ids)} unique documents ({duplicates} duplicates dropped): "
        f"{len(doc_ids) - n_valid} train, {n_valid} validation ({t1 - t0:.1f}s)"
    )
    if given:
        tokenizer, eos_token, vocab_size = given.tokenizer, given.eos_token, given.vocab_size
        if given.added_json is None:
            shutil.copyfile(given.path, out_dir / "tokenizer.json")  # as given, byte for byte
        else:
            (out_dir / "tokenizer.json").write_text(given.added_json, encoding="utf-8")
            _name_eos_token(given.path, eos_token, out_dir / "tokenizer_config.json")
        added = f" (added as id {eos_id(tokenizer, eos_token)})" if given.added_json is not None else ""
        log(
            f"[data] using tokenizer {str(given.path)!r} as given: {vocab_size} tokens, documents end with "
            f"{eos_token!r}{added}"
        )
    else:
        tokenizer, eos_token = train_tokenizer(sample, settings.vocab_size, length=len(sample)), EOS_TOKEN
        vocab_size = tokenizer.get_vocab_size()
        save_tokenizer(tokenizer, out_dir / "tokenizer.json")
        log(
            f"[data] trained tokenizer: {vocab_size} tokens on {sum(map(len, sample)) / 1e6:.1f}M chars "
            f"({time.perf_counter() - t1:.1f}s)"
        )
    t2 = time.perf_counter()
    workers = worker_count(settings.workers, sum(f.size for f in list_corpus_files(source.roots, source.suffixes)))
    train, valid = _tokenize(
        source,
        doc_ids,
        is_valid,
        tokenizer,
        out_dir / "tokenizer.json",
        eos_token,
        out_dir,
        token_dtype(vocab_size),
        workers,
        settings.progress,
    )
    t3 = time.perf_counter()
    log(
        f"[data] tokenized: {train.num_tokens} train tokens, {valid.num_tokens} validation tokens "
        f"({t3 - t2:.1f}s{f', {workers} processes' if workers > 1 else ''})"
    )
    meta = {
        "format_version": FORMAT_VERSION,
        "key": settings.key,
        "sources": [str(r) for r in source.roots],
        "suffixes": list(source.suffixes) if source.suffixes is not None else None,
        "text_key": source.text_key,
        "requested_vocab_size": settings.vocab_size,
        "valid_fraction": settings.valid_fraction,
        "tokenizers_version": tokenizers.__version__,
        "tokenizer_file": "tokenizer.json",
        "tokenizer_source": str(given.path.resolve()) if given else None,
        "tokenizer_sha256": given.sha256 if given else None,
        "eos_token": eos_token,
        "train_prefix": "train",
        "valid_prefix": "valid",
        "token_dtype": str(train.dtype),
        "duplicates_dropped": duplicates,
        "vocab_size": vocab_size,
        "eos_id": eos_id(tokenizer, eos_token),
        "num_train_docs": train.num_docs,
        "num_valid_docs": valid.num_docs,
        "num_train_tokens": train.num_tokens,
        "num_valid_tokens": valid.num_tokens,
        "prepare_seconds": round(t3 - t0, 3),
    }
    tmp_meta = out_dir / f".{META_FILE}.tmp"
    tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp_meta, out_dir / META_FILE)
