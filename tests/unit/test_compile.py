"""``--compile`` at tp = 1: the tiny model compiled by inductor trains like eager mode (float32
tolerance), one graph serving every layer and two the chunked loss (tp = 2: tests/dist/test_compile_dist.py)."""

from __future__ import annotations

import pytest

from helpers.compile_cases import assert_trains_like_eager, eager_and_compiled
from ptdp.config.model import ModelConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.compile import compile_layers
from ptdp.engine.model.gpt import GPTModel


@pytest.mark.slow
def test_compiled_layers_train_like_eager():
    res = eager_and_compiled(1, ParallelGroups.single_process())
    assert_trains_like_eager(res)
    # one graph for the 4 layers (parameters are inputs), one each for the loss's chunk statistics
    # and chunk gradient (one chunk per microbatch here)
    assert res["graphs"] == 3


def test_compile_keeps_parameter_names():
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=4, vocab_size=300)
    model = GPTModel(cfg, ParallelGroups.single_process().tp, layer_ids=range(2), pre_process=True, post_process=True)
    names = [n for n, _ in model.named_parameters()]
    assert compile_layers(model) == 2
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == names


@pytest.mark.gpu
def test_compiled_layers_train_like_eager_on_cuda_in_bfloat16():
    """On a GPU in bfloat16 (float32 main parameters): the compiled layers' losses follow eager
    mode's within bf16 rounding over 3 steps."""
    import dataclasses

    import torch

    from helpers.layout_cases import rank_microbatches, tiny_config
    from ptdp.engine.stage import build_stage
    from ptdp.engine.step import train_step

    cfg = tiny_config(1, 1, 1, "bfloat16")
    losses = {}
    for compiled in (False, True):
        run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=compiled))
        stage = build_stage(run_cfg, ParallelGroups.single_process(), "cuda")
        losses[compiled] = [train_step(stage, rank_microbatches(i, cfg, 0, 1), i).loss for i in range(3)]
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-2, atol=2e-2)
