"""Dropout under tensor, pipeline and data parallelism (``--hidden-dropout``, ``--attention-dropout``).

- Masks: at (tp, pp, dp) = (2, 1, 2), recorded by the ``DropoutRNG``: the hidden-state masks
  (embedding, attention projection, fc2) are equal on the tp ranks of a replica, the attention
  probabilities' masks (per head) differ between them, and every mask differs between the dp
  replicas. With sequence parallelism the hidden-state masks (of each rank's sequence part) come
  from the tp-distinct streams and differ over tp too; recompute replays them.
- Layout independence: at (2, 2, 1), also interleaved, the masks of every stream and the training
  (losses, gradient norms, parameters after 3 steps) equal the single-process run in float64
  (1e-9): streams are named by global layer and head, not by rank.
- Reproducible: two runs are bitwise equal; dropout 0 draws nothing and is the identity.
- Recompute (full uniform/block, selective) replays the masks: bitwise equal to no recompute, in
  one process and at (2, 1, 2).
- Checkpoints: resuming at the same layout continues bitwise; with ``load_rng=False`` the streams
  are reseeded from the checkpoint's iteration.
- The explicit attention core (used with attention dropout) equals the fused kernel; the planner
  counts the saved activations with dropout; invalid probabilities are ConfigErrors.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from helpers.activations import TOLERANCE, measured_peak, predicted_peak
from helpers.dropout_cases import DROPOUT, LLAMA, RECOMPUTE, assert_bitwise, config, train
from helpers.layout_cases import tiny_config
from ptdp.config.flags import config_from_args
from ptdp.config.model import ModelConfig
from ptdp.config.train_flags import add_train_arguments
from ptdp.engine.comm import AxisGroup
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.attention import Attention
from ptdp.engine.stage import build_stage
from ptdp.engine.tensor_parallel.random import TP_DISTINCT, Dropout, DropoutRNG
from ptdp.errors import ConfigError

# -- one process -------------------------------------------------------------------------------


def test_invalid_probabilities_are_config_errors():
    for bad in ({"hidden_dropout": 1.0}, {"attention_dropout": -0.1}, {"hidden_dropout": float("nan")}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            tiny_config(1, 1, 1, "float64", **bad)


def test_flags():
    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=False)
    m = config_from_args(parser.parse_args(["--hidden-dropout", "0.1", "--attention-dropout", "0.05"])).model
    assert (m.hidden_dropout, m.attention_dropout) == (0.1, 0.05)
    m = config_from_args(parser.parse_args([])).model
    assert (m.hidden_dropout, m.attention_dropout) == (0.0, 0.0)


def test_masks_scale_and_gradient():
    rng = DropoutRNG(7)
    x = torch.ones(200_000, dtype=torch.float64, requires_grad=True)
    y = rng.dropout(x, 0.25, "probe")
    kept = y != 0
    assert abs(1 - kept.double().mean().item() - 0.25) < 0.005
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / 0.75))
    y.sum().backward()
    assert torch.equal(x.grad, kept.double() / 0.75)
    site = Dropout(0.25, rng, "probe")
    assert site.eval()(x) is x and Dropout(0.0, rng, "other")(x) is x
    assert "other" not in rng.get_states()  # nothing drawn with p = 0 or in eval mode


def test_streams_are_seeded_by_seed_dp_rank_and_name():
    x = torch.ones(64, 64)

    def mask(rng, key="layer.0", **kw):
        return rng.dropout(x, 0.5, key, **kw) == 0

    base = mask(DropoutRNG(1, dp_rank=0, tp_rank=0))
    assert torch.equal(base, mask(DropoutRNG(1, dp_rank=0, tp_rank=1)))  # replicated: tp rank not in the seed
    for other in (
        mask(DropoutRNG(2)),
        mask(DropoutRNG(1, dp_rank=1)),
        mask(DropoutRNG(1), key="layer.1"),
        mask(DropoutRNG(1), stream=TP_DISTINCT),
    ):
        assert not torch.equal(base, other)
    assert not torch.equal(
        mask(DropoutRNG(1, tp_rank=0), stream=TP_DISTINCT), mask(DropoutRNG(1, tp_rank=1), stream=TP_DISTINCT)
    )


@pytest.mark.parametrize("grouped", [False, True], ids=["mha", "gqa"])
def test_explicit_attention_core_equals_fused_kernel(grouped):
    """With a probability small enough to drop nothing, the explicit core (scores, causal
    softmax, per-head dropout, context) equals scaled_dot_product_attention."""
    cfg = ModelConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2 if grouped else None,
        attention_dropout=1e-12,
        params_dtype="float64",
    )
    attention = Attention(cfg, AxisGroup.single("tp"), torch.float64)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2 if grouped else 4, 8, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    explicit = attention.train().core(q, k, v)
    assert attention.rng.get_states(), "the explicit core must draw from the per-head streams"
    torch.testing.assert_close(explicit, attention.eval().core(q, k, v), rtol=1e-9, atol=1e-12)


def test_single_process_dropout_zero_draws_nothing_and_is_the_identity():
    """p = 0: training in train mode equals training with every dropout site in eval mode, bitwise,
    and no stream is ever created (attention uses the fused kernel)."""
    cfg = tiny_config(1, 1, 1, "float64", hidden_dropout=0.0, attention_dropout=0.0)
    groups = ParallelGroups.single_process()
    plain = train(cfg, groups)
    assert plain["stage"].dropout_rng.get_states() == {}
    stage = build_stage(cfg, groups)
    for module in stage.model.modules():
        if isinstance(module, (Dropout, Attention)):
            module.eval()
    assert_bitwise(train(cfg, groups, stage=stage), plain, "dropout 0 vs dropout sites off")
    with_dropout = train(config(1, 1, 1), groups)
    assert with_dropout["losses"] != plain["losses"]


def test_single_process_reproducible_and_recompute_replays_masks():
    groups = ParallelGroups.single_process()
    for model in ({}, LLAMA):
        base = train(config(1, 1, 1, **model), groups)
        assert_bitwise(train(config(1, 1, 1, **model), groups), base, "second run")
        for name, recompute in RECOMPUTE.items():
            assert_bitwise(train(config(1, 1, 1, **model, **recompute), groups), base, name)
    other_seed = tiny_config(1, 1, 1, "float64", train_overrides={"seed": 99}, **DROPOUT)
    assert train(other_seed, groups)["losses"] != base["losses"]


def test_planner_counts_saved_activations_with_dropout():
    """The bytes autograd saves with hidden and attention dropout (masks, the explicit core's
    probabilities) against the planner's model with dropout and the unfused kernel (use_flash_attn=False)."""
    from helpers.activations import case_config

    for dtype in ("float32", "float64"):
        cfg = case_config(1, 1, 1, "1f1b", dtype)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_dropout=0.1, attention_dropout=0.1))
        measured, predicted = measured_peak(cfg, ParallelGroups.single_process()), predicted_peak(cfg, 0)
        assert abs(measured / predicted - 1) <= TOLERANCE, (dtype, measured, predicted)
