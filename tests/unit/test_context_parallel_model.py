"""The model's side of context parallelism, in one process: the positions a cp rank holds (with
sequence parallelism inside it), rotary angles at global positions, hidden-dropout masks that are
the rows of the unsplit model's masks, hidden shapes between pipeline stages, and the rules that
refuse what cp cannot run (attention dropout; sequence parallelism whose tp does not divide a cp
rank's positions). The training equivalence across processes is in
``tests/dist/test_context_parallel_equivalence.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.engine.comm import AxisGroup
from ptdp.engine.context_parallel.chunks import local_positions, rank_positions, shard_sequence, unshard_sequence
from ptdp.engine.model.gpt import Attention
from ptdp.engine.model.rotary import RotaryEmbedding
from ptdp.engine.tensor_parallel.random import REPLICATED, WHOLE_SEQUENCE, DropoutRNG
from ptdp.spec import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, resolve
from ptdp.spec.rules import context_parallel_model_violations


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


def test_attention_refuses_dropout_under_cp_and_takes_the_cp_axis():
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, attention_dropout=0.1, params_dtype="float64")
    cp = AxisGroup("cp", (0, 1), 0, None, None)
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 .*\(cp=2\)"):
        Attention(cfg, AxisGroup.single("tp"), torch.float64, cp=cp)
    attention = Attention(dataclasses.replace(cfg, attention_dropout=0.0), AxisGroup.single("tp"), torch.float64,
                          cp=cp, cp_comm_type="all_gather")
    assert (attention.cp.size, attention.cp_comm_type) == (2, "all_gather")


def test_rules_refuse_attention_dropout_and_uneven_sequence_parallel_rows():
    m = ModelConfig(seq_length=20, attention_dropout=0.1)
    assert context_parallel_model_violations(m, 1, 2, True) == []
    (v,) = context_parallel_model_violations(m, 2, 1, False)
    assert "attention_dropout=0.1 with context_parallel_size=2" in v.message and "attention_dropout == 0" in v.message
    m = dataclasses.replace(m, attention_dropout=0.0, hidden_dropout=0.1)
    assert context_parallel_model_violations(m, 2, 4, False) == []  # without sequence parallelism
    assert context_parallel_model_violations(dataclasses.replace(m, seq_length=24), 2, 4, True) == []
    (v,) = context_parallel_model_violations(m, 2, 4, True)  # 20 % (2 * 2) == 0 but 20 % (2 * 4) != 0
    assert ("seq_length=20 is not divisible by context_parallel_size * tensor_model_parallel_size = 2*4 = 8"
            in v.message and v.values == {"seq_length": 20, "cp": 2, "tp": 4})
    cfg = Config(model=dataclasses.replace(m, attention_dropout=0.2), train=TrainConfig(),
                 parallel=ParallelConfig(tensor_model_parallel_size=4, context_parallel_size=2, sequence_parallel=True))
    with pytest.raises(ConfigError, match=r"(?s)attention_dropout=0.2 with context_parallel_size=2.*seq_length=20 "
                                          r"is not divisible by context_parallel_size \* tensor"):
        resolve(cfg, 8)


def test_stage_hidden_shape_divides_the_sequence_by_cp_and_by_tp_with_sequence_parallelism():
    from ptdp.engine.step import Stage

    def shape(cp, tp, sp):
        cfg = Config(model=ModelConfig(seq_length=48, hidden_size=32), train=TrainConfig(micro_batch_size=3),
                     parallel=ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                             sequence_parallel=sp))
        return Stage(cfg, None, None, None, None, torch.device("cpu")).hidden_shape
    assert shape(1, 2, False) == (48, 3, 32) and shape(1, 2, True) == (24, 3, 32)
    assert shape(2, 1, False) == (24, 3, 32) and shape(4, 2, False) == (12, 3, 32) and shape(2, 2, True) == (12, 3, 32)
