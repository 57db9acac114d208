"""Activation recomputation: keep fewer activations in forward, recompute them in backward.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" [K22],
arXiv:2205.05198. ``ModelConfig.recompute_granularity``:

- ``full``: a model chunk's layers run in groups; a recomputed group keeps only its input
  ``[s, b, h]`` and runs again from it in backward. ``recompute_method="uniform"``: every layer, in
  consecutive groups of ``recompute_num_layers`` (the last group may be shorter); ``"block"``: the
  first ``recompute_num_layers`` layers of the chunk, one per group, and the other layers keep
  all their activations (less recompute when memory allows it).
- ``selective``: only the attention core, scores ``q k^T``, causal softmax and context ``p v``
  ([K22] §5), recomputes; projections, norms and MLP keep theirs. What that saves depends on
  the kernel: the unfused (math) kernel keeps the ``b a s^2`` probabilities (the ``5 a s / h``
  term of [K22]), the fused kernels that ``scaled_dot_product_attention`` picks on CPU (and for
  16-bit on CUDA) never store scores and keep only their output and a log-sum-exp per row.

A region is recomputed by ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with the RNG
state preserved, so the recompute computes exactly the values of the first forward (bitwise on
CPU). Dropout draws from the model's :class:`~ptdp.engine.tensor_parallel.random.DropoutRNG` streams,
which are not torch's default generators: their ``checkpoint_contexts`` (the checkpoint's
``context_fn``) save them when a region first runs and restore them around the recompute, so the
recompute draws the same masks. Communication: tensor-parallel all-reduces inside a recomputed
region run again in backward, on every tp rank in the same order. The recompute stops once it has
rebuilt the last tensor backward needs (PyTorch's "early stop"), which comes before a group's last
all-reduce (after its last ``fc2``): a recomputed group of ``n`` layers repeats ``2 n - 1``
forward all-reduces of ``s b h`` elements per microbatch. Selective recompute communicates
nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ptdp.config.fields import RECOMPUTE_METHODS
from ptdp.engine.tensor_parallel.random import DropoutRNG


def recomputed(fn: Callable[..., torch.Tensor], *args: torch.Tensor, rng: DropoutRNG | None = None) -> torch.Tensor:
    """``fn(*args)`` keeping only ``args`` for backward, which runs ``fn`` again to get the rest.
    ``rng``: the dropout streams ``fn`` draws from, replayed by the recompute (None: no dropout).

    Without autograd (evaluation) it is just ``fn(*args)``.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    if rng is None:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=rng.checkpoint_contexts)


def layer_groups(num_layers: int, method: str, per_group: int) -> list[tuple[int, int, bool]]:
    """How a chunk of ``num_layers`` layers runs under full recompute: ``(start, end, recomputed)``
    ranges of local layer positions, in order, covering every layer once.

    ``uniform``: ``[start, start + per_group)`` groups, all recomputed. ``block``: layers
    ``0 .. per_group - 1`` recomputed one by one, the rest in one group that is not.
    Example: 5 layers, uniform 2 -> (0,2,T) (2,4,T) (4,5,T); block 2 -> (0,1,T) (1,2,T) (2,5,F).
    """
    if method == "uniform":
        return [(i, min(i + per_group, num_layers), True) for i in range(0, num_layers, per_group)]
    if method == "block":
        n = min(per_group, num_layers)
        rest = [(n, num_layers, False)] if n < num_layers else []
        return [(i, i + 1, True) for i in range(n)] + rest
    raise ValueError(f"recompute_method={method!r} must be one of {RECOMPUTE_METHODS}")


def run_layers(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    *,
    granularity: str | None,
    method: str | None,
    num_layers: int | None,
    rng: DropoutRNG | None = None,
) -> torch.Tensor:
    """Run ``layers`` in order on ``x [s, b, h]``, recomputing groups of them under ``full``
    granularity (any other granularity runs them plainly; selective acts inside attention).
    ``rng``: the layers' dropout streams (None without dropout)."""
    if granularity != "full":
        for layer in layers:
            x = layer(x)
        return x
    for start, end, again in layer_groups(len(layers), method or "uniform", num_layers or 1):
        group = _Sequence(layers[start:end])
        x = recomputed(group, x, rng=rng) if again else group(x)
    return x


class _Sequence:
    """The layers of one group as a callable (not a module: no parameters registered twice)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
