"""Hugging Face GPT-2 round trip: a random local GPT2LMHeadModel -> ptdp checkpoint -> (2,2,1)
logits equal transformers' -> export -> from_pretrained gives identical tensors."""

from __future__ import annotations

import pytest
import torch

from ptdp.run.checkpoint.hf import export_hf, import_hf, model_config_from_hf
from ptdp.run.checkpoint.folders import CheckpointError
from dist_helpers import run_workers
from hf_helpers import tp2_pp2_logits_worker

transformers = pytest.importorskip("transformers")

SEQ, HIDDEN, VOCAB = 16, 32, 303  # vocabulary not divisible by tp = 2


def random_gpt2(path) -> "transformers.GPT2LMHeadModel":
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=4, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
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

    results = run_workers(tp2_pp2_logits_worker, 4, str(ckpt), json.loads((hf_dir / "config.json").read_text()),
                          tokens(), VOCAB)
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


def test_import_rejects_what_ptdp_cannot_express(tmp_path):
    with pytest.raises(CheckpointError, match="not a Hugging Face model folder"):
        import_hf(tmp_path, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="scale_attn_by_inverse_layer_idx"):
        model_config_from_hf({"model_type": "gpt2", "activation_function": "gelu_new",
                              "scale_attn_by_inverse_layer_idx": True})


@pytest.mark.parametrize("llama", [False, True])
def test_export_carries_the_tokenizer_and_its_special_ids_with_ordinary_file_modes(tmp_path, llama):
    """A ptdp checkpoint with its tokenizer: config.json names the tokenizer's <|endoftext|> as
    bos/eos (not GPT-2's 50256, outside this vocabulary), the tokenizer is written for
    AutoTokenizer, and every file gets 0666 less the umask (not 0600)."""
    import os

    from ptdp.run.checkpoint.io import save_checkpoint
    from ptdp.spec import Config, ModelConfig, ParallelConfig, TrainConfig, resolve
    from ptdp.data.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer
    from ptdp.engine.groups import ParallelGroups
    from ptdp.engine.step import build_stage

    tok = train_tokenizer(["def main(x):\n    return x * 2\n" * 20, "class A:\n    pass\n" * 20], 300)
    tok_path = save_tokenizer(tok, tmp_path / "tok.json")
    options = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                   add_bias_linear=False) if llama else {}
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=tok.get_vocab_size(), **options)
    config = resolve(Config(model=model, parallel=ParallelConfig(1, 1, 1),
                            train=TrainConfig(micro_batch_size=1, global_batch_size=1)), 1)
    save_checkpoint(build_stage(config, ParallelGroups.single_process()), tmp_path / "ckpt", 1, consumed_samples=0,
                    files={"tokenizer.json": tok_path})
    before = os.umask(0o022)
    try:
        out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    finally:
        os.umask(before)
    config_json = __import__("json").loads((out / "config.json").read_text())
    eos = tok.token_to_id(EOS_TOKEN)
    assert config_json["bos_token_id"] == config_json["eos_token_id"] == eos
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"]
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"], 0o644)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token_id == eos and hf_tok.decode(hf_tok("def main(x):")["input_ids"]) == "def main(x):"
    hf_config = transformers.AutoConfig.from_pretrained(out)
    assert hf_config.eos_token_id == eos and hf_config.vocab_size == tok.get_vocab_size()
