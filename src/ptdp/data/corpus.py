"""Corpus discovery: paths -> text documents, deterministically.

A corpus is a list of files or folders; folders are walked recursively in sorted order, skipping
hidden entries, ``__pycache__``, ``site-packages`` and ``dist-packages``. A text file is one
document; a ``.jsonl`` file one per non-blank line (its ``text_key`` field); a table
(:mod:`ptdp.data.tabular`) one per row with non-blank text. Binary, non-UTF-8, unreadable or
irregular files are skipped with a warning (known binary extensions and empty files inside folders
silently); when nothing usable remains the error names every skipped file and why.

Document ids are relative (``<root folder name>/<path>``, ``<file name>``, ``...:<line>`` or
``...:<row>`` from 0), so the hashed train/validation split is the same wherever the corpus lives.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import warnings
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ptdp.data.tabular import folder_stat, is_saved_dataset, iter_rows, table_kind
from ptdp.errors import DataError

PathLike = Union[str, "os.PathLike[str]"]

#: The default corpus reads only these suffixes from the standard library folder.
DEFAULT_SUFFIXES: tuple[str, ...] = (".py",)

SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})

BINARY_SUFFIXES = frozenset(
    """
    .pyc .pyo .pyd .so .dll .dylib .a .o .obj .lib .exe .bin .idx .dat .db .sqlite .npy .npz .pt
    .pth .pkl .pickle .safetensors .ckpt .h5 .zip .gz .tgz .bz2 .xz .zst .7z .tar
    .whl .egg .jar .class .png .jpg .jpeg .gif .bmp .tif .tiff .ico .webp .xbm .pbm .pgm .ppm .sgi
    .svgz .wav .au .aif .aiff .aifc .mp3 .mp4 .ogg .flac .avi .mov .mkv .pdf .ttf .otf .woff .woff2
    .pck .icns
    """.split()
)


@dataclass(frozen=True)
class Document:
    """One training document. ``doc_id`` is stable across machines; ``text`` is non-blank."""

    doc_id: str
    text: str


@dataclass(frozen=True)
class CorpusFile:
    """A file that :func:`iter_documents` would read. ``size`` in bytes, ``mtime_ns`` in ns."""

    path: Path
    doc_id: str
    size: int
    mtime_ns: int
    given: bool = False
    """The path was given directly (not found by walking a folder): an empty one is worth a warning."""


def default_corpus_paths() -> list[Path]:
    """The running Python's standard library folder (read with ``suffixes=DEFAULT_SUFFIXES``)."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def _as_path_list(paths: Sequence[PathLike] | PathLike) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [Path(p) for p in paths]
    if not out:
        raise DataError("no data paths given (expected at least one file or folder)")
    return out


def _wanted(name: str, suffixes: Collection[str] | None) -> bool:
    suffix = os.path.splitext(name)[1].lower()
    if suffixes is not None:
        return suffix in suffixes
    return suffix not in BINARY_SUFFIXES


def _walk(folder: Path, skipped: list[tuple[Path, str]] | None = None) -> Iterator[Path]:
    """Files under ``folder``, depth first, each folder's entries sorted by name, and saved datasets'
    folders (not walked into). Hidden entries and ``SKIPPED_DIRS`` are pruned; symlinked folders are
    not followed; an unreadable folder is skipped (see :func:`_skip`)."""
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as err:
        _skip(folder, f"unreadable folder ({err.strerror or err})", skipped)
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_dir(follow_symlinks=False):
            if is_saved_dataset(Path(entry.path)):
                yield Path(entry.path)
            elif entry.name not in SKIPPED_DIRS:
                yield from _walk(Path(entry.path), skipped)
        elif entry.is_file():
            yield Path(entry.path)


def list_corpus_files(
    paths: Sequence[PathLike] | PathLike,
    suffixes: Collection[str] | None = None,
    skipped: list[tuple[Path, str]] | None = None,
) -> list[CorpusFile]:
    """Every file that would be read, in reading order, with its size and mtime (stat only).

    ``suffixes`` (lower case, with the dot): read only those; else every file without a known binary
    extension. Raises :class:`DataError` naming a path that does not exist. Paths that cannot be
    stat'ed, or given directly and neither a folder nor a regular file, are skipped: appended to
    ``skipped`` with the reason and warned about when ``skipped`` is given, silently otherwise.
    """
    files: list[CorpusFile] = []
    suffix_set = None if suffixes is None else {s.lower() for s in suffixes}
    for root in _as_path_list(paths):
        if not root.exists():
            raise DataError(f"data path does not exist: {str(root)!r}")
        base = root.resolve().name or "root"
        found: Iterator[tuple[Path, str]]
        if root.is_dir() and not is_saved_dataset(root):
            found = ((p, f"{base}/{p.relative_to(root).as_posix()}") for p in _walk(root, skipped))
        elif not root.is_file() and not root.is_dir():
            _skip(root, "not a regular file or folder (a FIFO, socket or device)", skipped)
            continue
        else:
            found = iter([(root, base)])
        for path, doc_id in found:
            if not _wanted(path.name, suffix_set):
                if path == root:  # named directly: say why it is not read
                    suffix = os.path.splitext(path.name)[1].lower()
                    why = (
                        f"its extension {suffix!r} marks a binary file (token files, archives, images and "
                        f"compiled code are not read as text)"
                        if suffix_set is None
                        else f"its extension {suffix!r} is not one of {sorted(suffix_set)}"
                    )
                    _skip(path, why, skipped)
                continue
            try:
                size, mtime_ns = folder_stat(path) if path.is_dir() else _size_mtime(path)
            except OSError as err:  # a dangling symlink, a permission problem
                _skip(path, f"unreadable ({err.strerror or err})", skipped)
                continue
            files.append(CorpusFile(path, doc_id, size, mtime_ns, given=path == root))
    return files


def _size_mtime(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _skip(path: Path, reason: str, skipped: list[tuple[Path, str]] | None, warn: bool = True) -> None:
    """Record (when ``skipped`` is a list) and warn about (when also ``warn``) a skipped path."""
    if skipped is None:
        return
    if warn:
        warnings.warn(f"skipping data file {str(path)!r}: {reason}", stacklevel=3)
    skipped.append((path, reason))


def corpus_fingerprint(paths: Sequence[PathLike] | PathLike, suffixes: Collection[str] | None = None) -> str:
    """Hex SHA-1 over (root, relative path, size, mtime_ns) of every file that would be read.

    Cheap (no file contents are read); used as a cache key. Editing, adding, removing or touching
    a file changes it.
    """
    h = hashlib.sha1()
    h.update(json.dumps(sorted(suffixes) if suffixes is not None else None).encode())
    for root in _as_path_list(paths):
        h.update(b"\0root\0" + str(root.resolve()).encode("utf-8", "surrogateescape"))
    for f in list_corpus_files(paths, suffixes):
        h.update(f"\0{f.doc_id}\0{f.size}\0{f.mtime_ns}".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _read_text(path: Path) -> tuple[str | None, str]:
    """The file's text, or None and why not (binary, not UTF-8, unreadable)."""
    try:
        data = path.read_bytes()
    except OSError as err:  # no permission, a folder in the way, gone since it was listed
        return None, f"unreadable ({err.strerror or err})"
    if b"\0" in data:
        return None, "contains NUL bytes (binary?)"
    try:
        return data.decode("utf-8-sig"), ""
    except UnicodeDecodeError as err:
        return None, f"not valid UTF-8 ({err})"


def _json_type(value: object) -> str:
    """JSON's name for the type of a decoded ``value``."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _describe_record(record: object, text_key: str) -> str:
    """What a JSON Lines record holds instead of a string ``text_key`` field, for an error message."""
    if not isinstance(record, dict):
        return f"a JSON {_json_type(record)}"
    if text_key in record:
        return f"{text_key!r} holding a JSON {_json_type(record[text_key])} ({json.dumps(record[text_key])[:40]})"
    return f"an object without it (keys {sorted(record)[:8]})"


def _jsonl_documents(path: Path, doc_id: str, text: str, text_key: str = "text") -> Iterator[Document]:
    # JSON Lines separates records by "\n" only; str.splitlines would also split inside strings
    # holding U+2028, U+2029 or U+0085, which json.dumps(ensure_ascii=False) writes unescaped.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{str(path)!r} line {lineno}: not valid JSON ({err})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
            raise DataError(
                f"{str(path)!r} line {lineno}: expected a JSON object with a string {text_key!r} field "
                f"(--data-text-key), got {_describe_record(record, text_key)}"
            )
        if record[text_key].strip():
            yield Document(f"{doc_id}:{lineno}", record[text_key])


def iter_documents(
    paths: Sequence[PathLike] | PathLike, suffixes: Collection[str] | None = None, text_key: str = "text"
) -> Iterator[Document]:
    """Yield the corpus' non-blank documents in deterministic order; ``text_key``: the field of
    ``.jsonl`` records and the column of tables that holds the text.

    Paths are checked (and files listed) eagerly, so a missing path raises :class:`DataError` at
    the call. If the iteration finds no usable document it raises :class:`DataError` naming the
    paths searched and every file skipped, with the reason.
    """
    roots = _as_path_list(paths)
    skipped: list[tuple[Path, str]] = []
    files = list_corpus_files(roots, suffixes, skipped)
    return _generate(roots, files, suffixes, skipped, text_key)


def _generate(
    roots: list[Path],
    files: list[CorpusFile],
    suffixes: Collection[str] | None,
    skipped: list[tuple[Path, str]],
    text_key: str = "text",
) -> Iterator[Document]:
    count = 0
    for f in files:
        kind = table_kind(f.path)
        if kind is not None:
            docs: Iterator[Document] = (
                Document(f"{f.doc_id}:{row}", text) for row, text in iter_rows(f.path, kind, text_key)
            )
        else:
            text, reason = _read_text(f.path)
            if text is None:
                _skip(f.path, reason, skipped)
                continue
            if f.path.suffix.lower() == ".jsonl":
                docs = _jsonl_documents(f.path, f.doc_id, text, text_key)
            else:
                docs = iter([Document(f.doc_id, text)] if text.strip() else [])
        before = count
        for doc in docs:
            count += 1
            yield doc
        if count == before:  # an empty file: worth a warning only when named directly
            _skip(f.path, "empty (no non-blank text)", skipped, warn=f.given)
    if count == 0:
        raise DataError(_nothing_usable(roots, files, suffixes, skipped))


def _nothing_usable(roots, files, suffixes, skipped: list[tuple[Path, str]], shown: int = 10) -> str:
    what = f" with suffixes {sorted(suffixes)}" if suffixes is not None else ""
    text = f"no usable documents{what} in {[str(r) for r in roots]}"
    if not files and not skipped:
        return text + " (no files found)"
    listed = "; ".join(f"{str(path)!r}: {reason}" for path, reason in skipped[:shown])
    more = f"; and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return f"{text}: every file was skipped: {listed}{more}"
