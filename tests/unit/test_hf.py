"""Hugging Face GPT-2 conversion in one process: what cannot be imported is refused; an export carries
the tokenizer and its special ids with ordinary file modes (the round trip through (2,2,1):
tests/dist/test_hf_dist.py)."""

from __future__ import annotations

import pytest

from ptdp.run.checkpoint.folders import CheckpointError
from ptdp.run.checkpoint.hf import configs_from_hf, export_hf, import_hf

transformers = pytest.importorskip("transformers")


def test_import_rejects_what_ptdp_cannot_express(tmp_path):
    with pytest.raises(CheckpointError, match="not a Hugging Face model folder"):
        import_hf(tmp_path, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="scale_attn_by_inverse_layer_idx"):
        configs_from_hf(
            {"model_type": "gpt2", "activation_function": "gelu_new", "scale_attn_by_inverse_layer_idx": True}
        )


@pytest.mark.parametrize("llama", [False, True])
def test_export_carries_the_tokenizer_and_its_special_ids_with_ordinary_file_modes(tmp_path, llama):
    """A ptdp checkpoint with its tokenizer: config.json names the tokenizer's <|endoftext|> as
    bos/eos (not GPT-2's 50256, outside this vocabulary), the tokenizer is written for
    AutoTokenizer, and every file gets 0666 less the umask (not 0600)."""
    import os

    from ptdp.config.model import ModelConfig
    from ptdp.config.parallel import ParallelConfig
    from ptdp.config.resolve import resolve
    from ptdp.config.schema import Config, TrainConfig
    from ptdp.data.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer
    from ptdp.engine.groups import ParallelGroups
    from ptdp.engine.stage import build_stage
    from ptdp.run.checkpoint.io import save_checkpoint

    tok = train_tokenizer(["def main(x):\n    return x * 2\n" * 20, "class A:\n    pass\n" * 20], 300)
    tok_path = save_tokenizer(tok, tmp_path / "tok.json")
    options = (
        dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False)
        if llama
        else {}
    )
    model = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=tok.get_vocab_size(), **options
    )
    config = resolve(
        Config(
            model=model, parallel=ParallelConfig(1, 1, 1), train=TrainConfig(micro_batch_size=1, global_batch_size=1)
        ),
        1,
    )
    save_checkpoint(
        build_stage(config, ParallelGroups.single_process()),
        tmp_path / "ckpt",
        1,
        consumed_samples=0,
        files={"tokenizer.json": tok_path},
    )
    before = os.umask(0o022)
    try:
        out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    finally:
        os.umask(before)
    config_json = __import__("json").loads((out / "config.json").read_text())
    eos = tok.token_to_id(EOS_TOKEN)
    assert config_json["bos_token_id"] == config_json["eos_token_id"] == eos
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"], 0o644
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token_id == eos and hf_tok.decode(hf_tok("def main(x):")["input_ids"]) == "def main(x):"
    hf_config = transformers.AutoConfig.from_pretrained(out)
    assert hf_config.eos_token_id == eos and hf_config.vocab_size == tok.get_vocab_size()


@pytest.mark.parametrize("kept_config", [True, False], ids=["config-kept", "no-config"])
def test_export_of_a_run_on_another_tokenizer_names_its_own_special_tokens(tmp_path, kept_config):
    """A run on a ``--tokenizer-model`` trained elsewhere (``<s>``/``</s>``, no ``<|endoftext|>``):
    the export names that tokenizer's end-of-document token, never ptdp's ``<|endoftext|>``; the
    ``tokenizer_config.json`` the checkpoint kept from beside the tokenizer is written out as given,
    and without one, ``</s>`` (the first known end-of-document token it has) is the eos."""
    import json

    from helpers.own_tokenizer import write_tokenizer_folder
    from ptdp.config.model import ModelConfig
    from ptdp.config.parallel import ParallelConfig
    from ptdp.config.resolve import resolve
    from ptdp.config.schema import Config, TrainConfig
    from ptdp.engine.groups import ParallelGroups
    from ptdp.engine.stage import build_stage
    from ptdp.run.checkpoint.io import save_checkpoint
    from ptdp.run.trainer import tokenizer_files

    folder = write_tokenizer_folder(tmp_path / "tok", eos_token="</s>" if kept_config else None)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    files = tokenizer_files(type("Data", (), {"tokenizer_path": folder / "tokenizer.json"})(), str(folder))
    assert ("tokenizer_config.json" in files) == kept_config
    model = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=len(tok))
    config = resolve(
        Config(
            model=model, parallel=ParallelConfig(1, 1, 1), train=TrainConfig(micro_batch_size=1, global_batch_size=1)
        ),
        1,
    )
    stage = build_stage(config, ParallelGroups.single_process())
    save_checkpoint(stage, tmp_path / "ckpt", 1, consumed_samples=0, files=files)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|endoftext|>" not in json.dumps(written)
    assert written["eos_token"] == "</s>"
    if kept_config:
        assert written == json.loads((folder / "tokenizer_config.json").read_text())
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["eos_token_id"] == tok.convert_tokens_to_ids("</s>") == 2
    assert config_json["bos_token_id"] == (1 if kept_config else None)
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == 2
