"""Token stream -> fixed-length samples -> global batches -> data-parallel shards -> microbatches.

Sample order is a pure function of (seed, number of samples, consumed_samples): the global batch
at step t is the same whatever the tensor/pipeline/data-parallel layout, and each data-parallel
rank takes a contiguous slice of it. So resuming from a checkpoint (which stores
``consumed_samples``) or changing the layout replays exactly the same data.

Shapes: ``s`` = seq_length, ``B`` = global batch size (samples per optimizer step), ``dp`` = data
parallel size, ``b`` = micro batch size; each rank runs ``B / (dp * b)`` microbatches per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ptdp.data.indexed import IndexedTokens
from ptdp.errors import DataError


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an int >= {minimum}, got {value!r}")


class TokenWindows:
    """The token stream cut into non-overlapping windows of ``seq_length + 1`` tokens.

    Sample i is ``tokens[i*s : i*s + s + 1]``: inputs are its first s tokens, labels its last s
    (consecutive windows share one boundary token, so every token is predicted exactly once).
    Documents already end with ``<|endoftext|>``, so windows cross document boundaries.
    """

    def __init__(self, indexed: IndexedTokens, seq_length: int) -> None:
        _check_int("seq_length", seq_length, 1)
        self.indexed = indexed
        self.seq_length = int(seq_length)
        self.num_tokens = int(indexed.num_tokens)
        self._len = (self.num_tokens - 1) // self.seq_length
        if self._len <= 0:
            raise DataError(
                f"{indexed!r} is too small for one sample: num_tokens={self.num_tokens} but "
                f"seq_length={self.seq_length} needs at least {self.seq_length + 1} tokens"
            )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        """Window ``i``: int64 array of shape [seq_length + 1]."""
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range [0, {self._len})")
        start = int(i) * self.seq_length
        return np.asarray(self.indexed.tokens[start : start + self.seq_length + 1], dtype=np.int64)

    def batch(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Windows ``indices`` stacked: int64 array of shape [len(indices), seq_length + 1]."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            raise IndexError(f"sample indices [{idx.min()}, {idx.max()}] out of range [0, {self._len})")
        positions = idx[:, None] * self.seq_length + np.arange(self.seq_length + 1, dtype=np.int64)
        return np.asarray(self.indexed.tokens[positions], dtype=np.int64)


class GlobalBatchSampler:
    """Maps consumed-sample counts to global batches of sample indices, epoch after epoch.

    Global position k (0, 1, 2, ...) is epoch ``k // num_samples`` and sample
    ``perm[epoch][k % num_samples]``, with ``perm[epoch] =
    numpy.random.default_rng([seed, epoch]).permutation(num_samples)`` (identity if not shuffled).
    Uses private generators only; global numpy/torch RNG state is never touched.
    """

    _CACHED_EPOCHS = 2

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True) -> None:
        _check_int("num_samples", num_samples, 1)
        _check_int("global_batch_size", global_batch_size, 1)
        _check_int("seed", seed, 0)
        if num_samples < global_batch_size:
            raise DataError(
                f"num_samples={num_samples} is smaller than global_batch_size={global_batch_size}: "
                f"one global batch would repeat samples; use more data or a smaller batch/sequence"
            )
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self._perms: dict[int, np.ndarray] = {}

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """Sample order of ``epoch``: int64 array of shape [num_samples] (a permutation)."""
        _check_int("epoch", epoch, 0)
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples, dtype=np.int64)
            if len(self._perms) >= self._CACHED_EPOCHS:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm.astype(np.int64, copy=False)
        return self._perms[epoch]

    def epoch(self, consumed_samples: int) -> int:
        """The epoch the next sample comes from."""
        return consumed_samples // self.num_samples

    def global_batch(self, consumed_samples: int) -> np.ndarray:
        """Sample indices at positions consumed_samples .. +B-1: int64 array of shape [B]."""
        _check_int("consumed_samples", consumed_samples, 0)
        positions = int(consumed_samples) + np.arange(self.global_batch_size, dtype=np.int64)
        epochs = positions // self.num_samples
        out = np.empty(self.global_batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.epoch_permutation(int(epoch))[positions[mask] % self.num_samples]
        return out


def dp_shard(global_indices: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """This data-parallel rank's contiguous slice ``[dp_rank*B/dp, (dp_rank+1)*B/dp)``: shape [B/dp]."""
    _check_int("dp_size", dp_size, 1)
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
    total = len(global_indices)
    if total % dp_size:
        raise DataError(f"global batch of {total} samples is not divisible by dp_size={dp_size}")
    per_rank = total // dp_size
    return np.asarray(global_indices)[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def microbatches(
    windows: TokenWindows, indices: np.ndarray, micro_batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a rank's sample indices into consecutive microbatches of ``b`` samples.

    Returns ``len(indices) // b`` pairs ``(tokens, labels)``, both ``torch.long`` of shape [b, s],
    with ``labels[:, j] == tokens[:, j + 1]`` inside a window.
    """
    return device_microbatches(windows, indices, micro_batch_size, "cpu")


def device_microbatches(
    windows: TokenWindows, indices: np.ndarray, micro_batch_size: int, device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rank's microbatches (:func:`microbatches`) on ``device``, with one host-to-device copy per
    call (per step).

    The rank's windows ``[B/dp, s + 1]`` (int64) are gathered once, copied from pinned memory with
    ``non_blocking=True`` on CUDA, and split on the device into ``tokens = windows[:, :-1]`` and
    ``labels = windows[:, 1:]``. Returns ``B / (dp * b)`` pairs of ``[b, s]`` ``torch.long`` tensors
    on ``device``. Raises DataError when ``b`` does not divide the rank's samples.
    """
    _check_int("micro_batch_size", micro_batch_size, 1)
    if len(indices) % micro_batch_size:
        raise DataError(f"{len(indices)} samples per rank are not divisible by micro_batch_size={micro_batch_size}")
    device = torch.device(device)
    block = torch.from_numpy(windows.batch(indices))
    if device.type == "cuda":
        block = block.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        block = block.to(device)
    tokens, labels = block[:, :-1].contiguous(), block[:, 1:].contiguous()
    b = micro_batch_size
    return [(tokens[i : i + b], labels[i : i + b]) for i in range(0, len(indices), b)]


def eval_indices(num_samples: int, global_batch_size: int, eval_iters: int) -> list[np.ndarray]:
    """Fixed validation batches: batch j holds positions ``j*B .. j*B+B-1`` modulo num_samples.

    Not shuffled, so every evaluation sees the same samples. Returns ``eval_iters`` int64 arrays of
    shape [B]; a small validation set wraps around (and may repeat samples).
    """
    _check_int("num_samples", num_samples, 1)
    _check_int("global_batch_size", global_batch_size, 1)
    _check_int("eval_iters", eval_iters, 0)
    base = np.arange(global_batch_size, dtype=np.int64)
    return [(j * global_batch_size + base) % num_samples for j in range(eval_iters)]
