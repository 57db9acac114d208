"""Corpus discovery: paths -> text documents, deterministically.

A *corpus* is a list of paths (files or folders). Folders are walked recursively in sorted order,
skipping hidden entries, ``__pycache__``, ``site-packages`` and ``dist-packages``. Every text file is
one document, except ``.jsonl`` files, which give one document per non-blank line (its ``"text"``
field). Files with a known binary extension are ignored; files that turn out to be binary (a NUL
byte) or not UTF-8 are skipped with a warning.

Document ids are *relative* (``<root folder name>/<path inside it>``, ``<file name>`` for a file
given directly, ``...:<line>`` for jsonl lines), so the train/validation split, which hashes them,
is the same on every machine wherever the corpus lives.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterator, Sequence, Union

from ptdp.data.errors import DataError

PathLike = Union[str, "os.PathLike[str]"]

#: The default corpus reads only these suffixes from the standard library folder.
DEFAULT_SUFFIXES: tuple[str, ...] = (".py",)

SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})

BINARY_SUFFIXES = frozenset(
    """
    .pyc .pyo .pyd .so .dll .dylib .a .o .obj .lib .exe .bin .idx .dat .db .sqlite .npy .npz .pt
    .pth .pkl .pickle .safetensors .ckpt .h5 .parquet .arrow .zip .gz .tgz .bz2 .xz .zst .7z .tar
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


def _walk(folder: Path) -> Iterator[Path]:
    """Files under ``folder``, depth first, each folder's entries sorted by name. Hidden entries and
    ``SKIPPED_DIRS`` are pruned; symlinked folders are not followed."""
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in SKIPPED_DIRS:
                yield from _walk(Path(entry.path))
        elif entry.is_file():
            yield Path(entry.path)


def list_corpus_files(
    paths: Sequence[PathLike] | PathLike, suffixes: Collection[str] | None = None
) -> list[CorpusFile]:
    """Every file that would be read, in reading order, with its size and mtime (stat only).

    ``suffixes``: if given (lower case, with the dot, e.g. ``{".py"}``), read only those; otherwise
    read every file whose extension is not a known binary one. Raises :class:`DataError` naming a
    path that does not exist.
    """
    files: list[CorpusFile] = []
    suffix_set = None if suffixes is None else {s.lower() for s in suffixes}
    for root in _as_path_list(paths):
        if not root.exists():
            raise DataError(f"data path does not exist: {str(root)!r}")
        base = root.resolve().name or "root"
        if root.is_dir():
            found = ((p, f"{base}/{p.relative_to(root).as_posix()}") for p in _walk(root))
        else:
            found = iter([(root, base)])
        for path, doc_id in found:
            if not _wanted(path.name, suffix_set):
                continue
            try:
                st = path.stat()
            except OSError as err:  # a dangling symlink, a permission problem
                warnings.warn(f"skipping unreadable data file {str(path)!r}: {err}", stacklevel=2)
                continue
            files.append(CorpusFile(path, doc_id, st.st_size, st.st_mtime_ns))
    return files


def corpus_fingerprint(
    paths: Sequence[PathLike] | PathLike, suffixes: Collection[str] | None = None
) -> str:
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


def _read_text(path: Path) -> str | None:
    """The file's text, or None (with a warning) if it is binary or not UTF-8."""
    data = path.read_bytes()
    if b"\0" in data:
        warnings.warn(f"skipping data file {str(path)!r}: contains NUL bytes (binary?)", stacklevel=3)
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        warnings.warn(f"skipping data file {str(path)!r}: not valid UTF-8 ({err})", stacklevel=3)
        return None


def _jsonl_documents(path: Path, doc_id: str, text: str) -> Iterator[Document]:
    # JSON Lines separates records by "\n" only; str.splitlines would also split inside strings
    # holding U+2028, U+2029 or U+0085, which json.dumps(ensure_ascii=False) writes unescaped.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{str(path)!r} line {lineno}: not valid JSON ({err})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(
                f"{str(path)!r} line {lineno}: expected a JSON object with a string 'text' field, "
                f"got {type(record).__name__}"
                + (f" with keys {sorted(record)[:8]}" if isinstance(record, dict) else "")
            )
        if record["text"].strip():
            yield Document(f"{doc_id}:{lineno}", record["text"])


def iter_documents(
    paths: Sequence[PathLike] | PathLike, suffixes: Collection[str] | None = None
) -> Iterator[Document]:
    """Yield the corpus' non-blank documents in deterministic order.

    Paths are checked (and files listed) eagerly, so a missing path raises :class:`DataError` at
    the call. If the iteration finds no usable document it raises :class:`DataError` naming the
    paths searched.
    """
    roots = _as_path_list(paths)
    files = list_corpus_files(roots, suffixes)
    return _generate(roots, files, suffixes)


def _generate(
    roots: list[Path], files: list[CorpusFile], suffixes: Collection[str] | None
) -> Iterator[Document]:
    count = 0
    for f in files:
        text = _read_text(f.path)
        if text is None:
            continue
        if f.path.suffix.lower() == ".jsonl":
            docs: Iterator[Document] = _jsonl_documents(f.path, f.doc_id, text)
        else:
            docs = iter([Document(f.doc_id, text)] if text.strip() else [])
        for doc in docs:
            count += 1
            yield doc
    if count == 0:
        what = f" with suffixes {sorted(suffixes)}" if suffixes is not None else ""
        raise DataError(
            f"no usable documents{what} in {[str(r) for r in roots]} "
            f"({len(files)} candidate files; all empty, binary or not UTF-8)"
        )
