"""The mixture-of-experts options: Megatron-Core's flags in their own schema section, shared by
``ptdp train``, ``python -m ptdp.train``, config files and the Python API; the expert-grid and
routing rules checked before any process, every broken one named with its numbers."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ptdp.config.flags import config_from_args, int_list
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.rules.moe import moe_violations
from ptdp.config.schema import Config
from ptdp.config.train_flags import add_train_arguments

RULES = dict(num_layers=4, ffn=256, tp=1, pp=1, ep=1, etp=1, world_size=4, sequence_parallel=False)


def _messages(moe: MoEConfig, **layout) -> list[str]:
    return [v.message for v in moe_violations(moe, **{**RULES, **layout})]


def test_flags_and_aliases_reach_the_config():
    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=True)
    args = parser.parse_args(
        "--num-experts 8 --moe-router-topk 2 --moe-layer-freq [0]*1+[1]*3 --ep 4 --etp 2 "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-aux-loss-coeff 0.01 "
        "--moe-token-dispatcher-type allgather --moe-expert-capacity-factor 1.5".split()
    )
    config = config_from_args(args)
    assert config.moe.num_experts == 8 and config.moe.moe_layer_freq == (0, 1, 1, 1)
    assert config.moe.moe_layers(4) == (False, True, True, True)
    assert (config.parallel.ep, config.parallel.etp) == (4, 2)
    assert config.parallel.moe_token_dispatcher_type == "allgather"
    assert config.moe.moe_router_score_function == "sigmoid" and config.moe.moe_router_enable_expert_bias
    assert config.moe.moe_expert_capacity_factor == 1.5
    defaults = config_from_args(parser.parse_args([]))
    assert not defaults.moe.enabled and (defaults.parallel.ep, defaults.parallel.etp) == (1, 1)


def test_the_section_round_trips_through_a_dict():
    config = Config(moe=MoEConfig(num_experts=4, moe_layer_freq=(1, 0, 1, 0)))
    again = Config.from_dict(config.to_dict())
    assert again.moe == config.moe and again.moe.moe_layer_freq == (1, 0, 1, 0)
    assert Config.from_dict({k: v for k, v in Config().to_dict().items() if k != "moe"}).moe == MoEConfig()


@pytest.mark.parametrize(
    ("text", "layers"),
    [("2", (1, 0, 1, 0)), ("1", (1, 1, 1, 1)), ("[0]*2+[1]*2", (0, 0, 1, 1)), ("1,0,0,1", (1, 0, 0, 1))],
)
def test_layer_frequency_is_an_integer_or_a_list(text, layers):
    moe = MoEConfig(num_experts=4, moe_layer_freq=int_list(text))
    assert moe.moe_layers(4) == tuple(bool(x) for x in layers)
    assert not _messages(moe)


def test_dense_models_have_no_moe_layers_and_refuse_moe_options():
    assert MoEConfig().moe_layers(3) == (False, False, False)
    (message,) = _messages(MoEConfig(moe_aux_loss_coeff=0.1, moe_router_topk=4), ep=2)
    assert message.startswith(
        "expert_model_parallel_size=2, moe_router_topk=4, moe_aux_loss_coeff=0.1 need --num-experts"
    )


def test_the_expert_grid_rules_name_their_numbers():
    messages = _messages(MoEConfig(num_experts=6, moe_router_topk=7, moe_ffn_hidden_size=30), ep=4, etp=4, pp=2, tp=2)
    assert "moe_router_topk=7 must be in [1, num_experts=6]" in messages
    assert "num_experts=6 is not divisible by expert_model_parallel_size=4 (rule: E % ep == 0)" in messages
    assert any(m.startswith("world_size=4 is not divisible by etp x ep x pp = 4 x 4 x 2") for m in messages)
    assert "moe_ffn_hidden_size=30 must be a positive multiple of expert_tensor_parallel_size=4" in messages
    assert any("tensor_model_parallel_size=2 needs --sequence-parallel" in m for m in messages)
    assert not _messages(MoEConfig(num_experts=8), ep=4, etp=1, pp=1, world_size=8)
    assert not _messages(MoEConfig(num_experts=8), ep=2, etp=2, pp=2, tp=2, world_size=8, sequence_parallel=True)


@pytest.mark.parametrize(
    ("moe", "words"),
    [
        (MoEConfig(num_experts=8, moe_router_num_groups=4), "needs both --moe-router-num-groups"),
        (
            MoEConfig(num_experts=8, moe_router_num_groups=3, moe_router_group_topk=1),
            "not divisible by moe_router_num_groups=3",
        ),
        (
            MoEConfig(num_experts=8, moe_router_num_groups=4, moe_router_group_topk=5),
            "moe_router_group_topk=5 must be in [1, ",
        ),
        (
            MoEConfig(num_experts=8, moe_router_topk=3, moe_router_num_groups=4, moe_router_group_topk=2),
            "multiple of moe_router_group_topk=2",
        ),
        (
            MoEConfig(num_experts=8, moe_router_topk=6, moe_router_num_groups=4, moe_router_group_topk=2),
            "k / group_topk <= 2",
        ),
        (
            MoEConfig(num_experts=8, moe_router_pre_softmax=True, moe_router_score_function="sigmoid"),
            "pre-softmax needs",
        ),
        (MoEConfig(num_experts=8, moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor=0.0 must be > 0"),
        (MoEConfig(num_experts=8, moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
        (MoEConfig(num_experts=8, moe_aux_loss_coeff=-1.0), "moe_aux_loss_coeff=-1.0 must be a finite number >= 0"),
        (MoEConfig(num_experts=8, moe_layer_freq=(1, 2, 1, 1)), "must be one integer or one 0/1 per layer"),
        (MoEConfig(num_experts=8, moe_layer_freq=(1, 0)), "(num_layers=4, 2 given)"),
        (MoEConfig(num_experts=8, moe_layer_freq=(0,)), "moe_layer_freq=0 must be a positive integer"),
        (MoEConfig(num_experts=8, moe_shared_expert_intermediate_size=3), "multiple of tensor_model_parallel_size=2"),
    ],
)
def test_routing_rules(moe, words):
    messages = _messages(moe, tp=2, sequence_parallel=True)
    assert any(words in m for m in messages), messages


def test_valid_routing_options_pass():
    moe = MoEConfig(
        num_experts=16,
        moe_router_topk=4,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=64,
        moe_expert_capacity_factor=1.25,
        moe_pad_expert_input_to_capacity=True,
        moe_z_loss_coeff=1e-3,
    )
    assert not _messages(moe, tp=2, sequence_parallel=True)
    assert moe.router_dtype("float64") == "fp64" and moe.router_dtype("bfloat16") == "fp32"
    assert dataclasses.replace(moe, moe_router_dtype="fp64").router_dtype("bfloat16") == "fp64"
    assert moe.expert_ffn(256) == 256 and moe.shared_ffn == 64


def test_ptdp_train_refuses_what_moe_does_not_run_yet(capsys):
    from ptdp import cli

    argv = ["train", "--num-experts", "4", "--tp", "1", "--pp", "1", "--dp", "2", "--train-iters", "1"]
    extra = ["--ep", "2", "--etp", "2", "--moe-router-enable-expert-bias", "--use-distributed-optimizer", "--bf16"]
    assert cli.main([*argv, *extra, "--save", "ck"]) == 2
    err = capsys.readouterr().err
    assert "expert_tensor_parallel_size=2 with linear biases with --num-experts: ptdp train does not run it yet" in err
    assert "sharding" not in err and "bfloat16" not in err and "checkpoints" not in err
    assert ModelConfig().num_layers == 4  # the dense defaults are untouched


def test_options_that_would_do_nothing_are_refused():
    """No MoE layer at all, a drop policy without a capacity, a bias rate without the bias, the
    allgather dispatcher of a dense model: each named."""
    assert _messages(MoEConfig(num_experts=4, moe_layer_freq=(0, 0, 0, 0))) == [
        "moe_layer_freq=[0, 0, 0, 0] makes no layer an MoE layer (without --num-experts: dense)"
    ]
    assert _messages(MoEConfig(num_experts=4, moe_token_drop_policy="position")) == [
        "--moe-token-drop-policy position needs --moe-expert-capacity-factor"
    ]
    assert _messages(MoEConfig(num_experts=4, moe_router_bias_update_rate=0.1)) == [
        "moe_router_bias_update_rate=0.1 needs --moe-router-enable-expert-bias"
    ]
    assert _messages(MoEConfig(), dispatcher="allgather") == [
        "moe_token_dispatcher_type='allgather' needs --num-experts (the model is dense without it)"
    ]


def test_a_checkpoint_with_expert_biases_is_not_loaded_without_them(tmp_path):
    """Trained expert biases would be dropped silently: refused, naming the flag; the dense width
    of a model whose every layer is MoE is not compared (only the experts')."""
    from ptdp.config.schema import Config
    from ptdp.run.checkpoint.folders import CheckpointError, _check_model

    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48)
    moe = MoEConfig(num_experts=4, moe_ffn_hidden_size=24, moe_router_enable_expert_bias=True)
    meta = {"model": dataclasses.asdict(model) | {"ffn": 48}, "moe": dataclasses.asdict(moe)}
    plain = dataclasses.replace(moe, moe_router_enable_expert_bias=False)
    with pytest.raises(CheckpointError, match="trained expert biases.*set --moe-router-enable-expert-bias"):
        _check_model(meta, Config(model=model, moe=plain), tmp_path)
    wider = dataclasses.replace(model, ffn_hidden_size=96)
    _check_model(meta, Config(model=wider, moe=moe), tmp_path)  # the dense width is unused
    with pytest.raises(CheckpointError, match=r"ffn=48 in the checkpoint, 96 here \(set --ffn-hidden-size\)"):
        _check_model(meta, Config(model=wider, moe=dataclasses.replace(moe, moe_layer_freq=(0, 1))), tmp_path)
