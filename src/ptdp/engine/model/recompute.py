"""Activation recomputation: keep fewer activations in forward, recompute them in backward.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" [K22],
arXiv:2205.05198. ``ModelConfig.recompute_granularity``:

- ``full``: a chunk's layers run in groups; a recomputed group keeps only its input ``[s, b, h]``.
  ``recompute_method="uniform"``: every layer, in groups of ``recompute_num_layers``; ``"block"``:
  the first ``recompute_num_layers`` layers, one per group, the rest not recomputed.
- ``selective``: only the attention core (``q k^T``, causal softmax, ``p v``; [K22] §5).

Regions run under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with the RNG state
preserved, dropout streams replayed by ``DropoutRNG.checkpoint_contexts``. Communication: a
recomputed group of ``n`` layers repeats ``2 n - 1`` forward all-reduces of ``s b h`` on tp per
microbatch (PyTorch's early stop skips the last); selective recompute communicates nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ptdp.config.fields import RECOMPUTE_METHODS
from ptdp.engine.activity import recomputing
from ptdp.engine.tensor_parallel.random import DropoutRNG


def recomputed(fn: Callable[..., torch.Tensor], *args: torch.Tensor, rng: DropoutRNG | None = None) -> torch.Tensor:
    """``fn(*args)`` keeping only ``args`` for backward, which runs ``fn`` again to get the rest.
    ``rng``: the dropout streams ``fn`` draws from, replayed by the recompute (None: no dropout).

    Without autograd (evaluation) it is just ``fn(*args)``.
    """
    if not torch.is_grad_enabled():
        return fn(*args)

    def contexts():
        forward, again = rng.checkpoint_contexts() if rng is not None else (nullcontext(), nullcontext())
        return forward, _both(again, recomputing())

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


@contextmanager
def _both(first: AbstractContextManager, second: AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


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
