"""Byte-level BPE tokenizer: determinism (in and across processes), round trip, EOS handling."""

import random
import subprocess
import sys
import textwrap

import pytest

import budget

from ptdp.data import DataError, EOS_TOKEN, load_tokenizer, save_tokenizer, train_tokenizer
from ptdp.data.tokenizer import MIN_VOCAB_SIZE, encode_documents, eos_id


def make_texts(seed: int = 0, n_docs: int = 60) -> list[str]:
    """Deterministic code-like text, ~60 KB."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnop_") for _ in range(rng.randint(2, 9))) for _ in range(300)]
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(rng.randint(10, 40)):
            indent = "    " * rng.randint(0, 3)
            lines.append(indent + " ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) + ":")
        docs.append("\n".join(lines) + "\n")
    return docs


def test_training_is_deterministic_in_process():
    texts = make_texts()
    a = train_tokenizer(texts, 400)
    b = train_tokenizer(texts, 400)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 400
    assert train_tokenizer(texts, 450).to_str() != a.to_str()


def test_training_is_deterministic_across_processes(tmp_path):
    """A fresh process (new hash-map seeds, 1 or 2 threads) trains byte-identical JSON."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from test_data_tokenizer import make_texts
        from ptdp.data.tokenizer import train_tokenizer
        print(train_tokenizer(make_texts(), 400).to_str())
    """)
    expected = train_tokenizer(make_texts(), 400).to_str()
    for threads in ("1", "2"):
        env = {**__import__("os").environ, "RAYON_NUM_THREADS": threads}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             check=True, timeout=budget.seconds())
        assert out.stdout.strip() == expected


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
