"""Context parallelism trains exactly like one process (float64, 3 AdamW steps, clipping active):
per-step losses and gradient norms within 1e-9 relative, every parameter after them, at
(tp, cp, pp, dp) = (1,2,1,1), (1,4,1,1), (2,2,1,1), (1,2,2,1), (1,2,1,2), (2,2,2,1): the GPT and
the Llama-like model (rotary, grouped-query attention), each with both ``--cp-comm-type``s at every
layout; hidden and attention dropout (the masks of the unsplit model at every cp) with selective
or full recompute at the dp = 1 layouts; sequence parallelism inside the cp ranks (with dropout,
and with selective recompute) at tp = 2; the initial model's evaluation (the forward-only
schedule) at every layout; interleaved 1F1B and GPipe at (1,2,2,1); bf16 weights at cp = 2 within bf16
precision; no step with cp, dropout and (at tp = 2) sequence parallelism makes a call that would
synchronise the host on a GPU; the tp and pp traffic of a step is that of the rank's s/cp rows
(pipeline transfers ``[s/cp, b, h]``, ``[s/(cp tp), b, h]`` with sequence parallelism). Each cp
rank holds chunks r and 2cp-1-r of every sequence; parameters are replicated over cp, and every
copy (cp, dp, the tied embedding) must be bitwise equal. All layouts of a world size run in one job
(:mod:`helpers.cp_cases`)."""

from __future__ import annotations

import pytest
import torch

from helpers.cp_cases import EVALUATED, LAYOUTS, SYNC_COUNTED, VARIANTS, cp_config, reference, variants, world_results
from helpers.layout_cases import TOL, full_parameters, real_rows

CASES = [(world, layout) for world, layouts in LAYOUTS.items() for layout in layouts]


def _check(results: list[dict], name: str) -> None:
    ref = reference(name)
    if VARIANTS[name][0].get("params_dtype") == "bfloat16":
        return _check_bf16(results, ref, name)
    assert all(n > 0.05 for n in ref["norms"]), "clipping (clip_grad=0.05) must fire in this test"
    for res in results:
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), **TOL["float64"])
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), **TOL["float64"])
    got = full_parameters(results, name)  # cp and dp replicas and tied copies bitwise equal
    want = {key: real_rows(t, spec) for key, (t, spec, _) in ref["params"].items()}
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL["float64"], msg=lambda m, key=key: f"{name} {key}: {m}")


def _check_bf16(results: list[dict], ref: dict, name: str) -> None:
    """bf16 activations round differently when the sequence is split: losses and norms agree to
    bf16 precision; cp replicas stay bitwise equal."""
    for res in results:
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0)
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), rtol=5e-2, atol=0)
    full_parameters(results, name)


@pytest.mark.parametrize(
    "world, layout", CASES, ids=lambda x: "tp{}cp{}pp{}dp{}".format(*x) if isinstance(x, tuple) else f"world{x}"
)
def test_context_parallel_trains_like_one_process(world, layout):
    results = [rank_results[layout] for rank_results in world_results(world)]
    assert sorted({res["gpt_p2p"]["cp_rank"] for res in results}) == list(range(layout[1]))
    for name in variants(*layout):
        _check(results, name)
    for name in EVALUATED:  # the forward-only schedule: evaluation of the initial model
        for res in results:
            assert abs(res[name]["eval"] - reference(name)["eval"]) <= 1e-9 * reference(name)["eval"], name
    for counted_layout, name in SYNC_COUNTED:  # cp attention, positions and dropout masks: no host sync
        if counted_layout == layout:
            for res in results:
                assert res[name]["syncs"] == [[], []], res[name]["syncs"]


def test_every_option_runs_at_two_layouts_or_more():
    """Coverage of the cases above: each option at >= 2 layouts, each model with each comm type
    everywhere."""
    layouts = [layout for ls in LAYOUTS.values() for layout in ls]
    for option in ("dropout", "selective", "full", "sp", "llama"):
        assert sum(any(option in name for name in variants(*layout)) for layout in layouts) >= 2, option
    for layout in layouts:
        names = variants(*layout)
        for model in ("gpt", "llama"):
            for comm in ("p2p", "all_gather"):
                assert any(n.startswith(model) and n.endswith(comm) for n in names), (layout, model, comm)


def _traffic(comm: dict, axis: str, op: str, tag: str | None = None) -> tuple[int, int]:
    """Calls and elements of the first step's ``axis/op[/tag]`` communication."""
    keys = [key.split("/") for key in comm]
    hits = [comm["/".join(k)] for k in keys if k[0] == axis and k[1] == op and (tag is None or k[2] == tag)]
    return sum(c["calls"] for c in hits), sum(c["numel"] for c in hits)


@pytest.mark.parametrize(
    "world, layout",
    [(w, lay) for w, lay in CASES if lay[0] > 1 or lay[2] > 1],
    ids=lambda x: "tp{}cp{}pp{}dp{}".format(*x) if isinstance(x, tuple) else f"world{x}",
)
def test_tp_and_pp_traffic_is_that_of_the_rank_s_rows(world, layout):
    """One step's pipeline transfers carry ``[s/C, b, h]`` per microbatch each way
    (``[s/(C t), b, h]`` with sequence parallelism), and each tp all-reduce of a layer ``b s h / C``
    elements: the rank's rows of the sequence, never the whole of it."""
    tp, cp, pp, dp = layout
    cfg = cp_config("gpt_p2p", *layout)
    b, s, h, m = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size, cfg.num_microbatches
    rows = b * (s // cp) * h
    layers = cfg.model.num_layers // pp
    for res in (rank_results[layout] for rank_results in world_results(world)):
        comm = res["gpt_p2p"]["comm"]
        if pp > 1:  # 1F1B over 2 stages: m activations one way, m gradients the other, on every rank
            assert _traffic(comm, "pp", "send", "pipeline") == (m, m * rows)
            assert _traffic(comm, "pp", "recv", "pipeline") == (m, m * rows)
        if tp > 1:
            for tag in ("attn_proj", "mlp_fc2", "attn_qkv", "mlp_fc1"):
                assert _traffic(comm, "tp", "all_reduce", tag) == (layers * m, layers * m * rows), tag
            sp = res["gpt_sp_dropout_all_gather"]["comm"]
            if pp > 1:
                assert _traffic(sp, "pp", "send", "pipeline") == (m, m * rows // tp)
