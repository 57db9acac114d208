"""``--tokenizer-model``: a tokenizer trained elsewhere is used as given (never retrained), its
content hash keys the data cache, and a bad path stops ``ptdp train`` with exit 2 naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.cli import tiny_flags
from helpers.own_tokenizer import build_tokenizer, write_tokenizer_folder
from helpers.texts import make_texts
from ptdp import cli
from ptdp.data.indexed import IndexedTokens
from ptdp.data.prepare import prepare_data
from ptdp.data.tokenizer import load_tokenizer_model
from ptdp.errors import DataError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in make_texts(seed=3, n_docs=30))
    return root / "docs.jsonl"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tokenizer_folder(tmp_path_factory.mktemp("tok") / "model")


def test_given_tokenizer_is_used_as_is(corpus, folder, tmp_path):
    """Token files hold exactly the given tokenizer's ids of each document (no <s> its post-processor
    would add) followed by </s>; the cache holds the file byte for byte; --vocab-size is not used."""
    data = prepare_data([corpus], 100, tmp_path, valid_fraction=0.2, log=None, tokenizer_model=folder)
    reference = build_tokenizer()
    assert (data.cache_dir / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert data.vocab_size == reference.get_vocab_size() == 300
    assert (data.eos_token, data.eos_id) == ("</s>", 2)
    texts = {json.dumps(t) for t in make_texts(seed=3, n_docs=30)}
    seen = 0
    for prefix in (data.train_prefix, data.valid_prefix):
        tokens = IndexedTokens(prefix)
        for i in range(tokens.num_docs):
            ids = tokens.doc(i).tolist()
            matches = [t for t in texts if reference.encode(json.loads(t), add_special_tokens=False).ids + [2] == ids]
            assert len(matches) == 1, f"document {i} of {prefix.name} is no text's encoding"
            seen += 1
    assert seen == 30
    meta = json.loads((data.cache_dir / "meta.json").read_text())
    assert meta["tokenizer_source"] == str((folder / "tokenizer.json").resolve())
    assert data.tokenizer().to_str() == reference.to_str()


def test_truncation_and_padding_in_the_file_do_not_apply(corpus, tmp_path):
    """A tokenizer.json saved with truncation to 8 tokens and padding (as some model folders have):
    documents are still encoded whole, serially and in worker processes, and the file is kept as is."""
    truncating = build_tokenizer()
    truncating.enable_truncation(8)
    truncating.enable_padding(length=16)
    truncating.save(str(tmp_path / "tokenizer.json"))
    whole = prepare_data([corpus], 300, tmp_path / "a", log=None, tokenizer_model=tmp_path / "tokenizer.json")
    parallel = prepare_data([corpus], 300, tmp_path / "b", log=None, tokenizer_model=tmp_path, workers=2)
    reference = build_tokenizer()
    expected = sum(len(reference.encode(t, add_special_tokens=False).ids) + 1 for t in make_texts(seed=3, n_docs=30))
    assert whole.num_train_tokens + whole.num_valid_tokens == expected
    for name in ("train.bin", "valid.bin", "train.idx", "valid.idx"):
        assert (whole.cache_dir / name).read_bytes() == (parallel.cache_dir / name).read_bytes()
    assert json.loads((whole.cache_dir / "tokenizer.json").read_text())["truncation"]["max_length"] == 8


def test_the_file_content_keys_the_cache(corpus, folder, tmp_path):
    """The folder and its tokenizer.json, or a copy elsewhere, share one cache folder; another
    tokenizer file (one more token) re-tokenizes."""
    cache = tmp_path / "cache"
    a = prepare_data([corpus], 300, cache, log=None, tokenizer_model=folder)
    b = prepare_data([corpus], 300, cache, log=None, tokenizer_model=folder / "tokenizer.json")
    copy = tmp_path / "copy.json"
    shutil.copyfile(folder / "tokenizer.json", copy)
    c = prepare_data([corpus], 999, cache, log=None, tokenizer_model=copy)
    assert a.cache_dir == b.cache_dir == c.cache_dir
    changed = build_tokenizer()
    changed.add_tokens(["zzzz"])
    changed.save(str(copy))
    d = prepare_data([corpus], 300, cache, log=None, tokenizer_model=copy)
    assert d.cache_dir != a.cache_dir and d.vocab_size == 301
    trained = prepare_data([corpus], 300, cache, log=None)
    assert trained.cache_dir not in (a.cache_dir, d.cache_dir) and trained.eos_token == "<|endoftext|>"


def test_end_of_document_token(tmp_path):
    """tokenizer_config.json's eos_token wins; without it the known names are tried in order; a
    tokenizer knowing none of them is refused, naming the file."""
    plain = write_tokenizer_folder(tmp_path / "plain", eos_token=None)
    assert load_tokenizer_model(plain).eos_token == "</s>"
    named = write_tokenizer_folder(tmp_path / "named", eos_token="<unk>")
    assert load_tokenizer_model(named / "tokenizer.json").eos_token == "<unk>"
    gpt2_style = build_tokenizer()
    gpt2_style.add_special_tokens(["<|endoftext|>"])
    gpt2_style.save(str(tmp_path / "gpt2.json"))
    assert load_tokenizer_model(tmp_path / "gpt2.json").eos_token == "<|endoftext|>"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "no_eos.json"))
    with pytest.raises(DataError, match=r"no_eos\.json.*no end-of-document token.*--eod-token TEXT"):
        load_tokenizer_model(tmp_path / "no_eos.json")
    assert load_tokenizer_model(tmp_path / "no_eos.json", "b").eos_token == "b"


def test_an_eod_token_absent_from_the_tokenizer_is_added_and_ends_every_document(corpus, tmp_path):
    """--eod-token TEXT: the given tokenizer lacks it, so it becomes the next id (300); every document
    ends with it and nowhere else; the cached tokenizer.json has it, a tokenizer_config.json beside it
    names it (kept by checkpoints, exported to Hugging Face); the original's settings stay."""
    from tokenizers import Tokenizer

    source = write_tokenizer_folder(tmp_path / "model", eos_token="</s>")
    data = prepare_data([corpus], 100, tmp_path / "c", 0.2, None, tokenizer_model=source, eod_token="<|doc|>")
    assert (data.eos_token, data.eos_id, data.vocab_size) == ("<|doc|>", 300, 301)
    cached = Tokenizer.from_file(str(data.cache_dir / "tokenizer.json"))
    assert cached.token_to_id("<|doc|>") == 300 and cached.token_to_id("</s>") == 2
    named = json.loads((data.cache_dir / "tokenizer_config.json").read_text())
    assert named == {"eos_token": "<|doc|>", "bos_token": "<s>"}
    reference = build_tokenizer()
    texts = [json.loads(json.dumps(t)) for t in make_texts(seed=3, n_docs=30)]
    encodings = {tuple(reference.encode(t, add_special_tokens=False).ids) for t in texts}
    documents = 0
    for prefix in (data.train_prefix, data.valid_prefix):
        tokens = IndexedTokens(prefix)
        for i in range(tokens.num_docs):
            ids = tokens.doc(i).tolist()
            assert ids[-1] == 300 and 300 not in ids[:-1] and tuple(ids[:-1]) in encodings
            documents += 1
    assert documents == 30
    present = prepare_data([corpus], 100, tmp_path / "c", 0.2, None, tokenizer_model=source, eod_token="<s>")
    assert (present.eos_id, present.vocab_size) == (1, 300) and present.cache_dir != data.cache_dir
    assert (present.cache_dir / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def test_eod_token_through_ptdp_train(tmp_path, capsys, corpus, launched):
    """The refused tokenizer's error names --eod-token; with it the run starts on 1 more token; without
    --tokenizer-model it is refused before anything starts (exit 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "no_eos.json"))
    base = ["train", *tiny_flags(no_progress=True), "--data", str(corpus), "--data-cache-dir", str(tmp_path / "cache")]
    code = cli.main([*base, "--tokenizer-model", str(tmp_path / "no_eos.json"), "--output-dir", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2 and not launched and "--eod-token TEXT" in err, err
    code = cli.main([*base, "--eod-token", "<|doc|>", "--output-dir", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and not launched and "eod_token='<|doc|>' needs --tokenizer-model" in err, err
    no_eos = ["--tokenizer-model", str(tmp_path / "no_eos.json")]
    code = cli.main([*base, *no_eos, "--eod-token", "", "--output-dir", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert code == 2 and not launched and "eod_token='' is empty: name the tokenizer's" in err, err
    assert "ptdp's own tokenizer" not in err
    code = cli.main(
        [
            *base,
            "--tokenizer-model",
            str(tmp_path / "no_eos.json"),
            "--eod-token",
            "<|doc|>",
            "--output-dir",
            str(tmp_path / "c"),
        ]
    )
    out = capsys.readouterr()
    assert code == 1 and len(launched) == 1, out.err  # the stub stops the run after the launch
    record = json.loads((tmp_path / "c" / "config.json").read_text())
    assert record["data"]["eod_token"] == "<|doc|>" and record["model"]["vocab_size"] == 3


@pytest.fixture
def launched(monkeypatch) -> list:
    """Replaces the worker launcher: records each launch and stops there."""
    calls = []
    monkeypatch.setattr(
        "ptdp.run.launch.launch_local", lambda config, *a, **k: calls.append(config) or {"error": "stopped by the test"}
    )
    return calls


def test_bad_tokenizer_paths_exit_2_naming_the_path(tmp_path, capsys, corpus, launched):
    """A missing path, a folder without tokenizer.json (with another format's files: said so), a
    file that is not a tokenizer: exit 2 before any worker, naming the path; nothing written."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "vocab.json").write_text("{}")
    (slow / "merges.txt").write_text("")
    junk = tmp_path / "junk.json"
    junk.write_text('{"not": "a tokenizer"}')
    cases = {
        tmp_path / "missing": "does not exist",
        slow: "is a folder without a tokenizer.json; it has merges.txt, vocab.json",
        junk: "is not a Hugging Face tokenizer.json",
        corpus: "is not a Hugging Face tokenizer.json",
    }
    for path, why in cases.items():
        code = cli.main(
            [
                "train",
                *tiny_flags(no_progress=True),
                "--data",
                str(corpus),
                "--data-cache-dir",
                str(tmp_path / "cache"),
                "--tokenizer-model",
                str(path),
                "--output-dir",
                str(tmp_path / "run"),
            ]
        )
        err = capsys.readouterr().err
        assert code == 2 and not launched, err
        assert f"--tokenizer-model {str(path)!r} {why}" in err and "Traceback" not in err
        assert not (tmp_path / "run").exists()


def test_train_records_the_tokenizer_and_its_vocabulary(tmp_path, capsys, corpus, folder, launched):
    """ptdp train with --tokenizer-model: config.json records the path given, and the tokenizer's
    vocabulary (300) replaces --vocab-size (padded as any other: tests/e2e/test_own_tokenizer_e2e.py)."""
    code = cli.main(
        [
            "train",
            *tiny_flags(no_progress=True),
            "--data",
            str(corpus),
            "--data-cache-dir",
            str(tmp_path / "cache"),
            "--tokenizer-model",
            str(folder),
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    out = capsys.readouterr()
    assert code == 1 and len(launched) == 1, out.err  # the stub stops the run after the launch
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["data"]["tokenizer_model"] == str(folder)
    assert record["model"]["vocab_size"] == 300 and record["requested_vocab_size"] == 400
    assert "vocab 300" in out.out


def _gpt2_folder(folder: Path, vocab: int, h: int = 32, layers: int = 2, seq: int = 32) -> Path:
    """A GPT-2 model folder (config.json, model.safetensors of random tensors) written without
    transformers, as ``ptdp convert from-hf`` reads it."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    shapes = {"wte.weight": (vocab, h), "wpe.weight": (seq, h), "ln_f.weight": (h,), "ln_f.bias": (h,)}
    for i in range(layers):
        shapes |= {
            f"h.{i}.ln_1.weight": (h,),
            f"h.{i}.ln_1.bias": (h,),
            f"h.{i}.ln_2.weight": (h,),
            f"h.{i}.ln_2.bias": (h,),
            f"h.{i}.attn.c_attn.weight": (h, 3 * h),
            f"h.{i}.attn.c_attn.bias": (3 * h,),
            f"h.{i}.attn.c_proj.weight": (h, h),
            f"h.{i}.attn.c_proj.bias": (h,),
            f"h.{i}.mlp.c_fc.weight": (h, 4 * h),
            f"h.{i}.mlp.c_fc.bias": (4 * h,),
            f"h.{i}.mlp.c_proj.weight": (4 * h, h),
            f"h.{i}.mlp.c_proj.bias": (h,),
        }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {f"transformer.{k}": torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "vocab_size": vocab,
                "n_positions": seq,
                "n_embd": h,
                "n_layer": layers,
                "n_head": 4,
                "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5,
            }
        )
    )
    return folder


def test_convert_from_hf_says_how_to_continue_and_a_mismatched_tokenizer_is_refused(tmp_path, capsys, corpus, launched):
    """from-hf prints the train command with --tokenizer-model when the folder's tokenizer has the
    model's size, says why not otherwise; ptdp train --load with a tokenizer of another size: exit 2."""
    plain = _gpt2_folder(tmp_path / "plain", 300)
    assert cli.main(["convert", "from-hf", str(plain), str(tmp_path / "a")]) == 0
    assert f"{plain} has no tokenizer.json" in capsys.readouterr().out
    other = write_tokenizer_folder(_gpt2_folder(tmp_path / "other", 301))
    assert cli.main(["convert", "from-hf", str(other), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "has 300 tokens but the model's vocabulary is 301" in out and "--tokenizer-model" in out
    code = cli.main(
        [
            "train",
            *tiny_flags(no_progress=True, vocab_size=None, activation="gelu_tanh", ffn_hidden_size=128),
            "--data",
            str(corpus),
            "--data-cache-dir",
            str(tmp_path / "cache"),
            "--load",
            str(tmp_path / "b"),
            "--tokenizer-model",
            str(other),
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not launched, err
    assert (
        f"--tokenizer-model {other} has 300 tokens but the model in --load {tmp_path / 'b'} has a vocabulary "
        f"of 301: they must be equal" in err
    )


@pytest.mark.parametrize(
    "hf_config",
    [
        {
            "model_type": "gpt2",
            "vocab_size": 300,
            "n_positions": 64,
            "n_embd": 48,
            "n_layer": 3,
            "n_head": 6,
            "activation_function": "gelu_new",
            "tie_word_embeddings": False,
        },
        {
            "model_type": "llama",
            "vocab_size": 320,
            "max_position_embeddings": 64,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        },
    ],
)
def test_the_printed_model_flags_give_the_imported_model(hf_config):
    """from-hf's hint: its flags, parsed by ptdp train's parser, give the imported model exactly
    (the vocabulary aside, which the tokenizer sets)."""
    import argparse
    import dataclasses

    from ptdp.commands.convert import model_flags
    from ptdp.config.flags import config_from_args
    from ptdp.config.train_flags import add_train_arguments
    from ptdp.run.checkpoint.hf import configs_from_hf

    model, _ = configs_from_hf(hf_config)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=True)
    parsed = config_from_args(parser.parse_args(model_flags(model))).model
    assert parsed == dataclasses.replace(model, vocab_size=parsed.vocab_size)


def test_the_memory_check_uses_the_given_tokenizer_s_vocabulary(folder, monkeypatch):
    """Before any data are prepared, the memory estimate is made for the tokenizer's 300 tokens,
    not --vocab-size; --force skips reading it."""
    from ptdp.config.schema import Config, DataConfig, LaunchConfig
    from ptdp.run import preflight

    seen = []
    monkeypatch.setattr(preflight, "check_memory", lambda config, nproc: seen.append(config.model.vocab_size))
    config = Config(data=DataConfig(tokenizer_model=str(folder)))
    preflight.check_request(config, 1)
    preflight.check_request(Config(), 1)
    assert seen == [300, Config().model.vocab_size]
    preflight.check_request(Config(data=DataConfig(tokenizer_model="/missing"), launch=LaunchConfig(force=True)), 1)
    with pytest.raises(DataError, match="--tokenizer-model '/missing' does not exist"):
        preflight.check_request(Config(data=DataConfig(tokenizer_model="/missing")), 1)
