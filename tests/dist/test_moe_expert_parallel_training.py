"""Expert parallelism trains exactly like one process (float64, 3 AdamW steps, clipping active):
per-step losses and gradient norms within 1e-9 relative and every parameter after them, the
experts rebuilt from their ep ranks' slices, at (tp, cp, pp, dp, ep) = (1,1,1,2,2), (1,1,1,4,4),
(2,1,1,2,2) with sequence parallelism (ep over the tp ranks), (1,2,1,2,2) (ep over
the cp ranks), (1,1,2,2,2) (two stages) and (1,1,1,4,2) (dp > ep): expert gradients summed over
their edp group, the norm counting each expert once, with every sharding strategy (experts'
state sharded over edp), each expert split over etp ranks ((1,1,1,2,1,2), (1,1,1,4,2,2),
(2,1,1,2,1,2)), both dispatchers, the interleaved schedule, optimizer post-validation (the expert
gradients' squares in its world all-reduce); bf16 parameters to bf16 precision."""

from __future__ import annotations

import pytest
import torch

from helpers.layout_cases import real_rows
from helpers.moe_cases import (
    EP_LAYOUTS,
    check_like_one_process,
    ep_full_parameters,
    ep_variants,
    ep_world_results,
    moe_config,
    reference,
)
from ptdp.run.planner_report import compare

CASES = [(world, layout) for world, layouts in EP_LAYOUTS.items() for layout in layouts]


@pytest.mark.parametrize(
    "world, layout",
    CASES,
    ids=lambda x: (
        "tp{}cp{}pp{}dp{}ep{}".format(*x) + (f"etp{x[5]}" if len(x) > 5 else "")
        if isinstance(x, tuple)
        else f"world{x}"
    ),
)
def test_expert_parallel_training_equals_one_process(world, layout):
    results = [rank_results[layout] for rank_results in ep_world_results(world)]
    for name in ep_variants(layout):
        _check_planner_bytes(results, name, layout)
        if "pad" in name.split(":"):
            _check_planner_exchange(results, name, layout)
        if "bf16" in name.split(":"):  # bf16 activations round differently per layout
            _track_bf16(results, name, reference(name), ep_full_parameters(results, name))
        else:
            check_like_one_process(results, name, reference(name), ep_full_parameters(results, name))
            _check_loads(results, name, reference(name), layout[4])


def _check_planner_bytes(results: list[dict], name: str, layout: tuple[int, ...]) -> None:
    """The planner's parameter, gradient and optimizer bytes of every rank equal what it holds
    (up to bucket padding), experts over ep x etp and their state over edp; with the sharded
    gradients of optim_grads / optim_grads_params also their transients when every layer is an
    MoE layer (moe_forced), not modelled with a dense layer among them."""
    config = moe_config(name, *layout)
    check = compare(config, [res[name]["measured"] for res in results], None, None)
    exact = {row["exact"] for row in check["ranks"]}
    sharded = {"optim_grads", "optim_grads_params"} & set(name.split(":"))
    mixed = not all(config.moe.moe_layers(config.model.num_layers))
    assert exact == ({None} if sharded and mixed else {True}), (name, check["ranks"])
    if sharded and not mixed:
        assert all(row["transients"]["measured"]["grads_transient"] > 0 for row in check["ranks"])


def _check_planner_exchange(results: list[dict], name: str, layout: tuple[int, ...]) -> None:
    """With expert inputs padded to the capacity every rank sends E C rows per MoE layer and
    micro-batch: the planner's elements per tag equal what ``ptdp.comm`` counted in a step."""
    from ptdp.engine.moe.capacity import expert_capacity
    from ptdp.planner.time.moe_exchange import moe_exchange_elements

    cfg = moe_config(name, *layout)
    moe, m = cfg.moe, cfg.num_microbatches
    e, calls = moe.num_experts, m * sum(moe.moe_layers(cfg.model.num_layers))
    rows = e * expert_capacity(cfg.train.micro_batch_size * cfg.model.seq_length, moe.moe_router_topk, e, 1.0)
    p = cfg.parallel
    want = moe_exchange_elements(
        rows, cfg.model.hidden_size, e, ep=p.ep, etp=p.etp, dispatcher=p.moe_token_dispatcher_type, padded=True
    )
    assert want
    for res in results:
        comm = res[name]["comm"]
        got = {key: value for key, value in comm.items() if key.split("/")[0] in ("ep", "etp") and "/moe_" in key}
        assert got == {key: {"calls": calls, "numel": calls * n, "bytes": 8 * calls * n} for key, n in want.items()}, (
            name,
            got,
        )


def _check_loads(results: list[dict], name: str, ref: dict, ep: int) -> None:
    """Every rank reports one process's tokens per expert of every MoE layer, and the most loaded
    ep rank's load over the mean from them."""
    for res in results:
        for got, want in zip(res[name]["moe"], ref["moe"]):
            assert got["moe_tokens_per_expert"] == want["moe_tokens_per_expert"], name
            rank_loads = [
                max(sum(t[j : j + len(t) // ep]) for j in range(0, len(t), len(t) // ep)) / (sum(t) / ep)
                for t in want["moe_tokens_per_expert"].values()
            ]
            assert abs(got["moe_max_rank_load"] - max(rank_loads)) <= 1e-12, name


def _track_bf16(results: list[dict], name: str, ref: dict, got: dict[str, torch.Tensor]) -> None:
    """bf16 parameters with float32 main parameters on both buffers: losses and norms to bf16
    precision, parameters within a few bf16 steps of one process's."""
    for res in results:
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0)
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), rtol=5e-2, atol=0)
    want = {key: real_rows(t, spec) for key, (t, spec, _) in ref["params"].items()}
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=0, atol=2e-2, msg=f"{name} {key}")


def test_a_steps_expert_parallel_traffic_is_the_formulas():
    """Dropless top-2 of 8 experts at (1,1,1,4,4): per MoE layer and micro-batch each rank sends
    its T k rows (h each) to the experts and gets them back, its E counts, and backward the same
    with the splits swapped (docs/architecture.md, Communication of one step)."""
    from helpers.moe_cases import moe_config

    results = [rank_results[(1, 1, 1, 4, 4)] for rank_results in ep_world_results(4)]
    cfg = moe_config("moe_ep", 1, 1, 1, 4, 4)
    m, layers = cfg.num_microbatches, sum(cfg.moe.moe_layers(cfg.model.num_layers))
    tokens, h, k, e = cfg.train.micro_batch_size * cfg.model.seq_length, cfg.model.hidden_size, 2, 8
    received = 0
    for res in results:
        comm = res["moe_ep_dropless"]["comm"]
        for tag in ("moe_dispatch", "moe_combine_grad"):
            assert comm[f"ep/all_to_all/{tag}"] == {
                "calls": m * layers,
                "numel": m * layers * tokens * k * h,
                "bytes": 8 * m * layers * tokens * k * h,
            }, tag
        assert comm["ep/all_to_all/moe_counts"]["numel"] == m * layers * e
        assert comm["ep/all_to_all/moe_combine"]["numel"] == comm["ep/all_to_all/moe_dispatch_grad"]["numel"]
        received += comm["ep/all_to_all/moe_combine"]["numel"]
    assert received == 4 * m * layers * tokens * k * h


def test_moe_layers_without_a_shared_expert_gather_over_tp_for_attention_only():
    """At tp 2 with sequence parallelism an MoE layer's routed experts take the rank's sequence
    shard: its attention all-gathers and reduce-scatters over tp, its MLP does not (a dense
    layer's does), as the planner times it (planner/time/stages.py, layer_terms)."""
    results = [rank_results[(2, 1, 1, 2, 2)] for rank_results in ep_world_results(4)]
    cfg = moe_config("moe_llama_sigmoid", 2, 1, 1, 2, 2)
    layers = cfg.model.num_layers
    dense = layers - sum(cfg.moe.moe_layers(layers))
    m = cfg.num_microbatches
    assert 0 < dense < layers and not cfg.moe.shared_ffn
    for res in results:
        comm = res["moe_llama_sigmoid"]["comm"]
        for kind in ("all_gather", "reduce_scatter"):
            for tag in ("attn_qkv", "attn_proj"):
                assert comm[f"tp/{kind}/{tag}"]["calls"] == m * layers, (kind, tag)
            for tag in ("mlp_fc1", "mlp_fc2"):
                assert comm[f"tp/{kind}/{tag}"]["calls"] == m * dense, (kind, tag)
