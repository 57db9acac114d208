"""Byte-level BPE tokenizer: determinism (in and across processes), round trip, EOS handling."""

import pytest

from helpers.texts import make_texts
from ptdp.data.tokenizer import (
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    encode_documents,
    eos_id,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)
from ptdp.errors import DataError


def test_training_is_deterministic_in_process():
    texts = make_texts()
    a = train_tokenizer(texts, 400)
    b = train_tokenizer(texts, 400)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 400
    assert train_tokenizer(texts, 450).to_str() != a.to_str()


def test_round_trip_and_eos(tmp_path):
    tok = train_tokenizer(make_texts(), 400)
    assert eos_id(tok) == 0 and tok.id_to_token(0) == EOS_TOKEN
    sample = "def f(x):\n    return x  # ünïcødé, émoji 🚀, tabs\t and CRLF\r\n" + EOS_TOKEN
    (ids,) = encode_documents(tok, [sample])
    assert ids[-1] == 0 and 0 not in ids[:-1]  # the literal EOS string is encoded as text
    assert tok.decode(ids[:-1].tolist()) == sample
    path = save_tokenizer(tok, tmp_path / "tok.json")
    again = load_tokenizer(path)
    assert again.to_str() == tok.to_str()
    assert encode_documents(again, [sample])[0].tolist() == ids.tolist()


def test_bad_vocab_size_and_files(tmp_path):
    with pytest.raises(DataError, match="257"):
        train_tokenizer(["abc"], 257)
    assert MIN_VOCAB_SIZE == 258
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(DataError, match="junk.json"):
        load_tokenizer(tmp_path / "junk.json")
