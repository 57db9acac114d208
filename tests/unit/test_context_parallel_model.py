"""The model's side of context parallelism, in one process: the positions a cp rank holds (with
sequence parallelism inside it), rotary angles at global positions, hidden and attention dropout
masks that are the rows of the unsplit model's masks, attention blocks with dropout merged by
log-sum-exp (forward and backward), hidden shapes between pipeline stages, and the rule refusing
sequence parallelism whose tp does not divide a cp rank's positions. The training equivalence across processes is in
``tests/dist/test_context_parallel_equivalence.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.rules.axes import context_parallel_model_violations
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.context_parallel.blockwise import attention_block, attention_block_backward, merge
from ptdp.engine.context_parallel.cp_attention import context_parallel_attention
from ptdp.engine.context_parallel.load_balance import local_positions, rank_positions, shard_sequence, unshard_sequence
from ptdp.engine.model.attention import Attention
from ptdp.engine.model.rotary import RotaryEmbedding
from ptdp.engine.tensor_parallel.random import REPLICATED, WHOLE_SEQUENCE, DropoutRNG
from ptdp.errors import ConfigError


@pytest.mark.parametrize("cp, tp", [(1, 2), (2, 1), (2, 2), (4, 2), (3, 1)])
def test_rank_positions_partition_the_sequence_in_chunk_order(cp, tp):
    s = 2 * cp * tp * 3
    held = [rank_positions(s, c, cp, tp_rank=t, tp_size=tp) for c in range(cp) for t in range(tp)]
    assert sorted(torch.cat(held).tolist()) == list(range(s))
    for c in range(cp):  # a cp rank's tp blocks, in order, are its local positions
        mine = torch.cat([rank_positions(s, c, cp, tp_rank=t, tp_size=tp) for t in range(tp)])
        assert torch.equal(mine, local_positions(s, c, cp))
        assert torch.equal(mine, shard_sequence(torch.arange(s), c, cp, dim=0))
    with pytest.raises(ValueError, match=r"seq_length % \(cp \* tp\) == 0"):
        rank_positions(2 * cp * 3, 0, cp, tp_rank=0, tp_size=4)


@pytest.mark.parametrize("cp", [2, 4])
def test_rotary_turns_each_row_by_its_global_position(cp):
    rope, s = RotaryEmbedding(8, 10000.0), 16
    x = torch.randn(2, 3, s, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    whole = rope(x)
    parts = [rope(shard_sequence(x, r, cp, dim=2), cp_rank=r, cp_size=cp) for r in range(cp)]
    assert torch.equal(unshard_sequence(parts, dim=2), whole)
    assert not torch.equal(parts[1], rope(shard_sequence(x, 1, cp, dim=2)))  # local positions would differ


@pytest.mark.parametrize("cp, tp, sp", [(2, 1, False), (4, 1, False), (2, 2, True), (2, 2, False)])
def test_hidden_masks_are_the_rows_of_the_unsplit_models_masks(cp, tp, sp):
    """Every (cp, tp) rank keeps the rows of its positions of the mask the cp = 1, tp = 1 model draws
    from the same stream: the masks do not depend on cp, tp or sequence parallelism."""
    s, b, h, p = 16, 2, 8, 0.5
    unsplit = DropoutRNG(5)
    assert unsplit.hidden_stream == REPLICATED
    want = [unsplit.dropout(torch.ones(s, b, h), p, "layer.3") == 0 for _ in range(2)]  # 2 microbatches
    rows = s // cp // (tp if sp else 1)
    for c in range(cp):
        for t in range(tp):
            rng = DropoutRNG(5, tp_rank=t, cp_rank=c, cp_size=cp, tp_size=tp, sequence_parallel=sp)
            assert rng.hidden_stream == WHOLE_SEQUENCE
            mine = rank_positions(s, c, cp, tp_rank=t if sp else 0, tp_size=tp if sp else 1)
            for mask in want:
                got = rng.dropout(torch.ones(rows, b, h), p, "layer.3", stream=rng.hidden_stream) == 0
                assert torch.equal(got, mask[mine])
    assert want[0].any() and not torch.equal(want[0], want[1])


def test_attention_dropout_masks_are_the_rows_of_the_unsplit_models_masks():
    """Under cp a rank's attention-dropout masks ``[b, a/t, s/C, s]`` are its query rows of the
    masks the unsplit model draws for its heads (the same streams), at every cp rank."""
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, attention_dropout=0.3, params_dtype="float64")
    b, s, cp = 2, 16, 4
    unsplit = DropoutRNG(9, tp_rank=1)
    want = unsplit.head_masks(b, s, s, 0.3, "layer.2", first_head=2, heads=2)  # tp rank 1 of 2: heads 2, 3
    assert want.shape == (b, 2, s, s) and want.any() and not want.all()
    for r in range(cp):
        axis = AxisGroup("cp", tuple(range(cp)), r, None, None)
        attention = Attention(
            cfg,
            AxisGroup("tp", (0, 1), 1, None, None),
            torch.float64,
            layer_id=2,
            rng=DropoutRNG(9, tp_rank=1, cp_rank=r, cp_size=cp),
            cp=axis,
            cp_comm_type="all_gather",
        )
        got = attention.cp_dropout_masks(torch.zeros(b, 2, s // cp, 8, dtype=torch.float64))
        assert torch.equal(got, want[:, :, local_positions(s, r, cp)])


@pytest.mark.parametrize("grouped", [False, True], ids=["mha", "gqa"])
def test_blocks_with_dropout_merge_into_dropped_attention(grouped):
    """Attention with a dropout mask computed as two key blocks (full past + causal diagonal)
    merged by log-sum-exp, and the blocks' explicit backward, equal the dense dropped attention
    and its autograd gradients (float64)."""
    gen = torch.Generator().manual_seed(3)
    b, heads, kv, n, d, p = 2, 4, 2 if grouped else 4, 6, 8, 0.4
    q = torch.randn(b, heads, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, kv, 2 * n, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    drop = torch.rand(b, heads, n, 2 * n, generator=gen) < p
    dout = torch.randn(b, heads, n, d, generator=gen, dtype=torch.float64)
    # dense reference: queries at positions n .. 2n-1 against keys 0 .. 2n-1
    kr, vr = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
    scores = (q @ kr.transpose(-1, -2)) / d**0.5
    future = torch.arange(2 * n).unsqueeze(0) > torch.arange(n, 2 * n).unsqueeze(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
    want = (probs.masked_fill(drop, 0.0) / (1 - p)) @ vr
    want.backward(dout)
    scale, past, diag = 1 / d**0.5, slice(0, n), slice(n, 2 * n)
    pieces = ((past, False), (diag, True))
    with torch.no_grad():
        blocks = [
            attention_block(
                q, k[:, :, cols], v[:, :, cols], causal=causal, scale=scale, drop=drop[..., cols], dropout_p=p
            )
            for cols, causal in pieces
        ]
        out, lse = merge(*blocks)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        grads = [
            attention_block_backward(
                dout,
                q,
                k[:, :, cols],
                v[:, :, cols],
                out,
                lse,
                causal=causal,
                scale=scale,
                drop=drop[..., cols],
                dropout_p=p,
            )
            for cols, causal in pieces
        ]
    torch.testing.assert_close(grads[0][0] + grads[1][0], q.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), k.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), v.grad, rtol=1e-12, atol=1e-12)


def test_attention_takes_the_cp_axis_and_a_dropout_mask_of_the_right_shape():
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, attention_dropout=0.1, params_dtype="float64")
    cp = AxisGroup("cp", (0, 1), 0, None, None)
    attention = Attention(cfg, AxisGroup.single("tp"), torch.float64, cp=cp, cp_comm_type="all_gather")
    assert (attention.cp.size, attention.cp_comm_type) == (2, "all_gather")
    q = torch.zeros(1, 4, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"dropout mask must be bool \[b, heads, s/C, s\] = \[1, 4, 4, 8\]"):
        context_parallel_attention(q, q, q, cp, "p2p", drop=torch.zeros(1, 4, 4, 4, dtype=torch.bool), dropout_p=0.1)
    with pytest.raises(ValueError, match="attention dropout runs only on the math kernel"):
        context_parallel_attention(
            q, q, q, cp, "p2p", kernel="fused", drop=torch.zeros(1, 4, 4, 8, dtype=torch.bool), dropout_p=0.1
        )


def test_rules_refuse_uneven_sequence_parallel_rows_and_take_attention_dropout():
    m = ModelConfig(seq_length=20, attention_dropout=0.1, hidden_dropout=0.1)
    assert context_parallel_model_violations(m, 2, 1, False) == []  # attention dropout runs under cp
    assert context_parallel_model_violations(m, 1, 2, True) == []
    assert context_parallel_model_violations(m, 2, 4, False) == []  # without sequence parallelism
    assert context_parallel_model_violations(dataclasses.replace(m, seq_length=24), 2, 4, True) == []
    (v,) = context_parallel_model_violations(m, 2, 4, True)  # 20 % (2 * 2) == 0 but 20 % (2 * 4) != 0
    assert (
        "seq_length=20 is not divisible by context_parallel_size * tensor_model_parallel_size = 2*4 = 8" in v.message
        and v.values == {"seq_length": 20, "cp": 2, "tp": 4}
    )
    parallel = dict(tensor_model_parallel_size=4, context_parallel_size=2)
    with pytest.raises(ConfigError, match=r"seq_length=20 is not divisible by context_parallel_size \* tensor"):
        resolve(Config(model=m, train=TrainConfig(), parallel=ParallelConfig(**parallel, sequence_parallel=True)), 8)
    assert resolve(Config(model=m, train=TrainConfig(), parallel=ParallelConfig(**parallel)), 8).parallel.cp == 2


def test_stage_hidden_shape_divides_the_sequence_by_cp_and_by_tp_with_sequence_parallelism():
    from ptdp.engine.stage import Stage

    def shape(cp, tp, sp):
        cfg = Config(
            model=ModelConfig(seq_length=48, hidden_size=32),
            train=TrainConfig(micro_batch_size=3),
            parallel=ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp),
        )
        return Stage(cfg, None, None, None, None, torch.device("cpu")).hidden_shape

    assert shape(1, 2, False) == (48, 3, 32) and shape(1, 2, True) == (24, 3, 32)
    assert shape(2, 1, False) == (24, 3, 32) and shape(4, 2, False) == (12, 3, 32) and shape(2, 2, True) == (12, 3, 32)


def test_the_planner_refuses_what_ptdp_train_refuses():
    """``ptdp plan`` checks the same rule: a sequence-parallel layout whose tp does not divide a cp
    rank's ``s / cp`` positions is rejected, naming the numbers."""
    from ptdp.planner.candidate import Candidate
    from ptdp.planner.inputs.hardware import CATALOG, Cluster
    from ptdp.planner.inputs.models import PRESETS
    from ptdp.planner.search.rules import all_rejections

    model, cluster = dataclasses.replace(PRESETS["gpt3-175b"], seq_length=20), Cluster(CATALOG["a100-80gb"], 1024)
    rules = {
        r.rule: r.message
        for r in all_rejections(model, Candidate.of(4, 16, 8, 1, 1536, cp=2, sequence_parallel=True), cluster)
    }
    assert "context_parallel_size * tensor_model_parallel_size = 2*4 = 8" in rules["sequence parallel"]
    assert all_rejections(model, Candidate.of(4, 16, 8, 1, 1536, cp=2), cluster) == []


def test_ptdp_train_exits_2_naming_the_numbers_before_any_process(capsys, monkeypatch):
    import ptdp.run.launch
    from ptdp import cli

    monkeypatch.setattr(ptdp.run.launch, "launch_local", lambda *a, **k: pytest.fail("a process was started"))
    argv = [
        "train",
        "--train-iters",
        "1",
        "--tp",
        "4",
        "--cp",
        "2",
        "--pp",
        "1",
        "--dp",
        "1",
        "--nproc-per-node",
        "8",
        "--sequence-parallel",
        "--seq-length",
        "20",
        "--num-attention-heads",
        "4",
        "--hidden-size",
        "32",
    ]
    assert cli.main(argv) == 2
    assert (
        "seq_length=20 is not divisible by context_parallel_size * tensor_model_parallel_size = 2*4 = 8 (rule: "
        "s % (cp * tp) == 0" in capsys.readouterr().err
    )
