"""Gradients of one model-parallel shard: a contiguous buffer, the data-parallel all-reduce, the
tied-embedding sum, and the global gradient norm with clipping.

Each parameter's ``.grad`` is a view into one flat buffer, so microbatch gradients accumulate in place
and the data-parallel reduction is a single all-reduce of the stage's gradient bytes per step
(Narayanan et al. SC21, §3.2).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ptdp.comm import all_reduce
from ptdp.groups import ParallelGroups
from ptdp.tensor_parallel.sharding import spec_of


class GradBuffer:
    """One flat gradient buffer for ``params``; each ``param.grad`` is a view into it.

    Autograd accumulates into the views in place, so gradient accumulation over microbatches needs
    no copy. Call :meth:`zero` (not ``optimizer.zero_grad``, which would drop the views) between
    steps.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        if not params:
            raise ValueError("GradBuffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one buffer must share a dtype, got {sorted(map(str, dtypes))}")
        self.params = params
        self.data = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.data[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def zero(self) -> None:
        storage = self.data.untyped_storage().data_ptr()
        for p in self.params:
            if p.grad is None or p.grad.untyped_storage().data_ptr() != storage:
                raise RuntimeError("a parameter's .grad no longer views the gradient buffer (was zero_grad called?)")
        self.data.zero_()


def finalize_grads(model: nn.Module, buffer: GradBuffer, groups: ParallelGroups) -> None:
    """Average gradients over dp (one all-reduce of the whole buffer), then sum the tied
    embedding's gradient over the embedding group (first + last stage) so both copies get the
    same update.

    Communication: dp all-reduce of ``buffer.data.numel()`` elements; embedding all-reduce of the
    ``[V_pad / tp, h]`` word-embedding gradient (only with pp > 1 and tied embeddings).
    """
    if groups.dp.size > 1:
        all_reduce(buffer.data, groups.dp, tag="grads")
        buffer.data.div_(groups.dp.size)
    tied = model.tied_embedding() if hasattr(model, "tied_embedding") else None
    if tied is not None and groups.embedding.size > 1:
        all_reduce(tied.grad, groups.embedding, tag="tied_embedding")


def counts_in_norm(param: nn.Parameter, groups: ParallelGroups) -> bool:
    """Whether this rank's copy of ``param`` is the one counted in the global norm.

    Tensor-parallel shards are all counted (they are disjoint); replicated parameters only on tp
    rank 0; the last stage's copy of a tied embedding not at all (the first stage counts it).
    """
    if getattr(param, "ptdp_tied_copy", False):
        return False
    return spec_of(param).tp_dim is not None or groups.tp.rank == 0


def clip_grad_norm(model: nn.Module, buffer: GradBuffer, groups: ParallelGroups, max_norm: float) -> float:
    """Global L2 norm of all gradients of the model (every parameter counted once), and clip.

    The norm sums squares over this rank's counted parameters, then all-reduces over tp and pp (a
    1-element tensor each); all dp replicas hold equal gradients and need no reduction. If
    ``max_norm > 0`` and the norm exceeds it, every gradient is multiplied by
    ``max_norm / (norm + 1e-6)``. Returns the norm before clipping.
    """
    sq = torch.zeros((), dtype=torch.float64, device=buffer.data.device)
    for param in model.parameters():
        if counts_in_norm(param, groups):
            sq += param.grad.double().pow(2).sum()
    all_reduce(sq, groups.tp, tag="grad_norm")
    all_reduce(sq, groups.pp, tag="grad_norm")
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        buffer.data.mul_(max_norm / (norm + 1e-6))
    return norm
