"""The planner's FP8 mixture of experts as ptdp train runs it (a recipe given): activations, the
FP8 weight copies and the experts' weight-gradient GEMMs, against a single-process run of ptdp's
model; without a recipe, Transformer Engine's (the published runs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.activations import MICRO_BATCH, MICROBATCHES, TOLERANCE, measured_peak
from ptdp.config.fp8 import FP8Config
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.moe.expert_linear import ExpertFP8
from ptdp.engine.stage import build_stage
from ptdp.planner.candidate import run_candidate
from ptdp.planner.inputs.hardware import CATALOG, Cluster
from ptdp.planner.inputs.moe_model import planned_model
from ptdp.planner.memory.activations import rank_activation_bytes
from ptdp.planner.memory.fp8 import FP8_WEIGHT_COPY_BYTES, layer_fp8_weights
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, links_for
from ptdp.planner.time.moe_time import sublayer_times


def _config(recipe: str | None, shared: bool, dtype: str = "float32") -> Config:
    model = ModelConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=500,
        params_dtype=dtype,
        swiglu=True,
    )
    moe = MoEConfig(
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=96,
        moe_router_force_load_balancing=True,  # every expert its balanced share, as the planner counts
        moe_shared_expert_intermediate_size=64 if shared else None,
        moe_layer_freq=(0, 1, 1, 1),
    )
    train = TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * MICROBATCHES, lr_warmup_iters=0)
    fp8 = FP8Config(fp8_format="hybrid", fp8_recipe=recipe) if recipe else FP8Config()
    return resolve(Config(model=model, moe=moe, parallel=ParallelConfig(), train=train, fp8=fp8), 1)


@pytest.mark.parametrize(("recipe", "shared"), [(None, True), ("tensorwise", True), ("rowwise", False)])
def test_activations_of_fp8_experts_as_ptdp_keeps_them(recipe, shared):
    """The experts keep their inputs in the activations' dtype, the router its input, the shared
    expert's linears their FP8 operands: the planner's peak within the tolerance of the dense
    check (2%) of what autograd saves in one step."""
    config = _config(recipe, shared)
    got = measured_peak(config, ParallelGroups.single_process())
    want = rank_activation_bytes(
        planned_model(config), run_candidate(config), 0, 4, schedule="1f1b", make_vocab_size_divisible_by=8
    )
    assert abs(want / got - 1) <= TOLERANCE, (want, got)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_weight_copies_of_the_experts_and_the_shared_expert(recipe):
    """After a forward and backward each FP8 weight has its forward and transposed copies, 1 byte
    a value each: the planner's two bytes per weight of the attention, the dense layer's MLP, the
    shared experts and the rank's experts."""
    config = _config(recipe, shared=True)
    stage = build_stage(config, ParallelGroups.single_process())
    tokens = torch.randint(0, 500, (MICRO_BATCH, 33))
    loss = stage.model(tokens[:, :-1], tokens[:, 1:])
    loss.float().mean().backward()
    held = 0
    for gemms in stage.fp8_gemms:
        kept = [q for _, (q, _) in gemms._weights.values()]
        if isinstance(gemms, ExpertFP8):
            kept = [q for _, quantized in gemms._stacked.values() for q, _ in quantized]
        held += sum(q.numel() * q.element_size() for q in kept)
    planned = planned_model(config)
    want = FP8_WEIGHT_COPY_BYTES * 4 * layer_fp8_weights(planned, 1, experts=True)
    assert held == pytest.approx(want, rel=1e-12)
    assert layer_fp8_weights(planned, 1, experts=True) != layer_fp8_weights(planned, 1)  # not the dense count


def test_ptdp_experts_weight_gradients_run_at_the_bf16_rate():
    """Transformer Engine's experts run their weight gradients in FP8, ptdp train's in bf16: the
    backward differs by the experts' GEMMs at the two rates, the forward not at all."""
    gpu, c = CATALOG["h100-sxm"], DEFAULT_CONSTANTS.for_gpu(CATALOG["h100-sxm"])
    model = planned_model(_config("tensorwise", shared=True))
    model = dataclasses.replace(model, hidden_size=2048, ffn_hidden_size=4096, seq_length=2048)
    rates = (gpu.sustained_peak("bf16"), gpu.memory_bandwidth * c.hbm_efficiency, c, links_for(Cluster(gpu, 8), c))
    args = (model, 1, 1, 1, 1, 1, False, "alltoall", (), False, *rates, 2.0, gpu.sustained_peak("fp8"))
    te = sublayer_times(*args)
    ours = sublayer_times(*args, experts_wgrad_fp8=False)
    assert ours.forward == te.forward and ours.wgrad > te.wgrad > 0
    assert ours.backward - te.backward == pytest.approx(ours.wgrad - te.wgrad, rel=1e-12)
