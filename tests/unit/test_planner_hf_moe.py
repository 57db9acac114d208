"""``ptdp plan --model PATH`` with Hugging Face mixture-of-experts configs (Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3, gpt-oss; :mod:`ptdp.planner.inputs.hf_config`): the planner's total and
active parameters equal those of the transformers model built from the same config.json (on the
meta device), less the weights the planner says it leaves out; the released configs give the MoE
presets; routing the planner refuses is named by the config's fields; the command plans each."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ptdp.cli import main
from ptdp.config.model import ModelConfig
from ptdp.errors import ConfigError
from ptdp.planner.inputs.hf_config import MOE, load_hf_config
from ptdp.planner.inputs.models import MOE_PRESETS
from ptdp.planner.inputs.moe_model import MLA, MoEModel, with_mtp
from ptdp.planner.memory.moe_params import model_param_counts

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

#: shared by every case: a vocabulary of 3 x 128 rows (ptdp pads none; its tokenizer needs 258)
SHAPE = dict(vocab_size=384, hidden_size=64, num_attention_heads=4, max_position_embeddings=128)
QWEN_MOE = dict(
    num_hidden_layers=4,
    num_key_value_heads=2,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=2,  # layers 1 and 3 ...
    mlp_only_layers=[3],  # ... but 3 dense: one MoE layer among dense ones of intermediate_size
)
DEEPSEEK = dict(
    num_hidden_layers=3,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=4,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=20,
    num_nextn_predict_layers=1,
)
#: case -> (config class, model class, its fields)
GPT_OSS = dict(
    num_hidden_layers=2,
    num_key_value_heads=2,
    head_dim=24,
    intermediate_size=48,
    num_local_experts=4,
    num_experts_per_tok=2,
)
CASES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=48, num_local_experts=4),
    ),
    "mixtral-head-dim": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=24, intermediate_size=48, num_local_experts=4),
    ),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(QWEN_MOE, shared_expert_intermediate_size=40)),
    "qwen2_moe-no-qkv-bias": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(QWEN_MOE, shared_expert_intermediate_size=40, qkv_bias=False),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(QWEN_MOE, head_dim=24)),
    "qwen3_moe-attention-bias": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(QWEN_MOE, head_dim=24, attention_bias=True, decoder_sparse_step=1, mlp_only_layers=[]),
    ),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
    "deepseek_v3-no-q-lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(DEEPSEEK, q_lora_rank=None)),
    "deepseek_v3-attention-bias": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(DEEPSEEK, attention_bias=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS),
    "gpt_oss-no-attention-bias": ("GptOssConfig", "GptOssForCausalLM", dict(GPT_OSS, attention_bias=False)),
}


def _save(path, case: str, tied: bool):
    """The case's config written to ``path/config.json``, and its transformers model on the meta
    device (shapes only)."""
    config_cls, model_cls, fields = CASES[case]
    config = getattr(transformers, config_cls)(**SHAPE, **fields, tie_word_embeddings=tied)
    config.save_pretrained(path)
    with torch.device("meta"):
        return getattr(transformers, model_cls)(config)


def _numel(module, suffix: str) -> int:
    """Parameters of ``module`` whose names end with ``suffix``."""
    return sum(p.numel() for name, p in module.named_parameters() if name.endswith(suffix))


def _left_out(hf) -> int:
    """The weights ptdp's planner does not model, as its notes say: Qwen2-MoE's shared-expert gates
    (``[1, h]`` per MoE layer), gpt-oss's router biases (``[E]`` per layer) and attention sinks
    (``[a]`` per layer), DeepSeek's MLA biases (``attention_bias``: the down projections' and the
    output's)."""
    suffixes = {
        "qwen2_moe": ("shared_expert_gate.weight",),
        "gpt_oss": ("router.bias", "self_attn.sinks"),
        "deepseek_v3": ("q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias"),
    }
    return sum(_numel(hf, suffix) for suffix in suffixes.get(hf.config.model_type, ()))


def _counts(hf, k: int) -> tuple[int, int, list[int]]:
    """(total, active, MoE layer indices) of the transformers model: every parameter (a tied table
    once), and those a token passes through: the routed experts of an MoE layer (the module named
    ``experts``, each parameter ``[E, ...]``) count ``k / E`` of their weights."""
    total = sum(p.numel() for p in hf.parameters())
    inactive, moe_layers = 0, []
    for i, layer in enumerate(hf.model.layers):
        experts = [m for name, m in layer.named_modules() if name.split(".")[-1] == "experts"]
        for module in experts:
            for p in module.parameters():
                e = p.shape[0]
                inactive += p.numel() // e * (e - k)
        if experts:
            moe_layers.append(i)
    return total, total - inactive, moe_layers


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_total_and_active_parameters_equal_transformers(tmp_path, case, tied):
    hf = _save(tmp_path, case, tied)
    model, notes = load_hf_config(tmp_path / "config.json")
    assert isinstance(model, MoEModel) and model.moe.enabled
    total, active, moe_layers = _counts(hf, hf.config.num_experts_per_tok)
    main = with_mtp(model, 0)  # the multi-token-prediction modules, which transformers does not build, aside
    assert list(main.moe_layer_ids) == moe_layers
    # less the weights the planner leaves out and names in a note (none for Mixtral and Qwen3-MoE)
    left_out = _left_out(hf)
    assert bool(left_out) == any("left out" in note for note in notes)
    assert model_param_counts(main, main.moe) == (total - left_out, active - left_out)


def test_every_moe_family_is_covered():
    kinds = {getattr(transformers, config_cls).model_type for config_cls, _, _ in CASES.values()}
    assert kinds == set(MOE)


def test_qwen_moe_fields_mapped(tmp_path):
    _save(tmp_path / "qwen2", "qwen2_moe", tied=False)
    model, notes = load_hf_config(tmp_path / "qwen2")
    moe = model.moe
    assert (moe.num_experts, moe.moe_router_topk, moe.expert_ffn(model.ffn), moe.shared_ffn) == (8, 2, 32, 40)
    assert model.ffn == 96 and moe.moe_layers(4) == (False, True, False, False)  # decoder_sparse_step 2, layer 3 dense
    assert moe.moe_router_pre_softmax  # norm_topk_prob false: no renormalisation of the top k
    assert model.linears_with_bias == ("qkv",) and not model.qk_layernorm
    assert notes == [
        f"note: {tmp_path / 'qwen2'}: the shared experts' gates ([1, h] per MoE layer, 64 parameters) are left "
        "out: the planner counts the shared expert as an ungated MLP"
    ]
    _save(tmp_path / "qwen3", "qwen3_moe", tied=False)
    model, _ = load_hf_config(tmp_path / "qwen3")
    assert model.qk_layernorm and model.head_dim == 24 and model.moe.shared_ffn == 0


def test_deepseek_v3_fields_mapped(tmp_path):
    _save(tmp_path, "deepseek_v3", tied=False)
    model, notes = load_hf_config(tmp_path)
    moe, mla = model.moe, model.mla
    assert notes == [] and model.mtp_layers == 1 and moe.moe_layers(4) == (False, True, True, True)
    assert (moe.num_experts, moe.moe_router_topk, moe.expert_ffn(model.ffn), moe.shared_ffn) == (8, 4, 32, 64)
    assert (moe.moe_router_score_function, moe.moe_router_topk_scaling_factor) == ("sigmoid", 2.5)
    assert (moe.moe_router_num_groups, moe.moe_router_group_topk, moe.moe_router_enable_expert_bias) == (4, 2, True)
    assert mla == MLA(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20, q_lora_rank=48)
    assert (model.kv_channels, model.kv_heads, model.ffn) == (24, 4, 96)  # the kernel's shape: dn + dr, a heads


def test_gpt_oss_fields_mapped(tmp_path):
    _save(tmp_path, "gpt_oss", tied=False)
    model, notes = load_hf_config(tmp_path, seq_length=128)
    assert model.linears_with_bias == ("qkv", "proj", "fc1", "fc2") and model.add_bias_linear  # biased experts
    assert model.kv_channels == 24 and not any("sliding_window" in n for n in notes)  # 128 is not < 128
    _, notes = load_hf_config(tmp_path, seq_length=4096)
    assert "sliding_window=128 < seq_length=4096 on 1 of 2 layers (layer_types)" in notes[0]
    assert "16 parameters, are left out" in notes[-1]  # 2 MoE layers x 4 router biases + 2 layers x 4 sinks


def _released(config_cls: str) -> ModelConfig:
    """transformers' default config of ``config_cls`` (its released model) loaded at the presets'
    sequence of 4,096."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        getattr(transformers, config_cls)().save_pretrained(folder)
        return load_hf_config(folder, seq_length=4096)[0]


def test_released_configs_give_the_moe_presets(tmp_path):
    """transformers' defaults are Mixtral-8x7B's, DeepSeek-V3's and gpt-oss-120b's; Qwen3-30B-A3B's
    and Qwen2-57B-A14B's fields as their released config.json files give them."""
    assert _released("MixtralConfig") == MOE_PRESETS["mixtral-8x7b"]
    assert _released("DeepseekV3Config") == MOE_PRESETS["deepseek-v3"]
    assert _released("GptOssConfig") == MOE_PRESETS["gpt-oss-120b"]
    qwen3 = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32)
    qwen3 |= dict(num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
    qwen3 |= dict(moe_intermediate_size=768, norm_topk_prob=True, vocab_size=151936)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **qwen3}))
    assert load_hf_config(tmp_path, seq_length=4096)[0] == MOE_PRESETS["qwen3-30b-a3b"]
    qwen2 = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28)
    qwen2 |= dict(num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=2560)
    qwen2 |= dict(shared_expert_intermediate_size=20480, norm_topk_prob=False, vocab_size=151936)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", **qwen2}))
    model = load_hf_config(tmp_path, seq_length=4096)[0]
    assert model.moe.moe_router_pre_softmax  # its norm_topk_prob=false; the preset does not say
    preset = MOE_PRESETS["qwen2-57b-a14b"]
    assert model == dataclasses.replace(preset, moe=dataclasses.replace(preset.moe, moe_router_pre_softmax=True))


def _write(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "config,words",
    [
        (
            {"model_type": "mixtral", "num_experts_per_tok": 9},
            ["num_experts_per_tok=9 must be in [1, num_local_experts=8]"],
        ),
        ({"model_type": "mixtral", "num_experts": 2, "num_experts_per_tok": 3}, ["[1, num_local_experts=2]"]),
        ({"model_type": "qwen3_moe", "moe_intermediate_size": 0}, ["moe_intermediate_size=0 must be a positive"]),
        ({"model_type": "qwen2_moe", "mlp_only_layers": "all"}, ['mlp_only_layers="all" must be a list']),
        ({"model_type": "qwen2_moe", "decoder_sparse_step": 0}, ["decoder_sparse_step=0"]),
        ({"model_type": "deepseek_v3", "n_group": 3}, ["n_routed_experts=256 is not divisible by n_group=3"]),
        ({"model_type": "deepseek_v3", "topk_group": 9}, ["topk_group=9 must be in [1, n_group=8]"]),
        ({"model_type": "deepseek_v3", "scoring_func": "relu"}, ['scoring_func="relu" must be softmax or sigmoid']),
        ({"model_type": "deepseek_v3", "routed_scaling_factor": 0}, ["routed_scaling_factor=0 would zero"]),
        ({"model_type": "deepseek_v3", "v_head_dim": None}, ["v_head_dim=null must be a positive integer"]),
        (
            {"model_type": "deepseek_v3", "first_k_dense_replace": -1},
            ["first_k_dense_replace=-1 must be an integer >= 0"],
        ),
        ({"model_type": "gpt_oss", "num_local_experts": "many"}, ['num_local_experts="many"']),
        ({"model_type": "dbrx"}, ['model_type="dbrx" is not supported', "qwen2_moe, qwen3_moe, deepseek_v3"]),
        ({"model_type": "llama", "num_local_experts": 8}, ["num_local_experts=8", 'dense model_type "llama"']),
    ],
)
def test_what_cannot_be_planned_is_named(tmp_path, config, words):
    with pytest.raises(ConfigError) as err:
        load_hf_config(_write(tmp_path, config))
    for word in words:
        assert word in str(err.value)


def test_no_moe_layer_plans_a_dense_model(tmp_path):
    model, notes = load_hf_config(_write(tmp_path, {"model_type": "qwen3_moe", "num_experts": 0}))
    assert type(model) is ModelConfig and notes == [
        f"note: {tmp_path / 'config.json'}: num_experts=0 and no MoE layer: planned as a dense model"
    ]
    model, _ = load_hf_config(
        _write(tmp_path, {"model_type": "qwen2_moe", "num_hidden_layers": 2, "mlp_only_layers": [0, 1]})
    )
    assert type(model) is ModelConfig and model.ffn == 5632
    model, _ = load_hf_config(_write(tmp_path, {"model_type": "deepseek_v3", "first_k_dense_replace": 61}))
    assert isinstance(model, MoEModel) and not model.moe.enabled and model.mla is not None and model.mtp_layers == 1


def test_aliases_and_notes(tmp_path):
    """Qwen3-MoE's released spelling ``num_experts`` and transformers 5's ``num_local_experts``;
    Mixtral's router noise, DeepSeek's MLA biases and rotary scaling are notes."""
    spelled = [
        load_hf_config(_write(tmp_path, {"model_type": "qwen3_moe", name: 16}))[0].moe.num_experts
        for name in ("num_experts", "num_local_experts")
    ]
    assert spelled == [16, 16]
    _, notes = load_hf_config(_write(tmp_path, {"model_type": "mixtral", "router_jitter_noise": 0.1}))
    assert notes and "router_jitter_noise=0.1 ignored" in notes[0]
    config = {"model_type": "deepseek_v3", "attention_bias": True, "rope_scaling": {"type": "yarn", "factor": 40}}
    _, notes = load_hf_config(_write(tmp_path, config))
    assert 'rotary scaling "yarn" ignored' in notes[0]
    assert f"MLA's biases ({61 * (1536 + 512 + 64 + 7168):,} parameters) are left out" in notes[1]


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_cli_plans_a_moe_config(tmp_path, capsys, case):
    hf = _save(tmp_path, case, tied=False)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--gpus", "8", "--gpu", "h100"]
    assert main([*argv, "--global-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("model hf:"))
    experts = next(p.shape[0] for name, p in hf.named_parameters() if ".experts." in name)
    assert f"E={experts} k={hf.config.num_experts_per_tok}" in header and "no layout fits" not in out
    assert ("left out" in out) == bool(_left_out(hf))
