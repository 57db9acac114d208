"""Tensor-parallel building blocks against their single-process equivalents (float64), with and
without sequence parallelism."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.tp_cases import (
    CHUNKS,
    PADDED,
    S_SP,
    VOCAB,
    B,
    H,
    S,
    ce_labels,
    check_label_cases,
    inputs,
    label_cases,
    linear_ce_reference,
    padded_output_weight,
    reference,
)
from ptdp.engine.comm import all_gather_along, reduce_scatter_along
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ptdp.engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ptdp.engine.tensor_parallel.linear import LinearPlan, linear
from ptdp.engine.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from ptdp.engine.tensor_parallel.sequence import (
    all_gather_sequence,
    is_sequence_parallel,
    sequence_shard,
)
from ptdp.engine.tensor_parallel.sharding import GlobalParam, shard, unshard
from ptdp.layout.grid import ParallelLayout


def tp_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=world), PG_TIMEOUT)
    tp = groups.tp
    d = inputs()
    out = {}
    # vocab-parallel embedding + cross entropy (padded vocab, some ranks without real rows)
    emb = VocabParallelEmbedding(VOCAB, 32, H, tp=tp, dtype=torch.float64)
    full = torch.zeros(32, H, dtype=torch.float64)
    full[:VOCAB] = d["emb"]
    with torch.no_grad():
        emb.weight.copy_(shard(full, emb.weight.ptdp_global, tp.rank, tp.size))
    hidden = emb(d["ids"])
    hidden.backward(d["x"])
    out["embedding"] = hidden.detach()
    out["embedding_grad"] = emb.weight.grad.clone()
    logits = d["logits"][..., emb.vocab_start : emb.vocab_start + emb.num_real_rows].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, d["target"], vocab_start=emb.vocab_start, vocab_size=VOCAB, axis=tp)
    loss.backward(d["grad_loss"])
    out["loss"], out["logits_grad"], out["num_real"] = loss.detach(), logits.grad, emb.num_real_rows
    out.update(label_cases(tp, d, emb.vocab_start, emb.num_real_rows))
    # column-parallel -> GELU -> row-parallel
    fc1 = ColumnParallelLinear(H, 4 * H, tp=tp, dtype=torch.float64)
    fc2 = RowParallelLinear(4 * H, H, tp=tp, dtype=torch.float64)
    with torch.no_grad():
        for layer, w, b in ((fc1, d["w1"], d["b1"]), (fc2, d["w2"], d["b2"])):
            layer.weight.copy_(shard(w, layer.weight.ptdp_global, tp.rank, tp.size))
            layer.bias.copy_(shard(b, layer.bias.ptdp_global, tp.rank, tp.size))
    x = d["x"].clone().requires_grad_()
    y = fc2(F.gelu(fc1(x)))
    y.backward(torch.ones_like(y))
    out.update(y=y.detach(), x_grad=x.grad, w1_grad=fc1.weight.grad, w2_grad=fc2.weight.grad, b2_grad=fc2.bias.grad)
    out.update(sequence_parallel_worker(tp, d, emb.weight.detach(), fc1, fc2))
    out.update(sequence_parallel_output_layer(tp, d, emb.weight.detach()[: emb.num_real_rows]))
    out["linear_ce"] = linear_ce_worker(tp, d)
    return out


def linear_ce_worker(tp, d: dict) -> dict:
    """The chunked output layer + loss on this rank's shard of the padded weight (nonzero padding
    rows), replicated input (``x``, ``ids``, batch-first: any token order works) and
    sequence-parallel input (this rank's positions of ``xs``, ``ids_sp``, sequence-first
    ``[s/t, b, h]`` and ``[s, b]``), for each chunk size; the communication of the first. Results
    are returned batch-first."""
    per_rank = PADDED // tp.size
    start = tp.rank * per_rank
    out = {}
    for sp, (xs, ids) in ((False, (d["x"], d["ids"])), (True, (d["xs"], d["ids_sp"]))):
        mine = sequence_shard(xs.shape[1], tp) if sp else slice(None)
        for chunk in CHUNKS:
            tp.stats.reset()
            x = (seq_first(xs)[mine] if sp else xs).clone(memory_format=torch.contiguous_format).requires_grad_()
            w = padded_output_weight(d)[start : start + per_rank].clone().requires_grad_()
            labels = ce_labels(ids).t() if sp else ce_labels(ids)
            loss = linear_cross_entropy(
                x, w, labels, vocab_start=start, vocab_size=VOCAB, axis=tp, sequence_parallel=sp, chunk_tokens=chunk
            )
            loss.sum().backward()
            loss, x_grad = (loss.detach().t(), x.grad.transpose(0, 1)) if sp else (loss.detach(), x.grad)
            out[sp, chunk] = {
                "loss": loss,
                "x_grad": x_grad,
                "w_grad": w.grad,
                "mine": mine,
                "comm": tp.stats.as_dict(),
            }
    return out


def seq_first(t: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...]`` -> ``[s, b, ...]`` (a view), the layout of the model's activations."""
    return t.transpose(0, 1)


def rank_part(t: torch.Tensor, mine: slice) -> torch.Tensor:
    """This rank's positions ``mine`` of a batch-first ``[b, s, h]``, as a new contiguous
    sequence-first leaf ``[s/t, b, h]`` that requires grad."""
    return seq_first(t)[mine].clone(memory_format=torch.contiguous_format).requires_grad_()


def sequence_parallel_output_layer(tp, d: dict, real_rows: torch.Tensor) -> dict:
    """The output layer with sequence parallelism (input ``[s/t, b, h]`` gathered into the
    vocab-parallel linear) and the loss, on a rank whose vocabulary slice may be padding only
    (tp = 4: ranks 2 and 3, ``[s, b, 0]`` logits). Returned batch-first."""
    mine = sequence_shard(S_SP, tp)
    x = rank_part(d["xs"], mine)
    w = real_rows.clone().requires_grad_()
    logits = linear(x, w, None, LinearPlan("sequence", tp, "output"))
    start = tp.rank * (32 // tp.size)
    loss = vocab_parallel_cross_entropy(logits, d["ids_sp"].t(), vocab_start=start, vocab_size=VOCAB, axis=tp)
    loss.backward(torch.ones_like(loss))
    return {"sp_out_loss": loss.detach().t(), "sp_out_x_grad": x.grad.transpose(0, 1), "sp_out_w_grad": w.grad}


def sequence_parallel_worker(tp, d: dict, emb_weight: torch.Tensor, fc1, fc2) -> dict:
    """The same embedding and MLP with sequence parallelism, on this rank's positions of an
    ``S_SP``-token input laid out sequence-first (``[s/t, b, h]``, ids ``[s, b]``), and the
    communication they count; the comm functions along dims 0-2. Results are returned
    batch-first."""
    mine = sequence_shard(S_SP, tp)
    emb = VocabParallelEmbedding(VOCAB, 32, H, tp=tp, dtype=torch.float64, sequence_parallel=True)
    sp1 = ColumnParallelLinear(H, 4 * H, tp=tp, dtype=torch.float64, sequence_parallel=True)
    sp2 = RowParallelLinear(4 * H, H, tp=tp, dtype=torch.float64, sequence_parallel=True)
    with torch.no_grad():
        emb.weight.copy_(emb_weight)
        for new, old in ((sp1, fc1), (sp2, fc2)):
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
    part = rank_part(d["xs"], mine)
    gathered = all_gather_sequence(part, tp, "g")
    gathered.backward(seq_first(d["ys_grad"]))  # every rank's gradient of the whole sequence, summed over tp
    tp.stats.reset()
    hidden = emb(d["ids_sp"].t())
    hidden.backward(seq_first(d["ys_grad"])[mine])
    x = rank_part(d["xs"], mine)
    y = sp2(F.gelu(sp1(x)))
    y.backward(seq_first(d["ys_grad"])[mine])
    return {
        "sp_embedding": seq_first(hidden.detach()),
        "sp_embedding_grad": emb.weight.grad,
        "sp_y": seq_first(y.detach()),
        "sp_x_grad": seq_first(x.grad),
        "sp_w1_grad": sp1.weight.grad,
        "sp_b1_grad": sp1.bias.grad,
        "sp_w2_grad": sp2.weight.grad,
        "sp_b2_grad": sp2.bias.grad,
        "sp_comm": tp.stats.as_dict(),
        "sp_positions": mine,
        "sp_marked": [is_sequence_parallel(p) for p in (sp1.weight, sp1.bias, sp2.weight, sp2.bias)],
        "g_out": seq_first(gathered.detach()),
        "g_grad": seq_first(part.grad),
        "gathered": [all_gather_along(d["cube"][..., :2] + tp.rank, tp, dim=dim) for dim in (0, 1, 2)],
        "scattered": [reduce_scatter_along(d["cube"] * (tp.rank + 1), tp, dim=dim) for dim in (0, 1, 2)],
    }


@functools.cache
def tp_results(world: int) -> list[dict]:
    return run_in_pool(tp_worker, world)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_layers_match_single_process(world):
    results, ref = tp_results(world), reference()
    tol = dict(rtol=1e-12, atol=1e-12)
    for res in results:  # replicated outputs and input gradients are equal on every rank
        for key in ("embedding", "loss", "y", "x_grad", "b2_grad"):
            torch.testing.assert_close(res[key], ref[key], **tol, msg=lambda m: f"{key}: {m}")
    logits_grad = torch.cat([r["logits_grad"] for r in results], dim=-1)
    torch.testing.assert_close(logits_grad, ref["logits_grad"], **tol)
    emb_grad = torch.cat([r["embedding_grad"] for r in results])
    torch.testing.assert_close(emb_grad[:VOCAB], ref["embedding_grad"], **tol)
    assert torch.all(emb_grad[VOCAB:] == 0), "padding rows get no gradient"
    col = GlobalParam((4 * H, H), tp_dim=0)
    row = GlobalParam((H, 4 * H), tp_dim=1)
    torch.testing.assert_close(unshard([r["w1_grad"] for r in results], col), ref["w1_grad"], **tol)
    torch.testing.assert_close(unshard([r["w2_grad"] for r in results], row), ref["w2_grad"], **tol)
    if world == 4:
        assert [r["num_real"] for r in results] == [8, 2, 0, 0]


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_layers_match_single_process(world):
    """Korthikanti et al. 2022 §4.2.2: each rank holds positions [r s/t, (r+1) s/t) of the
    embedding output and the MLP's input and output; the weights' gradients are those of the whole
    sequence, the row-parallel bias gets each rank's part (marked, summed over tp after backward).
    Counted per rank: the embedding's reduce-scatter of b*s*h in forward and all-gather of
    b*s*h/t in backward; fc1's all-gather forward, all-gather again and reduce-scatter backward;
    fc2's reduce-scatter forward and all-gather backward; no all-reduce."""
    results, ref = tp_results(world), reference()
    tol = dict(rtol=1e-12, atol=1e-12)
    bsh, ref_grad = B * S_SP * H, inputs()["ys_grad"]
    for res in results:
        mine = res["sp_positions"]
        assert mine.stop - mine.start == S_SP // world
        for key in ("sp_embedding", "sp_y", "sp_x_grad"):
            torch.testing.assert_close(res[key], ref[key][:, mine], **tol, msg=lambda m: f"{key}: {m}")
        assert res["sp_marked"] == [False, False, False, True]
        assert torch.equal(res["g_out"], inputs()["xs"])  # g: all-gather forward, reduce-scatter backward
        torch.testing.assert_close(res["g_grad"], world * ref_grad[:, mine], **tol)
        assert res["sp_comm"] == {
            "tp/all_gather/column": {"calls": 1, "numel": bsh // world, "bytes": 8 * bsh // world},
            "tp/all_gather/column_regather": {"calls": 1, "numel": bsh // world, "bytes": 8 * bsh // world},
            "tp/reduce_scatter/column": {"calls": 1, "numel": bsh, "bytes": 8 * bsh},
            "tp/reduce_scatter/row": {"calls": 1, "numel": bsh, "bytes": 8 * bsh},
            "tp/all_gather/row": {"calls": 1, "numel": bsh // world, "bytes": 8 * bsh // world},
            "tp/reduce_scatter/embedding": {"calls": 1, "numel": bsh, "bytes": 8 * bsh},
            "tp/all_gather/embedding": {"calls": 1, "numel": bsh // world, "bytes": 8 * bsh // world},
        }
    assert sorted(r["sp_positions"].start for r in results) == list(range(0, S_SP, S_SP // world))
    emb_grad = torch.cat([r["sp_embedding_grad"] for r in results])
    torch.testing.assert_close(emb_grad[:VOCAB], ref["sp_embedding_grad"], **tol)
    col, row = GlobalParam((4 * H, H), tp_dim=0), GlobalParam((H, 4 * H), tp_dim=1)
    torch.testing.assert_close(unshard([r["sp_w1_grad"] for r in results], col), ref["sp_w1_grad"], **tol)
    torch.testing.assert_close(
        unshard([r["sp_b1_grad"] for r in results], GlobalParam((4 * H,), tp_dim=0)), ref["sp_b1_grad"], **tol
    )
    torch.testing.assert_close(unshard([r["sp_w2_grad"] for r in results], row), ref["sp_w2_grad"], **tol)
    torch.testing.assert_close(sum(r["sp_b2_grad"] for r in results), ref["sp_b2_grad"], **tol)


@pytest.mark.parametrize("world", [2, 4])
def test_gather_and_reduce_scatter_along_a_dim(world):
    results, cube = tp_results(world), inputs()["cube"]
    parts = [cube[..., :2] + r for r in range(world)]
    total = cube * sum(range(1, world + 1))
    for res in results:
        rank = next(i for i, r in enumerate(results) if r is res)
        for dim in (0, 1, 2):
            assert torch.equal(res["gathered"][dim], torch.cat(parts, dim=dim))
            assert res["gathered"][dim].is_contiguous() and res["scattered"][dim].is_contiguous()
            torch.testing.assert_close(res["scattered"][dim], total.chunk(world, dim=dim)[rank], rtol=1e-15, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_output_layer_on_ranks_holding_only_padding(world):
    """The output layer with sequence parallelism: at tp = 4 ranks 2 and 3 hold no real vocabulary
    row (``[b, s, 0]`` logits, a ``[0, h]`` weight) and still gather, re-gather and reduce-scatter
    with their peers; the loss and every gradient equal the single-process ones."""
    results, ref, tol = tp_results(world), reference(), dict(rtol=1e-12, atol=1e-12)
    for res in results:
        torch.testing.assert_close(res["sp_out_loss"], ref["sp_out_loss"], **tol)
    x_grad = torch.cat([r["sp_out_x_grad"] for r in sorted(results, key=lambda r: r["sp_positions"].start)], dim=1)
    torch.testing.assert_close(x_grad, ref["sp_out_x_grad"], **tol)
    torch.testing.assert_close(torch.cat([r["sp_out_w_grad"] for r in results]), ref["sp_out_w_grad"], **tol)
    if world == 4:
        assert [r["sp_out_w_grad"].shape[0] for r in results] == [8, 2, 0, 0]


@pytest.mark.parametrize("world", [2, 4])
def test_cross_entropy_ignores_label_minus_100_and_rejects_out_of_range_labels_on_every_path(world):
    """-100 gives loss 0 and no gradient at tp = 1 (``F.cross_entropy``) and tp > 1 (ranks 2 and 3
    of tp = 4 hold padding only) alike; any other label outside [0, V) raises the same
    ValueError on every path, before any collective."""
    results = tp_results(world)
    check_label_cases(results)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_chunked_linear_cross_entropy_matches_single_process(world, sp):
    """The output layer + loss on the padded vocabulary, in chunks of 1, 5 and all tokens, equal
    ``F.cross_entropy(F.linear(x, real rows))`` (float64, 1e-9): nonzero padding rows masked out
    (zero gradient), ignored labels without loss or gradient, ranks of padding only (tp = 4: ranks
    2 and 3 hold rows 16-31, all past V = 10). Counted per rank whatever the chunking: 3
    all-reduces of b*s (max, target logit, sum of exponentials) and the input's f (all-reduce of
    b*s*h) or, with sequence parallelism, its gather, re-gather and reduce-scatter."""
    results, tol = tp_results(world), dict(rtol=1e-9, atol=1e-12)
    d = inputs()
    x, ids, s = (d["xs"], d["ids_sp"], S_SP) if sp else (d["x"], d["ids"], S)
    ref = linear_ce_reference(x, ids)
    bs, bsh = B * s, B * s * H
    for chunk in CHUNKS:
        parts = [r["linear_ce"][sp, chunk] for r in results]
        for part in parts:
            torch.testing.assert_close(part["loss"], ref["loss"], **tol)
        x_grad = torch.cat([p["x_grad"] for p in parts], dim=1) if sp else parts[0]["x_grad"]
        torch.testing.assert_close(x_grad, ref["x_grad"], **tol)
        if not sp:
            assert all(torch.equal(p["x_grad"], x_grad) for p in parts)
        torch.testing.assert_close(torch.cat([p["w_grad"] for p in parts]), ref["w_grad"], **tol)
        ce = {f"tp/all_reduce/ce_{t}": {"calls": 1, "numel": bs, "bytes": 8 * bs} for t in ("max", "target", "sum_exp")}
        entry = (
            {
                "tp/all_gather/output": {"calls": 1, "numel": bsh // world, "bytes": 8 * bsh // world},
                "tp/all_gather/output_regather": {"calls": 1, "numel": bsh // world, "bytes": 8 * bsh // world},
                "tp/reduce_scatter/output": {"calls": 1, "numel": bsh, "bytes": 8 * bsh},
            }
            if sp
            else {"tp/all_reduce/output": {"calls": 1, "numel": bsh, "bytes": 8 * bsh}}
        )
        assert all(p["comm"] == {**ce, **entry} for p in parts)
