"""Corpus discovery: order, formats, skipping, errors, fingerprint."""

import json
import os
import warnings
from pathlib import Path

import pytest

from ptdp.data.corpus import (
    DEFAULT_SUFFIXES,
    corpus_fingerprint,
    default_corpus_paths,
    iter_documents,
    list_corpus_files,
)
from ptdp.errors import DataError


def _tree(root: Path) -> Path:
    (root / "b").mkdir(parents=True)
    (root / "a").mkdir()
    (root / "a" / "z.txt").write_text("zeta text")
    (root / "a" / "y.md").write_text("# why")
    (root / "b" / "x.py").write_text("print('x')\n")
    (root / "c.jsonl").write_text(
        json.dumps({"text": "line one"}) + "\n\n" + json.dumps({"text": "line three", "id": 3}) + "\n"
    )
    for skipped in (".hidden", "__pycache__", "site-packages", "dist-packages"):
        (root / skipped).mkdir()
        (root / skipped / "s.txt").write_text("must not be read")
    (root / ".dotfile.txt").write_text("must not be read")
    (root / "img.png").write_bytes(b"\x89PNG\r\n")
    (root / "blank.txt").write_text("  \n\t\n")
    return root


def test_documents_sorted_and_formats(tmp_path):
    root = _tree(tmp_path / "corpus")
    docs = list(iter_documents([root]))
    assert [d.doc_id for d in docs] == [
        "corpus/a/y.md",
        "corpus/a/z.txt",
        "corpus/b/x.py",
        "corpus/c.jsonl:1",
        "corpus/c.jsonl:3",
    ]
    assert docs[0].text == "# why" and docs[-1].text == "line three"
    assert docs == list(iter_documents(str(root)))  # deterministic; a single str path works too


def test_file_path_and_suffix_filter(tmp_path):
    root = _tree(tmp_path / "corpus")
    docs = list(iter_documents([root / "a" / "z.txt", root], suffixes=[".py"]))
    assert [d.doc_id for d in docs] == ["corpus/b/x.py"]  # z.txt filtered by suffix too
    docs = list(iter_documents([root / "a" / "z.txt"]))
    assert [(d.doc_id, d.text) for d in docs] == [("z.txt", "zeta text")]


def test_missing_path_raises(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="nope"):
        iter_documents([missing])
    with pytest.raises(DataError, match="nope"):
        corpus_fingerprint([missing])


def test_empty_folder_raises_naming_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no usable documents.*empty"):
        list(iter_documents([tmp_path / "empty"]))


def test_binary_and_non_utf8_skipped_with_warning(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "bin.dat2").write_bytes(b"abc\x00def")
    (root / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "ok.txt").write_text("fine")
    with pytest.warns(UserWarning) as record:
        docs = list(iter_documents([root]))
    assert [d.doc_id for d in docs] == ["c/ok.txt"]
    messages = " ".join(str(w.message) for w in record)
    assert "bin.dat2" in messages and "NUL" in messages
    assert "latin.txt" in messages and "UTF-8" in messages
    os.remove(root / "ok.txt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DataError, match="no usable documents"):
            list(iter_documents([root]))


def test_bad_jsonl_raises_with_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match="line 2.*'text'"):
        list(iter_documents([bad]))
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match="line 2.*JSON"):
        list(iter_documents([bad]))


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('{"text": 5}', "got 'text' holding a JSON number (5)"),
        ('{"text": null}', "got 'text' holding a JSON null"),
        ('{"text": ["a"]}', "got 'text' holding a JSON array"),
        ("[1, 2]", "got a JSON array"),
        ('"just a string"', "got a JSON string"),
        ('{"body": "x"}', "got an object without it (keys ['body'])"),
    ],
)
def test_bad_jsonl_record_says_what_it_holds(tmp_path, line, said):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    with pytest.raises(DataError) as info:
        list(iter_documents([bad]))
    assert said in str(info.value)


def test_fingerprint_tracks_files(tmp_path):
    root = _tree(tmp_path / "corpus")
    fp = corpus_fingerprint([root])
    assert fp == corpus_fingerprint([root])
    assert fp != corpus_fingerprint([root], suffixes=[".py"])
    (root / "a" / "z.txt").write_text("zeta text, edited")
    fp2 = corpus_fingerprint([root])
    assert fp2 != fp
    (root / "a" / "new.txt").write_text("new")
    assert corpus_fingerprint([root]) != fp2
    (root / "__pycache__" / "more.txt").write_text("ignored dirs do not count")
    assert corpus_fingerprint([root]) == corpus_fingerprint([root])


def test_default_corpus_is_stdlib_py():
    (stdlib,) = default_corpus_paths()
    assert (stdlib / "os.py").is_file()
    files = list_corpus_files([stdlib], DEFAULT_SUFFIXES)
    assert len(files) > 500
    assert all(f.path.suffix == ".py" for f in files)
    assert not any("site-packages" in f.path.parts for f in files)


def test_jsonl_line_with_unicode_line_separators(tmp_path):
    """A record whose text holds U+2028/U+2029/U+0085 (written unescaped by
    json.dumps(ensure_ascii=False)) is one line of JSON Lines, not several."""
    import json as _json

    from ptdp.data.corpus import iter_documents

    path = tmp_path / "docs.jsonl"
    texts = ["first\u2028still first", "second\u2029para\x85end", "third"]
    path.write_text("".join(_json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert [d.text for d in iter_documents([path])] == texts
