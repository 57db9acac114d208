"""The planner's transients of optim_grads / optim_grads_params (``ptdp.planner.memory.transients``):
pure checks of the counting (the measured equality with ptdp's engine is in
``tests/dist/test_sharded_grads.py`` and ``test_sharded_params.py``), and ``ptdp plan``'s
--ddp-bucket-size, --no-overlap-grad-reduce and --no-reshard-after-forward."""

from __future__ import annotations

import json

import pytest

from ptdp import cli
from ptdp.layout.pipeline.partition import stage_layer_counts
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.inputs.models import get_model
from ptdp.planner.memory import transients
from ptdp.planner.memory.chunk_params import layer_param_sizes, stage_chunks
from ptdp.planner.memory.params import layer_param_count, stage_param_counts
from ptdp.planner.memory.transients import rank_transients, unit_gathers

#: (model, tp, pp, v, bucket elements, shard size d, placement)
CASES = [
    ("gpt3-175b", 8, 8, 1, 40_000_000, 16, "looped"),
    ("llama3-8b", 8, 4, 2, 40_000_000, 8, "looped"),
    ("llama3-8b", 4, 1, 1, 1_000_000, 4, "looped"),
    ("llama2-70b", 2, 2, 1, 10**9, 3, "looped"),  # buckets larger than a layer: cut unevenly, no shortcut
    ("gpt3-175b", 8, 8, 2, 40_000_000, 16, "v"),  # rank 0 holds the tied table once for both chunks
]


@pytest.mark.parametrize("name, tp, pp, v, bucket, d, placement", CASES)
def test_the_short_replay_equals_the_full_one(name, tp, pp, v, bucket, d, placement, monkeypatch):
    """Where every layer's buckets are cut alike the planner replays 4 layers per chunk and
    extrapolates the totals: the same numbers as replaying every layer, for both strategies,
    with and without overlap, resharded and kept, chunk by chunk, on the first and the last stage."""
    model = get_model(name)
    layers = model.num_layers // pp
    fast = {}
    for rank in (0, pp - 1):
        chunks = stage_chunks(model.num_layers, pp, v, rank, layers, placement)
        for overlap in (True, False):
            for params_sharded in (False, True):
                for reshard, by_chunk in ((True, False), (False, False), (True, True)):
                    key = (rank, overlap, params_sharded, reshard, by_chunk)
                    kw = dict(overlap=overlap, params_sharded=params_sharded, reshard=reshard, by_chunk=by_chunk)
                    fast[key] = rank_transients(model, tp, pp, chunks, d, bucket, **kw)
    rank_transients.cache_clear()
    monkeypatch.setattr(transients, "PERIODIC_LAYERS", 10**6)
    for (rank, overlap, params_sharded, reshard, by_chunk), want in fast.items():
        chunks = stage_chunks(model.num_layers, pp, v, rank, layers, placement)
        kw = dict(overlap=overlap, params_sharded=params_sharded, reshard=reshard, by_chunk=by_chunk)
        assert rank_transients(model, tp, pp, chunks, d, bucket, **kw) == want
    rank_transients.cache_clear()


@pytest.mark.parametrize("name, tp, pp", [("gpt3-175b", 8, 8), ("llama3-8b", 2, 1), ("llama2-70b", 4, 4)])
def test_without_overlap_a_backward_holds_its_whole_stage(name, tp, pp):
    """One rank (d = 1: no padding), one chunk, no overlap: every bucket stays until the backward
    ends, so the gradient transient is the stage's parameter count; kept units are the stage's
    parameters too, and resharded at most two layers (with an edge unit) of them."""
    model = get_model(name)
    counts = stage_param_counts(model, tp, pp)
    for rank, (n, layers) in enumerate(zip(counts, stage_layer_counts(model.num_layers, pp, None))):
        chunks = stage_chunks(model.num_layers, pp, 1, rank, layers)
        _, grads = rank_transients(model, tp, pp, chunks, 1, 40_000_000, overlap=False, params_sharded=False)
        assert grads == n
        kept, _ = rank_transients(
            model, tp, pp, chunks, 1, 40_000_000, overlap=True, params_sharded=True, reshard=False
        )
        assert kept == n
        resharded, _ = rank_transients(model, tp, pp, chunks, 1, 40_000_000, overlap=True, params_sharded=True)
        assert 2 * layer_param_count(model, tp) <= resharded < n


@pytest.mark.parametrize(
    "name, tp, pp, v, d",
    [("gpt3-175b", 8, 8, 1, 16), ("llama3-8b", 2, 1, 1, 4), ("gpt3-175b", 8, 1, 1, 8), ("llama3-8b", 4, 4, 2, 8)],
)
def test_backward_gathers_every_unit_but_the_embeddings(name, tp, pp, v, d):
    """optim_grads_params, per microbatch: forward gathers every bucket of the stage (at least its
    parameters, at most d - 1 padding elements more per bucket); backward the same but on a stage
    that looks up without projecting with the same table, where it leaves out the embeddings'
    unit (the word table and the learned positions: the lookups' gradients need the ids only)."""
    model = get_model(name)
    h = model.hidden_size
    table = padded_vocab_size(model.vocab_size, 128, tp) // tp * h
    embeddings = table + (model.seq_length * h if model.has_position_table else 0)
    counts = stage_param_counts(model, tp, pp)
    for rank, layers in enumerate(stage_layer_counts(model.num_layers, pp, None)):
        chunks = stage_chunks(model.num_layers, pp, v, rank, layers)
        (calls, numel), (back_calls, back_numel) = unit_gathers(model, tp, pp, chunks, d, 40_000_000)
        assert counts[rank] <= numel <= counts[rank] + calls * (d - 1)
        if rank == 0 and (pp > 1 or not model.tied):
            assert 0 < back_calls < calls
            assert embeddings <= numel - back_numel <= embeddings + (calls - back_calls) * (d - 1)
        else:
            assert (back_calls, back_numel) == (calls, numel)


def test_a_layers_parameters_in_ptdps_order():
    model = get_model("gpt3-175b")
    sizes = layer_param_sizes(model, 8)
    assert sum(sizes) == layer_param_count(model, 8)
    h = model.hidden_size
    assert sizes[:4] == (h, h, 3 * h * h // 8, 3 * h // 8)  # ln1 weight, bias, qkv weight, bias


def _plan_json(capsys, *extra: str) -> dict:
    args = ["plan", "--model", "llama3-8b", "--gpus", "64", "--global-batch-size", "256", "--tp", "2", "--pp", "2"]
    args += ["--pipeline-schedule", "1f1b"]  # zero-bubble schedules keep every bucket through the step
    assert cli.main([*args, "--json", "--top", "1", *extra]) == 0
    return json.loads(capsys.readouterr().out)[0]


def test_ptdp_plan_takes_the_bucket_size_overlap_and_resharding(capsys):
    """The three flags come from the schema and reach the plan: a smaller bucket lowers
    optim_grads's gradient transient, no overlap raises it, keeping the units gathered raises
    optim_grads_params's parameter bytes and lowers its exposed communication."""
    grads = "--data-parallel-sharding-strategy", "optim_grads"
    default = _plan_json(capsys, *grads)
    small = _plan_json(capsys, *grads, "--ddp-bucket-size", "1000000")
    sync = _plan_json(capsys, *grads, "--no-overlap-grad-reduce")
    assert (small["ddp_bucket_size"], sync["overlap_grad_reduce"]) == (1_000_000, False)
    assert small["memory_bytes"]["grads"] < default["memory_bytes"]["grads"] < sync["memory_bytes"]["grads"]
    params = "--data-parallel-sharding-strategy", "optim_grads_params"
    resharded = _plan_json(capsys, *params)
    kept = _plan_json(capsys, *params, "--no-reshard-after-forward")
    assert kept["reshard_after_forward"] is False and resharded["reshard_after_forward"] is True
    assert kept["memory_bytes"]["params"] > resharded["memory_bytes"]["params"]
    assert kept["time_s"]["dp_comm"] < resharded["time_s"]["dp_comm"]


def test_a_bucket_size_below_one_element_is_refused(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--ddp-bucket-size", "0"]
    assert cli.main(args) == 2
    assert "ddp_bucket_size=0 must be a positive integer" in capsys.readouterr().err
