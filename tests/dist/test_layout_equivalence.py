"""Invariant 1: every layout trains exactly like the single-process model.

Per-step losses and gradient norms over 3 AdamW steps (clipping firing, 2-4 microbatches per
step, tied embeddings, a vocabulary that tp does not divide before padding), and every parameter
after them, equal the tp=pp=dp=1 run: float64 within 1e-9 relative, float32 within 1e-5.
Data-parallel replicas and the two copies of the tied embedding must be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from helpers.layout_cases import (
    DP_LAYOUTS,
    DP_VARIANTS,
    EXTRA_VARIANT_LAYOUTS,
    EXTRA_VARIANTS,
    LAYOUTS,
    PAD_RANK_VARIANTS,
    POSTVAL_VARIANTS,
    QK_NORM_LAYOUTS,
    QK_NORM_VARIANTS,
    SCHEDULE_LAYOUTS,
    SCHEDULE_VARIANTS,
    SP_LAYOUTS,
    TOL,
    ZB_SHARDED_VARIANTS,
    full_parameters,
    llama_variant,
    parallel_run,
    real_rows,
    reference,
    sp_variants,
)


def assert_matches_reference(results: list[dict], variant: str, tol: dict) -> None:
    ref = reference(variant)
    for res in results:
        torch.testing.assert_close(torch.tensor(res[variant]["losses"]), torch.tensor(ref["losses"]), **tol)
        torch.testing.assert_close(torch.tensor(res[variant]["norms"]), torch.tensor(ref["norms"]), **tol)
    assert all(n > 0.05 for n in ref["norms"]), "clipping (clip_grad=0.05) must fire in this test"
    got = full_parameters(results, variant)
    want = {name: real_rows(t, spec) for name, (t, spec, _) in ref["params"].items()}
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_layout_matches_single_process(layout, dtype):
    assert_matches_reference(parallel_run(*layout), dtype, TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_llama_options_match_single_process(layout):
    """RMSNorm, SwiGLU, rotary positions, grouped-query attention (2 groups of 2 heads; at tp = 4,
    4 groups of 2), no linear biases and an untied output layer: float64 within 1e-9 at every
    layout, so the per-group QKV shards and the [gate | up] shards are exact."""
    variant = llama_variant(layout[0])
    results = parallel_run(*layout)
    assert_matches_reference(results, variant, TOL["float64"])
    names = results[0][variant]["params"]
    assert not any(n.endswith(".bias") for n in names) and "position_embeddings" not in names


@pytest.mark.parametrize("variant", EXTRA_VARIANTS)
@pytest.mark.parametrize("layout", sorted(EXTRA_VARIANT_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_variants_match_single_process(layout, variant):
    """Untied output layer, an explicit uneven layer split, and a single microbatch per step."""
    assert_matches_reference(parallel_run(*layout), variant, TOL["float64"])


@pytest.mark.parametrize("schedule", SCHEDULE_VARIANTS)
@pytest.mark.parametrize("layout", sorted(SCHEDULE_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_pipeline_schedules_match_single_process(layout, schedule):
    """GPipe, interleaved 1F1B (v = 2, also at pp = 2 where the next and previous rank are the
    same process), ZB-H1, ZB-H2, ZB-V and DualPipeV (weight gradients deferred from B to W; ZB-H2
    and DualPipeV with full recompute, ZB-H2 and ZB-V with the distributed optimizer) train exactly
    like the single-process model (1F1B is the default variant)."""
    assert_matches_reference(parallel_run(*layout), schedule, TOL["float64"])


@pytest.mark.parametrize("variant", ZB_SHARDED_VARIANTS)
@pytest.mark.parametrize(
    "layout", sorted(lay for lay in SCHEDULE_LAYOUTS if lay[2] > 1), ids=lambda l: "tp{}pp{}dp{}".format(*l)
)
def test_zero_bubble_with_sharded_gradients_matches_single_process(layout, variant):
    """ZB-H1 with ZeRO-2 and ZB-V with ZeRO-3: each chunk's gradients reduce-scattered once, from
    the W completing them."""
    assert_matches_reference(parallel_run(*layout), variant, TOL["float64"])


@pytest.mark.parametrize("variant", DP_VARIANTS)
@pytest.mark.parametrize("layout", sorted(DP_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_data_parallel_engine_matches_single_process(layout, variant):
    """Overlapped bucketed reduction, the distributed optimizer (with bucket padding), and long
    gradient accumulation train exactly like dp = 1; replicas and tied-embedding copies stay
    bitwise equal (checked by full_parameters)."""
    assert_matches_reference(parallel_run(*layout), variant, TOL["float64"])


@pytest.mark.parametrize("variant", POSTVAL_VARIANTS)
@pytest.mark.parametrize("layout", sorted(DP_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_optimizer_post_validation_matches_single_process(layout, variant):
    """--enable-optimizer-post-validation: the norm's square and the skip flags in one world
    all-reduce, updates rolled back and redone clipped (or kept, unclipped), without sharding,
    with the distributed optimizer and with sharded parameters, 1F1B and ZB-H1: float64 within
    1e-9 of one synchronous process, replicas bitwise equal."""
    assert_matches_reference(parallel_run(*layout), variant, TOL["float64"])


@pytest.mark.parametrize("layout", sorted(DP_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_distributed_optimizer_bf16_tracks_single_process(layout):
    ref = reference("dp_distopt_bf16")
    results = parallel_run(*layout)
    for res in results:
        torch.testing.assert_close(
            torch.tensor(res["dp_distopt_bf16"]["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0
        )
    full_parameters(results, "dp_distopt_bf16")  # replicas and tied copies bitwise equal


@pytest.mark.parametrize("layout", sorted(DP_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_bf16_gradient_reduction_tracks_single_process(layout):
    """--grad-reduce-in-bf16: gradients accumulated and reduced in bf16 round differently per
    layout; losses agree to bf16 precision with the single process's, replicas stay bitwise equal."""
    ref = reference("dp_bf16_grads")
    results = parallel_run(*layout)
    for res in results:
        torch.testing.assert_close(
            torch.tensor(res["dp_bf16_grads"]["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0
        )
    full_parameters(results, "dp_bf16_grads")


@pytest.mark.parametrize("layout", sorted(SP_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_sequence_parallel_matches_single_process(layout):
    """Sequence parallelism (Korthikanti et al. 2022, §4.2.2): the GPT, (tp = 2) the Llama-like
    model with full recompute, and (dp > 1) the distributed optimizer with overlapped small buckets
    train like the single-process model without it, float64 within 1e-9; every tp rank's copy of a
    replicated parameter (norms, row-parallel biases, positions: gradients summed over tp) is
    bitwise equal."""
    results = parallel_run(*layout)
    for variant in sp_variants(layout[0], layout[2]):
        assert_matches_reference(results, variant, TOL["float64"])
        copies: dict[tuple[str, int, int], torch.Tensor] = {}
        for res in results:
            _, dp_rank, pp_rank = res[variant]["coords"]
            for name, (tensor, spec, _) in res[variant]["params"].items():
                if spec.tp_dim is None:
                    first = copies.setdefault((name, dp_rank, pp_rank), tensor)
                    assert torch.equal(first, tensor), f"{variant} {name}: tp copies differ"
        assert any(name.endswith("ln1.weight") for name, _, _ in copies)


@pytest.mark.parametrize("variant", QK_NORM_VARIANTS)
@pytest.mark.parametrize("layout", sorted(QK_NORM_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_qwen3_heads_match_single_process(layout, variant):
    """Heads of 12 channels (h / a = 8) with query/key norms: each tp rank normalizes its own heads,
    so the norms' gradients are summed over tp (with and without sequence parallelism); float64
    within 1e-9, every tp rank's copy of the norms bitwise equal."""
    results = parallel_run(*layout)
    assert_matches_reference(results, variant, TOL["float64"])
    norms = {}
    for res in results:
        _, dp_rank, pp_rank = res[variant]["coords"]
        for name, (tensor, _, _) in res[variant]["params"].items():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                assert torch.equal(norms.setdefault((name, dp_rank, pp_rank), tensor), tensor), name
    assert len({name for name, _, _ in norms}) == 2 * 4  # 4 layers


def test_interleaved_ranks_hold_their_chunks():
    results = parallel_run(1, 2, 1)
    layers = {
        res["interleaved"]["coords"][2]: sorted(
            {int(n.split(".")[1]) for n in res["interleaved"]["params"] if n.startswith("layers.")}
        )
        for res in results
    }
    assert layers == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}


@pytest.mark.parametrize("layout", sorted(EXTRA_VARIANT_LAYOUTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_bfloat16_layouts_track_single_process(layout):
    """bf16 activations round differently per layout; losses and norms agree to bf16 precision."""
    ref = reference("bfloat16")
    for res in parallel_run(*layout):
        torch.testing.assert_close(
            torch.tensor(res["bfloat16"]["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0
        )
        torch.testing.assert_close(
            torch.tensor(res["bfloat16"]["norms"]), torch.tensor(ref["norms"]), rtol=5e-2, atol=0
        )
    full_parameters(parallel_run(*layout), "bfloat16")  # replicas and tied copies stay bitwise equal


def test_uneven_split_places_every_layer_once():
    results = parallel_run(2, 2, 1)
    layers_by_stage = {}
    for res in results:
        pp_rank = res["uneven"]["coords"][2]
        layers_by_stage[pp_rank] = sorted({n.split(".")[1] for n in res["uneven"]["params"] if n.startswith("layers.")})
    assert layers_by_stage == {0: ["0", "1", "2"], 1: ["3", "4"]}


def test_padded_vocab_rows_stay_zero():
    results = parallel_run(4, 1, 1)
    for res in results:
        tensor, spec, _ = res["float64"]["params"]["word_embeddings.weight"]
        assert spec.global_shape[0] == 320  # 303 padded to a multiple of 8 * tp
        tp_rank = res["float64"]["coords"][0]
        rows = torch.arange(tp_rank * 80, (tp_rank + 1) * 80)
        assert tensor.shape[0] == 80
        assert torch.all(tensor[rows >= 303] == 0)
        assert torch.any(tensor[rows < 303] != 0)


@pytest.mark.parametrize("layout", sorted(PAD_RANK_VARIANTS), ids=lambda l: "tp{}pp{}dp{}".format(*l))
def test_rank_holding_only_vocabulary_padding_trains_like_single_process(layout):
    """303 real rows padded to 512 over tp = 4: the last tp rank's 128 rows are all padding (its
    logits are ``[b, s, 0]``), yet it joins every collective of the output layer and the loss with
    the same shapes (untied without, and tied with sequence parallelism), and training is exact."""
    results = parallel_run(*layout)
    (variant,) = PAD_RANK_VARIANTS[layout]
    assert_matches_reference(results, variant, TOL["float64"])
    for res in results:
        name = "output_layer.weight" if "output_layer.weight" in res[variant]["params"] else "word_embeddings.weight"
        tensor, spec, _ = res[variant]["params"][name]
        assert spec.global_shape[0] == 512 and tensor.shape[0] == 128
        if res[variant]["coords"][0] == 3:
            assert spec.real_rows <= 3 * 128 and torch.all(tensor == 0)
