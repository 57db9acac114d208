"""Initialisation that draws only the rank's own shard (engine/tensor_parallel/sharding.py
init_shard): every layout's shards are exact slices of the same global tensor, and a rank draws
about 1/tp of it."""

from __future__ import annotations

import pytest
import torch

from ptdp.engine.tensor_parallel import sharding
from ptdp.engine.tensor_parallel.sharding import GlobalParam, init_block_size, init_full, init_shard, shard, unshard

SPECS = {
    "column_qkv": GlobalParam((3 * 96, 40), tp_dim=0, tp_groups=3),  # fused [q | k | v], 3 blocks per group
    "row": GlobalParam((40, 384), tp_dim=1, init="scaled_normal"),  # split by input columns
    "replicated": GlobalParam((33, 2048)),
    "swiglu": GlobalParam((2 * 256, 512), tp_dim=0, tp_groups=2),
}
KW = dict(seed=11, std=0.02, num_layers=3)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_shards_are_slices_of_one_global_tensor(name, tp):
    spec = SPECS[name]
    full = init_full(spec, name=name, **KW)
    shards = [init_shard(spec, name=name, tp_rank=r, tp_size=tp, **KW) for r in range(tp)]
    for r, part in enumerate(shards):
        assert torch.equal(part, shard(full, spec, r, tp)) if spec.tp_dim is not None else torch.equal(part, full)
    if spec.tp_dim is not None:
        assert torch.equal(unshard(shards, spec), full)
    std = 0.02 / (6**0.5) if spec.init == "scaled_normal" else 0.02
    assert abs(float(full.std()) / std - 1) < 0.05 and abs(float(full.mean())) < 0.1 * std


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padded_vocabulary_is_the_same_on_every_layout(tp):
    """V = 303 padded to a multiple of 64 tp: 320 (tp 1), 384 (tp 2), 512 (tp 4); the real rows are equal on
    every layout although the global shape is not, the padding rows are zero."""
    real = 303
    base = init_full(GlobalParam((320, 64), tp_dim=0, real_rows=real), name="word_embeddings.weight", **KW)
    v_pad = -(-real // (64 * tp)) * 64 * tp
    spec = GlobalParam((v_pad, 64), tp_dim=0, real_rows=real)
    whole = torch.cat([init_shard(spec, name="word_embeddings.weight", tp_rank=r, tp_size=tp, **KW) for r in range(tp)])
    assert torch.equal(whole[:real], base[:real])
    assert torch.all(whole[real:] == 0) and torch.all(base[real:] == 0)


def test_a_rank_draws_only_the_blocks_its_shard_overlaps(monkeypatch):
    """A [4096, 64] column-parallel weight in blocks of 1024 rows (65,536 elements): at tp = 4 each
    rank draws exactly its own 1024 x 64 values, not the 262,144 of the whole tensor; with shard
    boundaries inside blocks (tp = 8, 512 rows each) a rank draws its one overlapping block."""
    drawn = []
    real_randn = torch.randn

    def counting_randn(*args, **kwargs):
        out = real_randn(*args, **kwargs)
        drawn.append(out.numel())
        return out

    spec = GlobalParam((4096, 64), tp_dim=0)
    assert init_block_size(spec) == 1024
    monkeypatch.setattr(sharding.torch, "randn", counting_randn)
    init_shard(spec, name="w", tp_rank=3, tp_size=4, **KW)
    assert drawn == [1024 * 64]
    drawn.clear()
    init_shard(spec, name="w", tp_rank=5, tp_size=8, **KW)
    assert drawn == [1024 * 64]
    drawn.clear()
    init_full(spec, name="w", **KW)
    assert sum(drawn) == 4096 * 64
