"""Token files: round trip, dtype choice, corruption detection, pickling."""

import pickle

import numpy as np
import pytest

from ptdp.data.indexed import IndexedTokens, token_dtype, write_indexed
from ptdp.errors import DataError


def _docs(rng, n=20, vmax=1000):
    return [rng.integers(0, vmax, size=rng.integers(1, 50)) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = _docs(rng, vmax=70000 if dtype == np.uint32 else 1000)
    assert write_indexed(tmp_path / "t", iter(docs), dtype) == (len(docs), sum(map(len, docs)))
    idx = IndexedTokens(tmp_path / "t")
    assert idx.num_docs == len(docs) and idx.num_tokens == sum(len(d) for d in docs)
    assert idx.tokens.dtype == dtype
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(idx.doc(i), d)
    np.testing.assert_array_equal(idx.tokens, np.concatenate(docs))
    with pytest.raises(IndexError):
        idx.doc(len(docs))
    clone = pickle.loads(pickle.dumps(idx))
    assert len(pickle.dumps(idx)) < 500  # by path, not by content
    np.testing.assert_array_equal(clone.tokens, idx.tokens)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.idx"]  # no temp files left


def test_token_dtype():
    assert token_dtype(4096) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_ids_out_of_range_and_failed_write(tmp_path):
    def gen():
        yield np.array([1, 2, 3])
        yield np.array([70000])

    with pytest.raises(DataError, match="70000.*uint16"):
        write_indexed(tmp_path / "t", gen(), np.uint16)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_corrupt_files_raise(tmp_path):
    docs = [np.arange(10), np.arange(5)]
    write_indexed(tmp_path / "t", docs, np.uint16)
    idx_path, bin_path = tmp_path / "t.idx", tmp_path / "t.bin"
    good_idx, good_bin = idx_path.read_bytes(), bin_path.read_bytes()

    idx_path.write_bytes(good_idx[:-3])
    with pytest.raises(DataError, match="t.idx.*truncated"):
        IndexedTokens(tmp_path / "t")
    idx_path.write_bytes(good_idx[:10])
    with pytest.raises(DataError, match="t.idx.*truncated"):
        IndexedTokens(tmp_path / "t")
    idx_path.write_bytes(b"NOTMAGIC" + good_idx[8:])
    with pytest.raises(DataError, match="t.idx.*magic"):
        IndexedTokens(tmp_path / "t")
    idx_path.write_bytes(good_idx[:8] + (99).to_bytes(4, "little") + good_idx[12:])
    with pytest.raises(DataError, match="t.idx.*version 99"):
        IndexedTokens(tmp_path / "t")
    idx_path.write_bytes(good_idx)
    bin_path.write_bytes(good_bin[:-2])
    with pytest.raises(DataError, match="t.bin.*truncated"):
        IndexedTokens(tmp_path / "t")
    bin_path.write_bytes(good_bin)
    assert IndexedTokens(tmp_path / "t").num_tokens == 15
    with pytest.raises(DataError, match="does not exist"):
        IndexedTokens(tmp_path / "other")


def test_empty_stream(tmp_path):
    write_indexed(tmp_path / "e", [], np.uint16)
    idx = IndexedTokens(tmp_path / "e")
    assert idx.num_docs == 0 and idx.num_tokens == 0 and idx.tokens.shape == (0,)
