"""Hugging Face GPT-2 round trip: a random local GPT2LMHeadModel -> ptdp checkpoint -> (2,2,1)
logits equal transformers' -> export -> from_pretrained gives identical tensors."""

from __future__ import annotations

import pytest
import torch

from helpers.dist_helpers import run_in_pool
from helpers.hf_helpers import tp2_pp2_logits_worker
from ptdp.run.checkpoint.hf import export_hf, import_hf

transformers = pytest.importorskip("transformers")


SEQ, HIDDEN, VOCAB = 16, 32, 303  # vocabulary not divisible by tp = 2


def random_gpt2(path) -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=HIDDEN,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorms too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_gpt2_import_logits_and_export_round_trip(tmp_path):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "exported"
    reference = random_gpt2(hf_dir)
    import_hf(hf_dir, ckpt)
    import json

    results = run_in_pool(
        tp2_pp2_logits_worker, 4, str(ckpt), json.loads((hf_dir / "config.json").read_text()), tokens(), VOCAB
    )
    with torch.no_grad():
        expected = reference(tokens()).logits
    for logits in results[2:]:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    export_hf(ckpt, out)
    again = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    theirs, ours = reference.state_dict(), again.state_dict()
    assert set(theirs) == set(ours)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
