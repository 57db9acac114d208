"""Windows, global batch sampler, DP sharding, microbatches, eval batches."""

import numpy as np
import pytest
import torch

from ptdp.data.dataset import (
    GlobalBatchSampler,
    TokenWindows,
    device_microbatches,
    dp_shard,
    eval_indices,
    microbatches,
)
from ptdp.data.indexed import IndexedTokens, write_indexed
from ptdp.errors import DataError


@pytest.fixture
def stream(tmp_path):
    """An indexed file whose token stream is 0, 1, 2, ..., 1000 (split into 7 documents)."""
    tokens = np.arange(1001)
    write_indexed(tmp_path / "s", np.array_split(tokens, 7), np.uint16)
    return IndexedTokens(tmp_path / "s")


def test_windows_tile_the_stream(stream):
    s = 32
    w = TokenWindows(stream, s)
    assert len(w) == (1001 - 1) // s == 31
    for i in range(len(w)):
        sample = w[i]
        assert sample.shape == (s + 1,) and sample.dtype == np.int64
        np.testing.assert_array_equal(sample, np.arange(i * s, i * s + s + 1))
    np.testing.assert_array_equal(w.batch([3, 0]), np.stack([w[3], w[0]]))
    with pytest.raises(IndexError):
        w[len(w)]
    with pytest.raises(IndexError):
        w.batch([0, len(w)])
    assert len(TokenWindows(stream, 1000)) == 1


def test_windows_too_small(stream):
    with pytest.raises(DataError, match="num_tokens=1001.*seq_length=1001"):
        TokenWindows(stream, 1001)
    with pytest.raises(DataError, match="seq_length"):
        TokenWindows(stream, 0)


def test_microbatches_shift_labels(stream):
    w = TokenWindows(stream, 16)
    mbs = microbatches(w, np.array([5, 1, 9, 2, 7, 0]), 2)
    assert len(mbs) == 3
    for tokens, labels in mbs:
        assert tokens.dtype == labels.dtype == torch.long
        assert tokens.shape == labels.shape == (2, 16)
        assert torch.equal(tokens[:, 1:], labels[:, :-1])
    np.testing.assert_array_equal(mbs[0][0][0].numpy(), w[5][:-1])
    np.testing.assert_array_equal(mbs[2][1][1].numpy(), w[0][1:])
    with pytest.raises(DataError, match="micro_batch_size=4"):
        microbatches(w, np.arange(6), 4)


def test_device_microbatches_equal_microbatches_from_one_block(stream):
    w = TokenWindows(stream, 16)
    indices = np.array([5, 1, 9, 2, 7, 0])
    # the reference: each microbatch's windows gathered on their own
    host = [
        (torch.from_numpy(w.batch(indices[i : i + 2]))[:, :-1], torch.from_numpy(w.batch(indices[i : i + 2]))[:, 1:])
        for i in range(0, 6, 2)
    ]
    dev = device_microbatches(w, indices, 2, "cpu")
    assert len(dev) == 3
    for (t, l), (dt, dl) in zip(host, dev):
        assert torch.equal(t, dt) and torch.equal(l, dl) and dt.is_contiguous() and dl.is_contiguous()
    # every microbatch views the step's one tokens tensor and one labels tensor
    assert len({t.untyped_storage().data_ptr() for t, _ in dev}) == 1
    assert len({l.untyped_storage().data_ptr() for _, l in dev}) == 1
    with pytest.raises(DataError, match="micro_batch_size=4"):
        device_microbatches(w, np.arange(6), 4, "cpu")


def test_device_microbatches_copy_once_per_step_pinned_and_non_blocking(stream, monkeypatch):
    """For a CUDA device: one pinned block, one non-blocking copy, however many microbatches (the
    copy is recorded here, the tensor stays on the CPU; the real one: tests/unit/test_gpu.py)."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append(("pin", tuple(self.shape))) or self)
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and torch.device(args[0]).type == "cuda":
            calls.append(("to", str(args[0]), kwargs.get("non_blocking")))
            return self
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    mbs = device_microbatches(TokenWindows(stream, 16), np.arange(8), 1, torch.device("cuda"))
    assert len(mbs) == 8
    assert calls == [("pin", (8, 17)), ("to", "cuda", True)]


def test_sampler_deterministic_and_seeded():
    a = GlobalBatchSampler(100, 16, seed=1)
    b = GlobalBatchSampler(100, 16, seed=1)
    c = GlobalBatchSampler(100, 16, seed=2)
    for consumed in (0, 16, 96, 250):
        np.testing.assert_array_equal(a.global_batch(consumed), b.global_batch(consumed))
    assert not np.array_equal(a.global_batch(0), c.global_batch(0))
    # random access equals sequential access (resume from any consumed_samples)
    fresh = GlobalBatchSampler(100, 16, seed=1)
    np.testing.assert_array_equal(fresh.global_batch(250), a.global_batch(250))
    np.testing.assert_array_equal(GlobalBatchSampler(10, 4, 0, shuffle=False).global_batch(8), [8, 9, 0, 1])


def test_sampler_epochs_cover_each_sample_once():
    n, bsz = 50, 8
    sampler = GlobalBatchSampler(n, bsz, seed=3)
    stream = np.concatenate([sampler.global_batch(k) for k in range(0, 4 * n, bsz)])
    for epoch in range(4):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert not np.array_equal(stream[:n], stream[n : 2 * n])  # reshuffled each epoch
    assert sampler.epoch(n - 1) == 0 and sampler.epoch(n) == 1


def test_sampler_leaves_global_rng_alone():
    np_state, torch_state = np.random.get_state(), torch.get_rng_state()
    sampler = GlobalBatchSampler(1000, 64, seed=7)
    for k in range(0, 5000, 64):
        sampler.global_batch(k)
    after = np.random.get_state()
    assert np_state[0] == after[0] and np.array_equal(np_state[1], after[1]) and np_state[2:] == after[2:]
    assert torch.equal(torch_state, torch.get_rng_state())


def test_sampler_bad_inputs():
    with pytest.raises(DataError, match="num_samples=8.*global_batch_size=16"):
        GlobalBatchSampler(8, 16, seed=0)
    with pytest.raises(DataError, match="seed"):
        GlobalBatchSampler(8, 4, seed=-1)
    with pytest.raises(DataError, match="consumed_samples"):
        GlobalBatchSampler(8, 4, seed=0).global_batch(-1)


@pytest.mark.parametrize("dp_size", [1, 2, 4, 8])
def test_dp_shards_disjoint_and_cover(dp_size):
    sampler = GlobalBatchSampler(1000, 64, seed=0)
    for consumed in (0, 64, 896, 960):  # 960 crosses an epoch boundary
        batch = sampler.global_batch(consumed)
        shards = [dp_shard(batch, r, dp_size) for r in range(dp_size)]
        assert all(len(s) == 64 // dp_size for s in shards)
        np.testing.assert_array_equal(np.concatenate(shards), batch)  # contiguous, in order
        seen = [int(i) for s in shards for i in s]
        if consumed + 64 <= 1000:  # within one epoch the samples themselves are distinct
            assert len(set(seen)) == len(seen) == 64


def test_batches_independent_of_layout():
    """The global batch is the same whatever dp/micro-batch split consumes it."""
    windows_per_step = {}
    for dp_size, mbs in [(1, 16), (2, 4), (4, 1), (8, 2)]:
        sampler = GlobalBatchSampler(500, 16, seed=11)
        steps = []
        for step in range(3):
            batch = sampler.global_batch(step * 16)
            shards = [dp_shard(batch, r, dp_size) for r in range(dp_size)]
            micro = [s[i : i + mbs] for s in shards for i in range(0, len(s), mbs)]
            steps.append(np.concatenate(micro))
        windows_per_step[(dp_size, mbs)] = np.stack(steps)
    ref = windows_per_step[(1, 16)]
    for arr in windows_per_step.values():
        np.testing.assert_array_equal(arr, ref)


def test_dp_shard_errors():
    with pytest.raises(DataError, match="dp_size=3"):
        dp_shard(np.arange(16), 0, 3)
    with pytest.raises(DataError, match="dp_rank=4"):
        dp_shard(np.arange(16), 4, 4)


def test_eval_indices():
    batches = eval_indices(10, 4, 4)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]]
    assert [b.tolist() for b in eval_indices(10, 4, 4)] == [b.tolist() for b in batches]
    assert eval_indices(10, 4, 0) == []
    with pytest.raises(DataError, match="eval_iters"):
        eval_indices(10, 4, -1)
