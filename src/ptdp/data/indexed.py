"""Token files on disk: ``prefix.bin`` (all documents' tokens, concatenated) + ``prefix.idx``.

``.idx`` layout (little endian)::

    bytes 0..7    magic  b"PTDPIDX\\0"
    bytes 8..11   uint32 format version (1)
    bytes 12..15  uint32 dtype code (1 = uint16, 2 = uint32)
    bytes 16..23  int64  n_docs
    bytes 24..    int64  doc start offsets in tokens, length n_docs + 1 (offsets[0] = 0,
                  offsets[-1] = total tokens; document i is bin[offsets[i]:offsets[i+1]])

Both files are read with ``numpy.memmap`` (read-only), so opening is O(1) in the corpus size and
processes on one machine share the page cache.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ptdp.errors import DataError

MAGIC = b"PTDPIDX\0"
VERSION = 1
_HEADER = struct.Struct("<8sIIq")
_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32)}
_CODES = {dt: code for code, dt in _DTYPES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab_size <= 65536), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")


class IndexedWriter:
    """Streams documents into ``prefix.bin``/``prefix.idx``; files appear only on :meth:`close`.

    Use as a context manager: on an exception the temp files are removed and nothing appears.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: np.dtype | type) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise DataError(f"token dtype must be uint16 or uint32, got {self.dtype}")
        self.bin_path, self.idx_path = _paths(prefix)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + tag)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + tag)
        self._bin = open(self._bin_tmp, "wb")
        self._offsets = [0]
        self._max_id = np.iinfo(self.dtype).max

    def add(self, tokens: np.ndarray) -> None:
        """Append one document: a 1-D integer array of ids in [0, dtype max]."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"a document must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() > self._max_id):
            raise DataError(
                f"token ids [{tokens.min()}, {tokens.max()}] do not fit {self.dtype} "
                f"(max {self._max_id}) in {str(self.bin_path)!r}"
            )
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + tokens.size)

    @property
    def num_docs(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def close(self) -> None:
        """Write the index and move both files into place (``.bin`` first, then ``.idx``)."""
        self._bin.close()
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODES[self.dtype], self.num_docs))
            f.write(np.asarray(self._offsets, dtype="<i8").tobytes())
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)

    def abort(self) -> None:
        """Drop everything written so far."""
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_indexed(
    prefix: str | os.PathLike[str], token_arrays: Iterable[np.ndarray], dtype: np.dtype | type
) -> tuple[int, int]:
    """Write documents to ``prefix.bin``/``prefix.idx`` atomically; return (num_docs, num_tokens)."""
    with IndexedWriter(prefix, dtype) as writer:
        for tokens in token_arrays:
            writer.add(tokens)
    return writer.num_docs, writer.num_tokens


class IndexedTokens:
    """Read-only view of ``prefix.bin``/``prefix.idx``.

    ``tokens``: the whole stream, shape [num_tokens] (uint16/uint32 memmap); ``doc(i)``: document
    i's tokens. Pickles by path (a worker process re-opens the files instead of copying them).
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = Path(prefix)
        self.bin_path, self.idx_path = _paths(prefix)
        self.dtype, self.offsets = self._read_index()
        num_tokens = int(self.offsets[-1])
        bin_size = self.bin_path.stat().st_size if self.bin_path.exists() else None
        if bin_size != num_tokens * self.dtype.itemsize:
            raise DataError(
                f"token file {str(self.bin_path)!r} has {bin_size} bytes but its index "
                f"{str(self.idx_path)!r} promises {num_tokens} x {self.dtype} = "
                f"{num_tokens * self.dtype.itemsize} bytes (truncated or mismatched files)"
            )
        if num_tokens == 0:  # numpy cannot memory-map an empty file
            self.tokens = np.zeros(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,))

    def _read_index(self) -> tuple[np.dtype, np.ndarray]:
        name = str(self.idx_path)
        if not self.idx_path.is_file():
            raise DataError(f"index file does not exist: {name!r}")
        size = self.idx_path.stat().st_size
        if size < _HEADER.size:
            raise DataError(f"index file {name!r} is truncated: {size} bytes < {_HEADER.size}-byte header")
        with open(self.idx_path, "rb") as f:
            magic, version, code, n_docs = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise DataError(f"index file {name!r} has magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise DataError(f"index file {name!r} has format version {version}, expected {VERSION}")
        if code not in _DTYPES:
            raise DataError(f"index file {name!r} has unknown dtype code {code}")
        expected = _HEADER.size + 8 * (n_docs + 1)
        if n_docs < 0 or size != expected:
            raise DataError(
                f"index file {name!r} is {size} bytes; {n_docs} documents need {expected} (truncated or corrupt)"
            )
        offsets = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(n_docs + 1,))
        if offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise DataError(f"index file {name!r} has invalid offsets (must start at 0, never decrease)")
        return _DTYPES[code], offsets

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, i: int) -> np.ndarray:
        """Document ``i``'s tokens (a read-only view), shape [doc length]."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range [0, {self.num_docs})")
        return self.tokens[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __len__(self) -> int:
        return self.num_docs

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        IndexedTokens.__init__(self, state["prefix"])

    def __repr__(self) -> str:
        return f"IndexedTokens({str(self.prefix)!r}, docs={self.num_docs}, tokens={self.num_tokens})"
