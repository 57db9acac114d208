"""Byte-level BPE tokenizer: a fresh process (new hash-map seeds, 1 or 2 threads) trains
byte-identical JSON (in one process: tests/unit/test_data_tokenizer.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import budget
from helpers.texts import make_texts
from ptdp.data.tokenizer import train_tokenizer


def test_training_is_deterministic_across_processes(tmp_path):
    """A fresh process (new hash-map seeds, 1 or 2 threads) trains byte-identical JSON."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parents[1])!r})
        from helpers.texts import make_texts
        from ptdp.data.tokenizer import train_tokenizer
        print(train_tokenizer(make_texts(), 400).to_str())
    """)
    expected = train_tokenizer(make_texts(), 400).to_str()
    for threads in ("1", "2"):
        env = {**__import__("os").environ, "RAYON_NUM_THREADS": threads}
        out = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=budget.seconds(),
        )
        assert out.stdout.strip() == expected
