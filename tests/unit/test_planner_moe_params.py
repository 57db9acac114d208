"""The planner's MoE parameter counts: per rank of the expert grid equal to what ``ptdp train``'s
layers hold at several tp / ep / etp (with SwiGLU or GELU, biases, a shared expert), and the whole
model's total and active counts equal to ``transformers``' Mixtral and Qwen3-MoE."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.groups import ExpertGroups
from ptdp.engine.model.layer import TransformerLayer
from ptdp.planner.memory.moe_params import model_param_counts, moe_layer_param_counts

GPT = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, seq_length=16)
LLAMA = dataclasses.replace(
    GPT, swiglu=True, normalization="RMSNorm", add_bias_linear=False, num_query_groups=2, kv_channels=24
)
MOE = MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48)


def _axis(name: str, size: int, rank: int) -> AxisGroup:
    """A group of ``size`` that allocates shards and never communicates (none is built)."""
    return AxisGroup(name, tuple(range(size)), rank, None, None)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("tp, ep, etp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 4, 2), (4, 2, 2), (1, 1, 4)])
def test_an_moe_layers_parameters_per_rank_are_what_ptdp_train_allocates(model, tp, ep, etp):
    if etp > 1 and model.add_bias_linear:
        pytest.skip("experts with biases are not split over etp")
    experts = ExpertGroups(_axis("ep", ep, ep - 1), _axis("etp", etp, etp - 1), _axis("ep", ep * etp, 0))
    layer = TransformerLayer(
        model,
        _axis("tp", tp, tp - 1),
        torch.float32,
        sequence_parallel=tp > 1,
        layer_id=0,
        moe=MOE,
        experts=experts if ep * etp > 1 else None,
    )
    expert_params = sum(p.numel() for p in layer.parameters() if hasattr(p, "ptdp_expert"))
    rest = sum(p.numel() for p in layer.parameters() if not hasattr(p, "ptdp_expert"))
    assert moe_layer_param_counts(model, MOE, tp, ep, etp) == (rest, expert_params)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_total_and_active_parameters_equal_transformers(kind):
    transformers = pytest.importorskip("transformers")
    from helpers.hf_families import FAMILIES, SHAPE
    from ptdp.run.checkpoint.hf import configs_from_hf

    config_cls, model_cls, own = FAMILIES[kind]
    config = getattr(transformers, config_cls)(**SHAPE | own | {"num_hidden_layers": 3, "tie_word_embeddings": False})
    if kind == "qwen3_moe":
        config.mlp_only_layers = [1]  # a dense layer between two MoE ones
    hf = getattr(transformers, model_cls)(config)
    model, moe = configs_from_hf(config.to_dict())
    model = dataclasses.replace(model, make_vocab_size_divisible_by=1)  # no padding rows
    total = sum(p.numel() for p in hf.parameters())
    moe_layers = [
        i for i, layer in enumerate(hf.model.layers) if any(n.endswith("experts") for n, _ in layer.named_modules())
    ]
    assert len(moe_layers) == (3 if kind == "mixtral" else 2) and moe.moe_layers(3) == tuple(
        i in moe_layers for i in range(3)
    )
    per_expert = 3 * config.hidden_size * (config.moe_intermediate_size if kind == "qwen3_moe" else 48)
    inactive = len(moe_layers) * (moe.num_experts - moe.moe_router_topk) * per_expert
    assert model_param_counts(model, moe) == (total, total - inactive)


def test_moe_model_flops_count_the_router_and_the_activated_experts():
    """3 x forward: each MoE layer's MLP is ``2 T h (E + (n + 1)(k F + S))``; with ``k F`` the dense
    width and no shared expert only the router's ``2 T h E`` is added to the dense model's."""
    from ptdp.planner.time.flops import model_flops_per_step

    for model in (GPT, LLAMA):
        mats = 3 if model.swiglu else 2
        same = MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=model.ffn // 2)
        dense = model_flops_per_step(model, 4)
        router = 3 * 4 * model.seq_length * 2 * model.hidden_size * 8 * model.num_layers
        assert model_flops_per_step(model, 4, same) == pytest.approx(dense + router, rel=1e-12)
        first_dense = dataclasses.replace(MOE, moe_layer_freq=(0, 1))
        tokens, h = 4 * model.seq_length, model.hidden_size
        extra = 3 * 2 * tokens * h * (8 + mats * (2 * 32 + 48) - mats * model.ffn)
        assert model_flops_per_step(model, 4, first_dense) == pytest.approx(dense + extra, rel=1e-12)


def test_the_launch_memory_check_counts_the_experts():
    """``ptdp train``'s memory check: one process holds every expert (the parameters it builds); with
    the experts over ep 2 a rank holds half of them, their Adam state over edp with sharding."""
    from helpers.moe_cases import moe_config
    from ptdp.engine.groups import ParallelGroups
    from ptdp.engine.stage import build_stage
    from ptdp.run.memory_check import rank_estimates

    cfg = moe_config("moe_ep", 1, 1, 1, 1)  # float64: twice float32's 4 bytes
    held = sum(p.numel() for p in build_stage(cfg, ParallelGroups.single_process()).model.parameters())
    (one,) = rank_estimates(cfg)
    assert one.params == 2 * 4 * held and one.grads == 2 * 4 * held and one.optimizer == 2 * 8 * held
    experts = sum(
        p.numel()
        for n, p in build_stage(cfg, ParallelGroups.single_process()).model.named_parameters()
        if "experts." in n
    )
    (split,) = rank_estimates(moe_config("moe_ep:optim", 1, 1, 1, 4, 2))  # edp 2
    assert split.params == 2 * 4 * (held - experts / 2)
    assert split.optimizer == pytest.approx(2 * 8 * ((held - experts) / 4 + experts / 2 / 2), rel=1e-3)  # + padding


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("mixtral-8x7b", 46.7, 12.9),
        ("mixtral-8x22b", 141, 39),
        ("qwen2-57b-a14b", 57.4, 14.2),
        ("qwen3-30b-a3b", 30.5, 3.3),
        ("qwen3-235b-a22b", 235, 22),
        ("deepseek-v3", 671, 37),
    ],
)
def test_moe_presets_have_their_model_cards_parameters(name, total, active):
    """Total and active parameters (billions, as the model cards round them) of each MoE preset."""
    from ptdp.planner.inputs.models import MOE_PRESETS
    from ptdp.planner.inputs.moe_model import with_mtp

    preset = with_mtp(MOE_PRESETS[name], 0)  # DeepSeek-V3's card counts its MTP module apart
    counted = [n / 1e9 for n in model_param_counts(preset, preset.moe)]
    assert counted == pytest.approx([total, active], rel=0.02), counted


def test_gpt_oss_counts_its_active_parameters_without_the_embedding_as_its_card():
    """openai/gpt-oss-120b's card: 117B parameters, 5.1B active per token (the embedding lookup
    left out of the active count)."""
    from ptdp.planner.inputs.models import MOE_PRESETS

    preset = MOE_PRESETS["gpt-oss-120b"]
    total, active = model_param_counts(preset, preset.moe)
    embedding = 201088 * 2880
    assert [total / 1e9, (active - embedding) / 1e9] == pytest.approx([116.8, 5.13], rel=0.005)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize(
    "routing",
    [
        dict(moe_router_topk=1),
        dict(moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
        dict(moe_router_topk=4, moe_router_score_function="sigmoid", moe_z_loss_coeff=1e-3),
    ],
    ids=["top1", "top2_losses", "top4_sigmoid"],
)
def test_an_moe_mlps_activation_bytes_are_what_ptdp_keeps(dtype, swiglu, routing):
    """The planner's bytes of one MoE layer's MLP (one rank with every expert) within 2% of the
    storages autograd keeps for backward (the layer's input excluded: the norm's output)."""
    from ptdp.engine.activation_meter import SavedActivationMeter, parameter_storages
    from ptdp.engine.moe.layer import MoELayer
    from ptdp.planner.memory.moe_activations import moe_mlp_activation_bytes

    torch_dtype = getattr(torch, dtype)
    model = dataclasses.replace(GPT, hidden_size=256, swiglu=swiglu, add_bias_linear=False, params_dtype=dtype)
    moe = MoEConfig(num_experts=8, moe_ffn_hidden_size=64, **routing)
    torch.manual_seed(0)
    layer = MoELayer(model, moe, torch_dtype)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(16, 4, 256, dtype=torch_dtype, requires_grad=True)
    meter = SavedActivationMeter(parameter_storages(layer) | {x.untyped_storage().data_ptr()})
    with meter.hooks():
        layer(x)
    predicted = moe_mlp_activation_bytes(model, moe, 64, precision_bytes=torch_dtype.itemsize)
    assert predicted == pytest.approx(meter.peak, rel=0.02)
