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
import functools
from pathlib import Path

import pytest
import torch

from ptdp.commands.train_flags import add_train_arguments, config_from_args
from ptdp.run.checkpoint.io import load_checkpoint, save_checkpoint
from ptdp.engine.comm import AxisGroup
from ptdp.spec import Config, ConfigError, ModelConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.spec.layout import ParallelLayout
from ptdp.engine.model.chunks import global_named_parameters
from ptdp.engine.model.gpt import Attention
from ptdp.engine.step import build_stage, train_step
from ptdp.engine.tensor_parallel.random import TP_DISTINCT, Dropout, DropoutRNG
from dist_helpers import PG_TIMEOUT, run_workers
from layout_cases import STEPS, rank_microbatches, tiny_config
from test_layout_equivalence import TOL, full_parameters
from test_planner_activations import TOLERANCE, measured_peak, predicted_peak

P = 0.2
DROPOUT = {"hidden_dropout": P, "attention_dropout": P}
LLAMA = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "num_query_groups": 2,
         "add_bias_linear": False}
RECOMPUTE = {"full_uniform_1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
             "full_uniform_2": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
             "full_block_1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
             "selective": {"recompute_granularity": "selective"}}


def config(tp: int, pp: int, dp: int, *, parallel: dict | None = None, **model) -> Config:
    return tiny_config(tp, pp, dp, "float64", parallel_overrides=parallel, **(DROPOUT | model))


def train(cfg: Config, groups: ParallelGroups, *, steps=range(STEPS), stage=None, record=False) -> dict:
    """Train ``steps`` (iteration numbers) on the layout_cases data; losses, norms, parameters,
    and the recorded masks ``(stream name, mask)`` in draw order when ``record``."""
    stage = stage if stage is not None else build_stage(cfg, groups)
    if record:
        stage.dropout_rng.recording = []
    losses, norms = [], []
    for step in steps:
        result = train_step(stage, rank_microbatches(step, cfg, groups.dp.rank, groups.dp.size), step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    stage.wait_for_params()
    c = groups.coords
    return {"losses": losses, "norms": norms, "coords": (c.tp_rank, c.dp_rank, c.pp_rank),
            "params": {name: (p.detach().clone(), p.ptdp_spec, False) for name, p in global_named_parameters(stage.model)},
            "masks": stage.dropout_rng.recording, "stage": stage}


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == want["losses"] and got["norms"] == want["norms"], what
    for name, (tensor, _, _) in want["params"].items():
        assert torch.equal(got["params"][name][0], tensor), f"{what}: {name}"


def by_stream(masks: list[tuple[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for name, mask in masks:
        out.setdefault(name, []).append(mask)
    return out


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
    for other in (mask(DropoutRNG(2)), mask(DropoutRNG(1, dp_rank=1)), mask(DropoutRNG(1), key="layer.1"),
                  mask(DropoutRNG(1), stream=TP_DISTINCT)):
        assert not torch.equal(base, other)
    assert not torch.equal(mask(DropoutRNG(1, tp_rank=0), stream=TP_DISTINCT),
                           mask(DropoutRNG(1, tp_rank=1), stream=TP_DISTINCT))


@pytest.mark.parametrize("grouped", [False, True], ids=["mha", "gqa"])
def test_explicit_attention_core_equals_fused_kernel(grouped):
    """With a probability small enough to drop nothing, the explicit core (scores, causal
    softmax, per-head dropout, context) equals scaled_dot_product_attention."""
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2 if grouped else None,
                      attention_dropout=1e-12, params_dtype="float64")
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
    probabilities) against the planner's ModelSpec(dropout=True, flash_attention=False)."""
    from test_planner_activations import case_config
    for dtype in ("float32", "float64"):
        cfg = case_config(1, 1, 1, "1f1b", dtype)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_dropout=0.1, attention_dropout=0.1))
        measured, predicted = measured_peak(cfg, ParallelGroups.single_process()), predicted_peak(cfg, 0)
        assert abs(measured / predicted - 1) <= TOLERANCE, (dtype, measured, predicted)


# -- several processes: (2, 1, 2) and (2, 2, 1) in one world of 4 ---------------------------------


@functools.cache
def single_process_runs() -> dict:
    groups = ParallelGroups.single_process()
    return {"plain": train(config(1, 1, 1), groups, record=True),
            "interleaved": train(config(1, 1, 1, num_layers=8), groups, record=True)}


def _worker(rank: int, world: int, folder: str) -> dict:
    out = {}
    # (2, 2, 1): the same masks and training as one process (also 2 chunks per rank)
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=2, dp=1), PG_TIMEOUT)
    for name, cfg in (("plain", config(2, 2, 1)),
                      ("interleaved", config(2, 2, 1, num_layers=8, parallel={"num_layers_per_virtual_pipeline_stage": 2}))):
        out[("221", name)] = _portable(train(cfg, groups, record=True))
    # (2, 1, 2): mask properties, reproducibility, recompute, checkpoint resume
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=1, dp=2), PG_TIMEOUT)
    cfg = config(2, 1, 2)
    out[("212", "plain")] = _portable(train(cfg, groups, record=True))
    out[("212", "again")] = _portable(train(cfg, groups))
    for name in ("full_uniform_1", "selective"):
        out[("212", name)] = _portable(train(config(2, 1, 2, **RECOMPUTE[name]), groups))
    sp = {"sequence_parallel": True}
    out[("212", "sp")] = _portable(train(config(2, 1, 2, parallel=sp), groups, record=True))
    out[("212", "sp_recompute")] = _portable(train(config(2, 1, 2, parallel=sp, **RECOMPUTE["full_uniform_1"]), groups))
    out[("212", "resume")] = _resume(cfg, groups, Path(folder))
    return out


def _resume(cfg: Config, groups: ParallelGroups, folder: Path) -> dict:
    """Train 2 steps, save, train the 3rd; a new stage loading the checkpoint trains the 3rd
    again, with the saved dropout streams and without them (reseeded)."""
    first = train(cfg, groups, steps=range(2))
    save_checkpoint(first["stage"], folder, 2, consumed_samples=2 * cfg.train.global_batch_size)
    uninterrupted = train(cfg, groups, steps=[2], stage=first["stage"])
    resumed, reseeded = build_stage(cfg, groups), build_stage(cfg, groups)
    load_checkpoint(resumed, folder)
    load_checkpoint(reseeded, folder, load_rng=False)
    assert reseeded.dropout_rng.reseed_iteration == 2
    return {name: _portable(run) for name, run in (("uninterrupted", uninterrupted),
                                                    ("resumed", train(cfg, groups, steps=[2], stage=resumed)),
                                                    ("reseeded", train(cfg, groups, steps=[2], stage=reseeded)))}


def _portable(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "stage"}


@pytest.fixture(scope="module")
def parallel(tmp_path_factory) -> list[dict]:
    return run_workers(_worker, 4, str(tmp_path_factory.mktemp("dropout_ckpt")))


def test_tp2_dp2_mask_properties(parallel):
    runs = {r[("212", "plain")]["coords"][:2]: r[("212", "plain")]["masks"] for r in parallel}
    heads_seen = set()
    for dp in (0, 1):  # tp ranks of a replica: hidden masks equal, head masks differ
        a, b = runs[(0, dp)], runs[(1, dp)]
        hidden_a = [(n, m) for n, m in a if "/head" not in n]
        hidden_b = [(n, m) for n, m in b if "/head" not in n]
        m = 2  # microbatches per step and replica
        assert len(hidden_a) == STEPS * m * (1 + 2 * 4)  # embedding + 2 per layer, 4 layers
        assert [n for n, _ in hidden_a] == [n for n, _ in hidden_b]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(hidden_a, hidden_b))
        heads_a = [(n, m) for n, m in a if "/head" in n]
        heads_b = [(n, m) for n, m in b if "/head" in n]
        assert len(heads_a) == len(heads_b) == STEPS * m * 4 * 2  # 4 layers x 2 local heads
        assert not {n for n, _ in heads_a} & {n for n, _ in heads_b}
        assert not any(torch.equal(x, y) for (_, x), (_, y) in zip(heads_a, heads_b))
        heads_seen |= {n.split("/")[1] for n, _ in heads_a + heads_b}
    assert heads_seen == {"head0", "head1", "head2", "head3"}
    for tp in (0, 1):  # dp replicas: every mask differs
        a, b = runs[(tp, 0)], runs[(tp, 1)]
        assert [n for n, _ in a] == [n for n, _ in b]
        assert not any(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))



def test_tp2_dp2_sequence_parallel_masks_differ_over_tp(parallel):
    """Hidden states [b, s/2, h] per rank: every rank masks its part from its own stream."""
    runs = {r[("212", "sp")]["coords"][:2]: [(n, m) for n, m in r[("212", "sp")]["masks"] if "/head" not in n]
            for r in parallel}
    for (tp, _dp), masks in runs.items():
        assert masks and all(n.endswith(f"/tp{tp}") and m.shape == (2, 4, 32) for n, m in masks)
    for i in range(len(runs[(0, 0)])):
        assert len({tuple(masks[i][1].flatten().tolist()) for masks in runs.values()}) == 4, i
    for r in parallel:
        assert_bitwise(r[("212", "sp_recompute")], r[("212", "sp")], "sequence parallel, full recompute")


def test_tp2_dp2_reproducible_and_recompute_replays_masks(parallel):
    for r in parallel:
        assert_bitwise(r[("212", "again")], r[("212", "plain")], "second run")
        for name in ("full_uniform_1", "selective"):
            assert_bitwise(r[("212", name)], r[("212", "plain")], name)
    assert len({tuple(r[("212", "plain")]["losses"]) for r in parallel}) == 1


def test_tp2_dp2_checkpoint_resume_is_bitwise(parallel):
    for r in parallel:
        runs = r[("212", "resume")]
        assert_bitwise(runs["resumed"], runs["uninterrupted"], "resumed")
        assert runs["reseeded"]["losses"] != runs["uninterrupted"]["losses"]


@pytest.mark.parametrize("variant", ["plain", "interleaved"])
def test_tp2_pp2_masks_and_training_equal_single_process(parallel, variant):
    ref = single_process_runs()[variant]
    want = by_stream(ref["masks"])
    results = [r[("221", variant)] for r in parallel]
    seen = set()
    for res in results:
        for name, masks in by_stream(res["masks"]).items():
            assert len(masks) == len(want[name]) and all(torch.equal(x, y) for x, y in zip(masks, want[name])), name
            seen.add(name)
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL["float64"])
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), **TOL["float64"])
    assert seen == set(want)
    got = full_parameters([{variant: r} for r in results], variant)
    for name, (tensor, spec, _) in ref["params"].items():
        real = tensor[: spec.real_rows] if spec.real_rows is not None else tensor
        torch.testing.assert_close(got[name], real, **TOL["float64"], msg=lambda m: f"{name}: {m}")
