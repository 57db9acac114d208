"""prepare_data: determinism, caching, split disjointness, concurrency, errors."""

import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ptdp.data.prepare as prepare_mod
from ptdp.data.corpus import iter_documents
from ptdp.data.indexed import IndexedTokens
from ptdp.data.prepare import prepare_data
from ptdp.data.prepared_data import PreparedData
from ptdp.data.split import assign_splits
from ptdp.errors import DataError


def write_corpus(root: Path, n_docs: int = 80, seed: int = 0) -> Path:
    """~150 KB of code-like text in nested folders, plus one jsonl file and one duplicate."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlu_") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    for i in range(n_docs):
        lines = [
            f"def f{i}_{j}({rng.choice(words)}):\n    return "
            + " + ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
            for j in range(rng.randint(10, 40))
        ]
        path = root / f"pkg{i % 4}" / f"mod{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    with open(root / "extra.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(50)) + f" #{i}"}) + "\n")
    (root / "pkg0" / "zz_copy.py").write_text((root / "pkg0" / "mod000.py").read_text())
    return root


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "src")


@pytest.fixture(scope="module")
def prepared(code_corpus, tmp_path_factory):
    return prepare_data([code_corpus], 400, tmp_path_factory.mktemp("cache"), valid_fraction=0.1, log=None)


def _decoded_docs(data: PreparedData, prefix: Path) -> list[str]:
    tok, idx = data.tokenizer(), IndexedTokens(prefix)
    docs = []
    for i in range(idx.num_docs):
        ids = idx.doc(i)
        assert ids[-1] == data.eos_id and data.eos_id not in ids[:-1]
        docs.append(tok.decode(ids[:-1].tolist()))
    return docs


def test_counts_and_contents(prepared, code_corpus):
    meta = json.loads((prepared.cache_dir / "meta.json").read_text())
    assert prepared.vocab_size == 400 and prepared.eos_id == 0
    assert prepared.num_train_docs > 0 and prepared.num_valid_docs > 0
    assert meta["duplicates_dropped"] == 1
    train, valid = prepared.train_tokens(), prepared.valid_tokens()
    assert (train.num_docs, train.num_tokens) == (prepared.num_train_docs, prepared.num_train_tokens)
    assert (valid.num_docs, valid.num_tokens) == (prepared.num_valid_docs, prepared.num_valid_tokens)
    assert train.tokens.dtype == np.uint16
    all_texts = {d.text for d in iter_documents([code_corpus])}
    decoded = _decoded_docs(prepared, prepared.train_prefix) + _decoded_docs(prepared, prepared.valid_prefix)
    assert set(decoded) == all_texts and len(decoded) == len(all_texts)  # every unique doc, once


def test_train_and_valid_disjoint(prepared, code_corpus):
    train = _decoded_docs(prepared, prepared.train_prefix)
    valid = _decoded_docs(prepared, prepared.valid_prefix)
    assert train and valid
    assert not set(train) & set(valid)  # by content
    docs = list(iter_documents([code_corpus]))
    by_text: dict[str, str] = {}
    for d in docs:
        by_text.setdefault(d.text, d.doc_id)  # the first copy is the one kept
    train_ids = {by_text[t] for t in train}
    valid_ids = {by_text[t] for t in valid}
    assert not train_ids & valid_ids  # by document id
    assert "src/pkg0/zz_copy.py" not in train_ids | valid_ids  # the duplicate was dropped


def test_cached_and_deterministic(prepared, code_corpus, tmp_path):
    meta = prepared.cache_dir / "meta.json"
    mtime = meta.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = prepare_data([code_corpus], 400, prepared.cache_dir.parent, valid_fraction=0.1, log=None)
    assert time.perf_counter() - t0 < 1.0
    assert again == prepared and meta.stat().st_mtime_ns == mtime
    assert PreparedData.load(prepared.cache_dir) == prepared
    assert prepare_data(str(code_corpus), 400, prepared.cache_dir.parent, valid_fraction=0.1, log=None) == prepared
    fresh = prepare_data([code_corpus], 400, tmp_path / "other-cache", valid_fraction=0.1, log=None)
    assert fresh.cache_dir.name == prepared.cache_dir.name  # same key
    for name in ("tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert (fresh.cache_dir / name).read_bytes() == (prepared.cache_dir / name).read_bytes(), name


def test_settings_and_edits_change_key(prepared, code_corpus, tmp_path):
    cache = prepared.cache_dir.parent
    other_vocab = prepare_data([code_corpus], 420, cache, valid_fraction=0.1, log=None)
    assert other_vocab.cache_dir != prepared.cache_dir and other_vocab.vocab_size == 420
    copy = write_corpus(tmp_path / "src", n_docs=10)
    a = prepare_data([copy], 300, cache, valid_fraction=0.1, log=None)
    (copy / "pkg1" / "new.py").write_text("x = 1\n")
    b = prepare_data([copy], 300, cache, valid_fraction=0.1, log=None)
    assert a.cache_dir != b.cache_dir and b.num_train_docs + b.num_valid_docs == a.num_train_docs + a.num_valid_docs + 1


def test_concurrent_prepare_uses_winner(code_corpus, tmp_path, monkeypatch):
    """Two builders finish together; one rename wins, the other adopts the winner's folder."""
    barrier = threading.Barrier(2, timeout=60)
    real_build = prepare_mod._build

    def slow_build(*args, **kwargs):
        real_build(*args, **kwargs)
        barrier.wait()

    monkeypatch.setattr(prepare_mod, "_build", slow_build)
    results, logs = [None, None], []
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, prepare_data([code_corpus], 300, tmp_path, valid_fraction=0.1, log=logs.append)
            )
        )
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] and results[0] is not None
    assert any("another process" in line for line in logs)
    assert [p.name for p in tmp_path.iterdir()] == [results[0].cache_dir.name]  # temp dirs removed


def test_split_guarantees():
    ids = [f"doc{i}" for i in range(2)]
    for frac in (1e-9, 0.5, 0.999999):
        split = assign_splits(ids, frac)
        assert any(split) and not all(split)
    with pytest.raises(DataError, match="at least 2 documents"):
        assign_splits(["only"], 0.5)
    many = [f"d{i}" for i in range(5000)]
    assert 0.08 < sum(assign_splits(many, 0.1)) / 5000 < 0.12
    assert assign_splits(many, 0.1) == assign_splits(list(many), 0.1)


def test_bad_inputs(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("just one document")
    with pytest.raises(DataError, match="at least 2 documents"):
        prepare_data([one], 300, tmp_path / "cache", log=None)
    with pytest.raises(DataError, match="missing"):
        prepare_data([tmp_path / "missing"], 300, tmp_path / "cache", log=None)
    with pytest.raises(DataError, match="vocab_size=100"):
        prepare_data([one], 100, tmp_path / "cache", log=None)
    with pytest.raises(DataError, match="valid_fraction"):
        prepare_data([one], 300, tmp_path / "cache", valid_fraction=1.5, log=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no usable documents"):
        prepare_data([tmp_path / "empty"], 300, tmp_path / "cache", log=None)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # failed builds leave nothing
    with pytest.raises(DataError, match="meta.json"):
        PreparedData.load(tmp_path / "cache")
