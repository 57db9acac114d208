"""``ptdp plan --model PATH`` with Hugging Face configs (:mod:`ptdp.planner.inputs.hf_config`): the
planner's parameter count equals ``sum(p.numel())`` of the transformers model built from the
same config (small shapes, on the CPU) for every dense model_type, tied and untied; the
fields it cannot model are named; the command runs on a config file and on a folder."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main
from ptdp.errors import ConfigError
from ptdp.planner.inputs.hf_config import DENSE, load_hf_config
from ptdp.planner.memory.params import stage_param_counts

transformers = pytest.importorskip("transformers")

LLAMA_SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=300,
    max_position_embeddings=128,
)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_SHAPE),
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA_SHAPE, "attention_bias": True, "mlp_bias": True}),
    "llama-attention-bias-mha": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {**LLAMA_SHAPE, "num_key_value_heads": 4, "attention_bias": True},
    ),
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA_SHAPE, "head_dim": 24}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**LLAMA_SHAPE, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA_SHAPE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**LLAMA_SHAPE, "head_dim": 24}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=96)),
    "gpt2-n-inner": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_layer=3, n_embd=32, n_head=2, n_inner=80, vocab_size=257, n_positions=40),
    ),
}


def _save(tmp_path, case: str, tied: bool):
    config_cls, model_cls, shape = CASES[case]
    config = getattr(transformers, config_cls)(**shape, tie_word_embeddings=tied)
    config.save_pretrained(tmp_path)
    return getattr(transformers, model_cls)(config)


def _planner_count(path) -> int:
    model, _ = load_hf_config(path)
    return sum(stage_param_counts(model, 1, 1, make_vocab_size_divisible_by=1))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_parameter_count_equals_transformers(tmp_path, case, tied):
    hf = _save(tmp_path, case, tied)
    expected = sum(p.numel() for p in hf.parameters())  # a tied weight is one parameter
    assert _planner_count(tmp_path) == expected  # the folder
    assert _planner_count(tmp_path / "config.json") == expected  # the file


def test_every_dense_type_is_covered():
    """The mixtures of experts: tests/unit/test_planner_hf_moe.py."""
    kinds = {getattr(transformers, c).model_type for c, _, _ in CASES.values()}
    assert kinds == set(DENSE)


def test_fields_mapped(tmp_path):
    _save(tmp_path, "qwen2", tied=True)
    model, notes = load_hf_config(tmp_path)
    assert (
        model.num_layers,
        model.hidden_size,
        model.num_attention_heads,
        model.kv_heads,
        model.ffn,
        model.vocab_size,
        model.seq_length,
    ) == (2, 64, 4, 2, 96, 300, 128)
    assert model.tied and model.swiglu and model.flash_attention and not model.has_dropout and notes == []
    assert model.linears_with_bias == ("qkv",) and not model.has_position_table and model.uses_rmsnorm
    assert load_hf_config(tmp_path, seq_length=32)[0].seq_length == 32
    gpt2 = tmp_path / "gpt2"
    _save(gpt2, "gpt2", tied=True)
    model, _ = load_hf_config(gpt2)
    assert model.seq_length == 96 and model.has_position_table and model.has_dropout and model.ffn == 256


def _write(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "config,words",
    [
        ({"model_type": "t5"}, ['model_type="t5"', "llama, mistral, qwen2, qwen3, gpt2, mixtral"]),
        ({"model_type": "llama", "num_local_experts": 8}, ["num_local_experts=8", "dense"]),
        ({"model_type": "qwen2", "num_experts": 64}, ["num_experts=64"]),
        ({"model_type": "llama", "head_dim": 0}, ["head_dim=0 must be a positive integer"]),
        ({"model_type": "llama", "hidden_size": "big"}, ['hidden_size="big"', "positive integer"]),
        ({"model_type": "gpt2", "add_cross_attention": True}, ["add_cross_attention=true"]),
        ({"model_type": "gpt2", "n_layer": None}, ["n_layer=null must be a positive integer"]),
        ([1, 2], ["JSON list"]),
    ],
)
def test_unsupported_fields_are_named(tmp_path, config, words):
    with pytest.raises(ConfigError) as err:
        load_hf_config(_write(tmp_path, config))
    for word in words:
        assert word in str(err.value)


def test_cost_notes(tmp_path):
    _, notes = load_hf_config(
        _write(tmp_path, {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768})
    )
    assert len(notes) == 1 and "sliding_window=4096 < seq_length=32768" in notes[0]
    _, notes = load_hf_config(_write(tmp_path, {"model_type": "mistral", "sliding_window": 4096}), seq_length=4096)
    assert notes == []
    _, notes = load_hf_config(_write(tmp_path, {"model_type": "qwen2", "sliding_window": 4096}))
    assert notes == []  # use_sliding_window is False by default
    _, notes = load_hf_config(_write(tmp_path, {"model_type": "llama", "rope_scaling": {"rope_type": "llama3"}}))
    assert len(notes) == 1 and 'rotary scaling "llama3" ignored' in notes[0]


def test_cli_plans_a_config_folder(tmp_path, capsys):
    _save(tmp_path, "llama", tied=False)
    argv = ["plan", "--model", str(tmp_path), "--gpus", "8", "--gpu", "h100-sxm", "--global-batch-size", "16", "--json"]
    assert main(argv) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p for p in plans if p["fits"]]


def test_cli_errors_exit_2(tmp_path, capsys):
    assert (
        main(
            ["plan", "--model", str(_write(tmp_path, {"model_type": "t5"})), "--gpus", "8", "--global-batch-size", "8"]
        )
        == 2
    )
    assert 'model_type="t5" is not supported' in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plan", "--model", str(empty), "--gpus", "8", "--global-batch-size", "8"]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["plan", "--model", "no-such-preset", "--gpus", "8", "--global-batch-size", "8"]) == 2


def test_gpt2_vocabulary_is_planned_padded_as_ptdp_train_pads_it(tmp_path, capsys):
    """GPT-2's 50,257 tokens: the plan's weights are those with the vocabulary ptdp train pads to
    (``padded_vocab_size``, 50,304 at tp 1), not the 50,257 rows of the Hugging Face model."""
    from ptdp.config.model import ModelConfig
    from ptdp.layout.vocab import padded_vocab_size

    shape = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=64)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape))
    hf.config.save_pretrained(tmp_path)
    padded = padded_vocab_size(50257, ModelConfig().make_vocab_size_divisible_by, 1)
    assert padded == 50304
    expected = sum(p.numel() for p in hf.parameters()) + (padded - 50257) * 64  # one tied table
    argv = ["plan", "--model", str(tmp_path), "--gpus", "1", "--global-batch-size", "8", "--bf16", "--json"]
    assert main(argv) == 0
    plans = [p for p in json.loads(capsys.readouterr().out) if p["fits"]]
    assert plans and {p["memory_bytes"]["params"] for p in plans} == {2.0 * expected}  # bf16 weights
