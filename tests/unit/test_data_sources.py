"""``--data`` from tables (Parquet, Arrow file and stream, ``datasets`` ``save_to_disk`` folders),
``--data-text-key``, the ``[data]`` extra's error, and encoding in worker processes giving the same
token files as the serial path. Every input is built here, without a network."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import ptdp.data.prepare as prepare_mod
from helpers.texts import make_texts
from ptdp.data.corpus import iter_documents
from ptdp.data.encode import AUTO_MAX_WORKERS, PARALLEL_MIN_BYTES, worker_count
from ptdp.data.prepare import prepare_data
from ptdp.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

TEXTS = make_texts(seed=5, n_docs=24)
#: A table's rows: the texts, with a blank and a null row (skipped) and another column.
ROWS = {"body": TEXTS[:10] + ["   ", None] + TEXTS[10:], "n": list(range(len(TEXTS) + 2))}
EXPECTED = [(row, text) for row, text in enumerate(ROWS["body"]) if text and text.strip()]


def _table(batch_rows: int = 5):
    return pa.Table.from_pydict(ROWS).combine_chunks().to_batches(max_chunksize=batch_rows)


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, Path]:
    """One input of each kind holding ``ROWS``, the text in column ``body``."""
    root = tmp_path_factory.mktemp("tables")
    paths = {
        "parquet": root / "rows.parquet",
        "arrow_file": root / "file.arrow",
        "arrow_stream": root / "stream.arrow",
        "saved": root / "saved",
        "saved_dict": root / "saved_dict",
        "folder": root / "folder",
    }
    pq.write_table(pa.Table.from_pydict(ROWS), paths["parquet"], row_group_size=7)
    schema = _table()[0].schema
    with pa.ipc.new_file(str(paths["arrow_file"]), schema) as writer:
        for batch in _table():
            writer.write_batch(batch)
    with pa.ipc.new_stream(str(paths["arrow_stream"]), schema) as writer:
        for batch in _table(3):
            writer.write_batch(batch)
    dataset = datasets.Dataset.from_dict(ROWS)
    dataset.save_to_disk(str(paths["saved"]))
    datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(str(paths["saved_dict"]))
    paths["folder"].mkdir()
    pq.write_table(pa.Table.from_pydict({k: v[:12] for k, v in ROWS.items()}), paths["folder"] / "a.parquet")
    pq.write_table(pa.Table.from_pydict({k: v[12:] for k, v in ROWS.items()}), paths["folder"] / "b.parquet")
    return paths


@pytest.mark.parametrize("kind", ["parquet", "arrow_file", "arrow_stream", "saved", "saved_dict"])
def test_every_row_with_text_is_one_document(tables, kind):
    """Rows in order, blank and null ones skipped, ids ``<name>:<row>``; the dict's train split."""
    path = tables[kind]
    docs = list(iter_documents([path], text_key="body"))
    assert [(d.doc_id, d.text) for d in docs] == [(f"{path.name}:{row}", text) for row, text in EXPECTED]


def test_a_folder_of_tables_and_a_folder_holding_a_saved_dataset(tables, tmp_path):
    """Files of a folder in name order; a save_to_disk folder inside a folder is one table, its
    json and arrow files are not read as documents of their own."""
    docs = list(iter_documents([tables["folder"]], text_key="body"))
    assert [d.text for d in docs] == [text for _, text in EXPECTED]
    assert docs[0].doc_id == "folder/a.parquet:0" and docs[-1].doc_id.startswith("folder/b.parquet:")
    outer = tmp_path / "outer"
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(outer / "inner"))
    (outer / "notes.txt").write_text("a note")
    docs = list(iter_documents([outer], text_key="body"))
    assert [d.doc_id for d in docs] == [f"outer/inner:{row}" for row, _ in EXPECTED] + ["outer/notes.txt"]


def test_text_key_errors_name_the_file_and_the_columns(tables, tmp_path):
    for kind in ("parquet", "arrow_stream", "saved"):
        with pytest.raises(DataError, match=r"has no column 'text' \(its columns: \['body', 'n'\]\).*--data-text-key"):
            list(iter_documents([tables[kind]]))
        with pytest.raises(DataError, match="column 'n' holds .*not text"):
            list(iter_documents([tables[kind]], text_key="n"))
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps({"body": "some text"}) + "\n" + json.dumps({"body": "more text"}) + "\n")
    assert [d.text for d in iter_documents([lines], text_key="body")] == ["some text", "more text"]
    with pytest.raises(DataError, match="string 'text' field"):
        list(iter_documents([lines]))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="is not a readable Parquet file"):
        list(iter_documents([bad]))
    only_test = tmp_path / "only_test"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(ROWS)}).save_to_disk(str(only_test))
    with pytest.raises(DataError, match=r"without a 'train' split \(its splits: \['test'\]\)"):
        list(iter_documents([only_test], text_key="body"))


@pytest.mark.parametrize("module, kind", [("pyarrow", "parquet"), ("pyarrow", "arrow_file"), ("datasets", "saved")])
def test_without_the_extra_the_error_says_how_to_install_it(tables, monkeypatch, module, kind):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, f"{module}.parquet", None)
    with pytest.raises(DataError, match=rf'needs the optional {module} package: pip install "ptdp\[data\]"'):
        list(iter_documents([tables[kind]], text_key="body"))


def test_parquet_data_is_prepared_and_another_text_key_re_tokenizes(tmp_path):
    path = tmp_path / "two.parquet"
    pq.write_table(pa.Table.from_pydict({"body": TEXTS, "alt": TEXTS[:12] + [None] * 12}), path)
    body = prepare_data([path], 300, tmp_path / "cache", valid_fraction=0.2, log=None, text_key="body")
    alt = prepare_data([path], 300, tmp_path / "cache", valid_fraction=0.2, log=None, text_key="alt")
    assert body.num_train_docs + body.num_valid_docs == 24 and alt.num_train_docs + alt.num_valid_docs == 12
    assert body.cache_dir != alt.cache_dir
    assert json.loads((alt.cache_dir / "meta.json").read_text())["text_key"] == "alt"


def test_worker_processes_write_the_serial_path_s_files(tmp_path, monkeypatch):
    """Two worker processes, many small chunks (several in flight at once): the same .bin, .idx and
    tokenizer bytes as the serial path."""
    monkeypatch.setattr(prepare_mod, "ENCODE_CHUNK_CHARS", 3000)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts(seed=9, n_docs=80)))
    serial = prepare_data([texts], 320, tmp_path / "serial", log=None, workers=1)
    monkeypatch.setattr(prepare_mod, "worker_count", lambda requested, size: 2)
    parallel = prepare_data([texts], 320, tmp_path / "parallel", log=None)
    assert serial.num_train_docs > 40 and serial.cache_dir.name == parallel.cache_dir.name
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx", "tokenizer.json"):
        assert (parallel.cache_dir / name).read_bytes() == (serial.cache_dir / name).read_bytes(), name


def test_worker_count():
    assert worker_count(3, 0) == 3 and worker_count(None, PARALLEL_MIN_BYTES - 1) == 1
    assert 1 <= worker_count(None, PARALLEL_MIN_BYTES) <= AUTO_MAX_WORKERS
    for bad in (0, -2, True, 1.5):
        with pytest.raises(DataError, match="--tokenizer-workers must be an integer >= 1"):
            worker_count(bad, 0)


def test_progress_bars_count_the_documents(tmp_path, monkeypatch):
    """Scanning and encoding each show a bar of documents (shown on a terminal only: disable=None),
    none with progress=False."""
    bars = []

    class Bar:
        def __init__(self, iterable=None, **kwargs):
            self.iterable, self.kwargs, self.n = iterable, kwargs, 0
            bars.append(self)

        def __iter__(self):
            for item in self.iterable:
                self.n += 1
                yield item

        def update(self, n):
            self.n += n

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(prepare_mod, "tqdm", Bar)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts(seed=2, n_docs=20)))
    prepare_data([texts], 300, tmp_path / "on", log=None)
    assert [(b.kwargs["desc"], b.n, b.kwargs["disable"]) for b in bars] == [
        ("[data] scanning", 20, None),
        ("[data] tokenizing", 20, None),
    ]
    assert bars[1].kwargs["total"] == 20
    bars.clear()
    prepare_data([texts], 300, tmp_path / "off", log=None, progress=False)
    assert [b.kwargs["disable"] for b in bars] == [True, True]


def test_a_saved_dataset_saved_again_with_other_rows_re_tokenizes(tmp_path):
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS[:12]}).save_to_disk(str(folder))
    first = prepare_data([folder], 300, tmp_path / "cache", valid_fraction=0.2, log=None)
    assert prepare_data([folder], 300, tmp_path / "cache", valid_fraction=0.2, log=None) == first  # cached
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "staged"))
    shutil.rmtree(folder)
    shutil.move(tmp_path / "staged", folder)
    again = prepare_data([folder], 300, tmp_path / "cache", valid_fraction=0.2, log=None)
    assert again.cache_dir != first.cache_dir and again.num_train_docs + again.num_valid_docs == 24
