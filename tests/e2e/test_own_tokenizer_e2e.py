"""Continued pre-training of an imported model with its own tokenizer on Parquet data:
``ptdp convert from-hf`` of a GPT-2 folder holding a tokenizer trained elsewhere, then ``ptdp train
--load ... --tokenizer-model ... --data rows.parquet`` at tp = 2 (a vocabulary of 300 padded to 512).

The validation loss before the first step equals transformers' loss of the same model on the same
windows (float64, 1e-9): the imported weights, the given tokenizer's ids and the padded vocabulary
all line up. Everything is built locally, without a network."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from helpers.cli import run, tiny_flags
from helpers.own_tokenizer import write_tokenizer_folder
from helpers.texts import make_texts
from ptdp import cli
from ptdp.data.dataset import TokenWindows, eval_indices
from ptdp.data.indexed import IndexedTokens

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SEQ, HIDDEN, LAYERS, HEADS, VOCAB = 32, 32, 2, 4, 300


def _gpt2(folder) -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.slow
def test_convert_from_hf_then_continue_pre_training_with_its_tokenizer(tmp_path, capsys):
    hf = write_tokenizer_folder(tmp_path / "hf", vocab_size=VOCAB)
    reference = _gpt2(hf)
    imported = tmp_path / "imported"
    assert cli.main(["convert", "from-hf", str(hf), str(imported)]) == 0
    hint = capsys.readouterr().out.splitlines()[-1].split()  # the command that continues, with its tokenizer
    start = hint.index("train") + 1
    assert hint[start : start + 2] == ["--load", str(imported)] and hint[-2:] == ["--tokenizer-model", str(hf)]
    model_flags = hint[start + 2 : hint.index("--data")]
    assert model_flags[:2] == ["--num-layers", str(LAYERS)] and "gelu_tanh" in model_flags
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": make_texts(seed=11, n_docs=40)}), rows)
    flags = tiny_flags(
        num_layers=None,
        hidden_size=None,
        num_attention_heads=None,
        seq_length=None,
        vocab_size=None,
        train_iters=2,
        eval_interval=2,
        log_interval=1,
        lr_warmup_iters=0,
        no_progress=True,
    )
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *flags,
            *model_flags,
            "--tp",
            "2",
            "--pp",
            "1",
            "--nproc-per-node",
            "2",
            "--params-dtype",
            "float64",
            "--load",
            str(imported),
            "--tokenizer-model",
            str(hf),
            "--data",
            str(rows),
            "--save",
            str(tmp_path / "ckpt"),
            "--output-dir",
            str(tmp_path / "run"),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["data"]["tokenizer_model"] == str(hf) and record["model"]["vocab_size"] == VOCAB
    saved = max((tmp_path / "ckpt").glob("iter_*")) / "tokenizer.json"
    assert saved.read_bytes() == (hf / "tokenizer.json").read_bytes()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in lines if "val_loss" in r]
    windows = TokenWindows(IndexedTokens(f"{record['prepared_data']['cache_dir']}/valid"), SEQ)
    (batch,) = eval_indices(len(windows), 8, 1)
    samples = torch.from_numpy(np.stack([windows[int(i)] for i in batch]))
    with torch.no_grad():
        logits = reference.double()(samples[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), samples[:, 1:].reshape(-1))
    torch.testing.assert_close(torch.tensor(val[0], dtype=torch.float64), expected, rtol=1e-9, atol=0)
    assert len(val) == 2 and all(np.isfinite([r["loss"] for r in lines if "loss" in r]))
