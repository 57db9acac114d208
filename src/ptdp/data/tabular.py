"""Documents from tables, one per row (its text column, ``text`` unless ``--data-text-key``; null or
blank rows skipped). Needs the ``[data]`` extra, else a :class:`DataError` says
``pip install "ptdp[data]"``. Rows are read in batches, never a whole table.

Kinds (:func:`table_kind`):

* ``parquet``: a ``.parquet`` file, row group by row group (``pyarrow.parquet``).
* ``arrow``: a ``.arrow`` file, Arrow IPC file or stream format (what ``datasets`` writes), memory-mapped.
* ``saved_dataset``: a ``Dataset.save_to_disk`` folder, or a ``DatasetDict`` one (its ``train``
  split; point ``--data`` at ``folder/<split>`` for another), via ``datasets.load_from_disk``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ptdp.errors import DataError

#: Rows per batch read from a table.
BATCH_ROWS = 1024
TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
INSTALL = 'pip install "ptdp[data]"'


def is_saved_dataset(folder: Path) -> bool:
    """True if ``folder`` was written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()) or (
        folder / "dataset_dict.json"
    ).is_file()


def table_kind(path: Path) -> str | None:
    """``"parquet"``, ``"arrow"``, ``"saved_dataset"`` or None (not a table: a text or jsonl file)."""
    if path.is_dir():
        return "saved_dataset" if is_saved_dataset(path) else None
    return TABLE_SUFFIXES.get(path.suffix.lower())


def folder_stat(folder: Path) -> tuple[int, int]:
    """(total bytes, newest mtime in ns) of the files under a saved dataset's folder (stat only),
    so that the corpus fingerprint changes when any of them does."""
    size, mtime = 0, 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            st = path.stat()
            size, mtime = size + st.st_size, max(mtime, st.st_mtime_ns)
    return size, mtime


def iter_rows(path: Path, kind: str, text_key: str) -> Iterator[tuple[int, str]]:
    """(row number from 0, text) of every row of the table at ``path`` whose ``text_key`` column
    holds non-blank text, in the table's order.

    Raises:
        DataError: the extra is not installed (naming ``pip install "ptdp[data]"``), the file is
            not a readable table, the column is missing (naming the columns there) or is not text.
    """
    readers = {"parquet": _parquet_batches, "arrow": _arrow_batches, "saved_dataset": _dataset_batches}
    row = 0
    for column in readers[kind](path, text_key):
        for text in column:
            if isinstance(text, str) and text.strip():
                yield row, text
            row += 1


def _import(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs the optional {module.split('.')[0]} package: {INSTALL}") from None


def _check_column(path: Path, names: list[str], types: list, text_key: str) -> None:
    """DataError unless ``text_key`` is one of the table's columns and holds strings."""
    pa = _import("pyarrow", "Parquet and Arrow files")
    if text_key not in names:
        raise DataError(
            f"{str(path)!r} has no column {text_key!r} (its columns: {names[:12]}"
            f"{', ...' if len(names) > 12 else ''}); name the text column with --data-text-key"
        )
    kind = types[names.index(text_key)]
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or getattr(pa.types, "is_string_view", lambda _t: False)(kind)
    ):
        raise DataError(
            f"{str(path)!r}: column {text_key!r} holds {kind}, not text; name the text column with --data-text-key"
        )


def _parquet_batches(path: Path, text_key: str) -> Iterator[list]:
    pq = _import("pyarrow.parquet", f"Parquet file {str(path)!r}")
    try:
        table = pq.ParquetFile(str(path))
        schema = table.schema_arrow
    except Exception as err:
        raise DataError(f"{str(path)!r} is not a readable Parquet file: {err}") from None
    _check_column(path, schema.names, schema.types, text_key)
    for batch in table.iter_batches(batch_size=BATCH_ROWS, columns=[text_key]):
        yield batch.column(0).to_pylist()


def _arrow_batches(path: Path, text_key: str) -> Iterator[list]:
    pa = _import("pyarrow", f"Arrow file {str(path)!r}")
    source = pa.memory_map(str(path), "r")
    try:
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # not the file format: the stream format (datasets' own files)
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        schema = reader.schema
    except pa.ArrowInvalid as err:
        source.close()
        raise DataError(f"{str(path)!r} is not an Arrow IPC file or stream: {err}") from None
    try:
        _check_column(path, schema.names, schema.types, text_key)
        index = schema.names.index(text_key)
        for batch in batches:
            for start in range(0, batch.num_rows, BATCH_ROWS):
                yield batch.column(index).slice(start, BATCH_ROWS).to_pylist()
    finally:
        source.close()


def _dataset_batches(path: Path, text_key: str) -> Iterator[list]:
    datasets = _import("datasets", f"the saved dataset {str(path)!r}")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:
        raise DataError(f"{str(path)!r} is not a readable save_to_disk folder: {err}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(
                f"{str(path)!r} is a DatasetDict without a 'train' split (its splits: {sorted(loaded)}); "
                f"give the split's folder, e.g. --data {path / min(loaded)}"
            )
        loaded = loaded["train"]
    features = loaded.features
    if text_key not in features:
        raise DataError(
            f"{str(path)!r} has no column {text_key!r} (its columns: {list(features)[:12]}); name the "
            f"text column with --data-text-key"
        )
    if getattr(features[text_key], "dtype", None) not in ("string", "large_string"):
        raise DataError(
            f"{str(path)!r}: column {text_key!r} holds {features[text_key]}, not text; name the text "
            f"column with --data-text-key"
        )
    for batch in loaded.select_columns([text_key]).iter(batch_size=BATCH_ROWS):
        yield batch[text_key]
