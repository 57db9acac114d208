"""Activation recomputation: same training, fewer saved activations, the expected extra all-reduces.

- Full recompute (uniform with 1 and 2 layers per group, block with 1 layer) and selective
  recompute train bitwise like the same layout without recompute, in float64 and float32, at
  (tp, pp, dp) = (1, 1, 1) and (2, 2, 2) (also interleaved, with overlapped parameter gathers and
  with the Llama options: rotary positions, grouped-query attention, SwiGLU, RMSNorm):
  losses, gradient norms and every parameter after 3 steps.
- Saved activations of one microbatch's forward, counted with ``saved_tensors_hooks``: full
  uniform keeps exactly the inputs of its groups, block the inputs of its recomputed layers plus
  everything of the others, selective drops the ``s x s`` attention probabilities.
- A recomputed group of n layers repeats 2n - 1 forward tp all-reduces per microbatch.
- Invalid recompute settings are ConfigErrors.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers.recompute_cases import CASES, FULL_UNIFORM_2, RECOMPUTE, SELECTIVE, assert_bitwise, run_cases
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.model.recompute import layer_groups
from ptdp.engine.tensor_parallel.sharding import initialize_parameters
from ptdp.errors import ConfigError
from ptdp.planner.candidate import run_candidate


def test_single_process_recompute_is_bitwise_identical():
    results = run_cases(1, 1, 1, ParallelGroups.single_process())
    for base, recompute in CASES:
        assert_bitwise(results, base, recompute)


def _middle_stage(recompute: dict, num_layers: int = 4) -> tuple[GPTModel, ModelConfig]:
    cfg = ModelConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=16,
        vocab_size=303,
        make_vocab_size_divisible_by=8,
        params_dtype="float64",
        **recompute,
    )
    tp = ParallelGroups.single_process().tp
    model = GPTModel(cfg, tp, layer_ids=range(num_layers), pre_process=False, post_process=False)
    initialize_parameters(model, seed=1, std=0.02, num_layers=num_layers, tp_rank=0, tp_size=1)
    return model, cfg


def saved_activations(model: GPTModel, x: torch.Tensor, seq: int) -> tuple[int, int]:
    """Bytes of the distinct storages saved for backward by one forward (parameters excluded), and
    how many saved tensors are ``s x s`` attention scores or probabilities."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    scores = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal scores
        key = t.untyped_storage().data_ptr()
        if key not in params:
            storages[key] = t.untyped_storage().nbytes()
            scores += t.dim() >= 2 and tuple(t.shape[-2:]) == (seq, seq)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values()), scores


@pytest.mark.parametrize("kernel", ["default", "math"])
def test_recompute_saves_activations(kernel):
    """One microbatch through a 4-layer middle stage (b=2, s=16, h=32, a=4, float64). The math
    kernel stores the ``b a s^2`` probabilities as Megatron's unfused attention does; the fused
    kernel CPU picks by default never stores scores, so selective saves little there."""
    b, s, h, layers = 2, 16, 32, 4
    bsh = b * s * h * 8
    x = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)  # [s, b, h]
    backend = SDPBackend.MATH if kernel == "math" else None
    measured = {}
    for name, recompute in [("none", {})] + list(RECOMPUTE.items()):
        model, _ = _middle_stage(recompute)
        if backend is None:
            measured[name] = saved_activations(model, x, s)
        else:
            with sdpa_kernel(backend):
                measured[name] = saved_activations(model, x, s)
    per_layer = measured["none"][0] / layers
    assert measured["full_uniform_1"] == (layers * bsh, 0)  # each layer's input, nothing else
    assert measured["full_uniform_2"] == (layers // 2 * bsh, 0)  # the input of each pair
    assert measured["full_block_1"][0] == bsh + (layers - 1) * per_layer  # layer 0 by its input only
    selective, none = measured["selective"], measured["none"]
    assert selective[1] == 0 and selective[0] < none[0]
    if kernel == "math":
        probs = b * 4 * s * s * 8  # [b, a, s, s] float64 per layer
        assert none[1] >= layers and none[0] - selective[0] >= layers * probs
        assert measured["full_uniform_1"][0] < selective[0] < 0.9 * none[0]


def test_recompute_and_backward_under_the_math_kernel_match():
    """The recompute reruns the kernel of the forward: gradients equal with the math kernel too."""
    grads = []
    for recompute in ({}, SELECTIVE, FULL_UNIFORM_2):
        model, _ = _middle_stage(recompute)
        x = torch.randn(16, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with sdpa_kernel(SDPBackend.MATH):
            model(x).square().sum().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


def test_layer_groups():
    assert layer_groups(5, "uniform", 2) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert layer_groups(4, "uniform", 1) == [(i, i + 1, True) for i in range(4)]
    assert layer_groups(5, "block", 2) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert layer_groups(2, "block", 2) == [(0, 1, True), (1, 2, True)]


def _resolve(world: int = 1, parallel: dict | None = None, **model) -> Config:
    cfg = Config(
        model=ModelConfig(num_layers=4, vocab_size=303, **model),
        parallel=ParallelConfig(**(parallel or {})),
        train=TrainConfig(micro_batch_size=1, global_batch_size=8),
    )
    return resolve(cfg, world)


def test_full_defaults_to_uniform_one_layer():
    m = _resolve(recompute_granularity="full").model
    assert (m.recompute_method, m.recompute_num_layers) == ("uniform", 1)
    m = _resolve(recompute_granularity="selective").model
    assert (m.recompute_method, m.recompute_num_layers) == (None, None)
    assert _resolve().model.recompute_granularity is None


@pytest.mark.parametrize(
    "model, parallel, message",
    [
        ({"recompute_granularity": "everything"}, {}, "recompute_granularity='everything' must be one of"),
        ({"recompute_method": "uniform"}, {}, "recompute_method='uniform' needs recompute_granularity=full"),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 1},
            {},
            "recompute_num_layers=1 needs recompute_granularity=full, not 'selective'",
        ),
        (
            {"recompute_granularity": "full", "recompute_method": "blocks"},
            {},
            "recompute_method='blocks' must be one of",
        ),
        ({"recompute_granularity": "full", "recompute_num_layers": 0}, {}, "recompute_num_layers=0 must be a positive"),
        (
            {"recompute_granularity": "full", "recompute_method": "block"},
            {},
            "recompute_method=block needs recompute_num_layers",
        ),
        (
            {"recompute_granularity": "full", "recompute_num_layers": 5},
            {},
            "recompute_num_layers=5 is more than the 4 layers of the smallest model chunk",
        ),
        # pp = 2: 2 layers per stage
        (
            {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
            {"pipeline_model_parallel_size": 2},
            "recompute_num_layers=3 is more than the 2 layers",
        ),
        # uneven split 3 + 1: the smallest stage decides
        (
            {"recompute_granularity": "full", "recompute_num_layers": 2},
            {"pipeline_model_parallel_size": 2, "pipeline_layer_split": (3, 1)},
            "layers per chunk: [3, 1]",
        ),
        # interleaved: 1 layer per model chunk
        (
            {"recompute_granularity": "full", "recompute_num_layers": 2},
            {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1},
            "the 1 layers of the smallest",
        ),
    ],
)
def test_invalid_recompute_settings(model, parallel, message):
    world = parallel.get("pipeline_model_parallel_size", 1)
    with pytest.raises(ConfigError, match=re.escape(message)):
        _resolve(world, parallel, **model)


def test_planner_layout_takes_the_granularity():
    assert run_candidate(_resolve(params_dtype="float32")).recompute == "none"
    assert run_candidate(_resolve(params_dtype="float32", recompute_granularity="selective")).recompute == "selective"
    assert run_candidate(_resolve(params_dtype="float32", recompute_granularity="full")).recompute == "full"


def test_cli_flags_reach_the_config():
    import argparse

    from ptdp.config.flags import config_from_args
    from ptdp.config.train_flags import add_train_arguments

    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=False)
    args = parser.parse_args(
        ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
    )
    m = config_from_args(args).model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "block", 1)
    assert config_from_args(parser.parse_args([])).model.recompute_granularity is None
