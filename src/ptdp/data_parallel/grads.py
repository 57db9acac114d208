"""Gradients of one model-parallel shard: a contiguous buffer, the data-parallel all-reduce, the
tied-embedding sum, and the global gradient norm with clipping.

Every parameter's gradient lives in one flat buffer, so microbatch gradients accumulate in place and
the data-parallel reduction is a single all-reduce of the stage's gradient bytes per step
(Narayanan et al. SC21, §3.2). When the buffer's dtype equals the parameters' (float32, float64),
``param.grad`` is a view into it. For bfloat16 parameters the buffer is float32 (as in Megatron's
``main_grad``): after each backward a hook adds ``param.grad`` into ``param.main_grad`` (the view)
and frees it, so accumulation and reduction happen in float32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ptdp.comm import all_reduce
from ptdp.groups import ParallelGroups
from ptdp.tensor_parallel.sharding import spec_of


def _accumulate_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class GradBuffer:
    """One flat gradient buffer of ``grad_dtype`` (default: the parameters' dtype) for ``params``.

    Use :meth:`grad` to read a parameter's accumulated gradient and :meth:`zero` between steps
    (never ``optimizer.zero_grad``, which would detach ``.grad`` from the buffer).
    """

    def __init__(self, params: list[nn.Parameter], grad_dtype: torch.dtype | None = None) -> None:
        if not params:
            raise ValueError("GradBuffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one buffer must share a dtype, got {sorted(map(str, dtypes))}")
        self.params = params
        self.uses_main_grad = grad_dtype is not None and grad_dtype != params[0].dtype
        dtype = grad_dtype or params[0].dtype
        self.data = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        self._views: dict[int, torch.Tensor] = {}
        offset = 0
        for p in params:
            view = self.data[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            self._views[id(p)] = view
            if self.uses_main_grad:
                p.main_grad = view
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
            else:
                p.grad = view

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        """The accumulated gradient of ``param`` (a view into the buffer)."""
        return self._views[id(param)]

    def zero(self) -> None:
        storage = self.data.untyped_storage().data_ptr()
        for p in self.params:
            if self.uses_main_grad:
                continue
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
        all_reduce(buffer.grad(tied), groups.embedding, tag="tied_embedding")


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

    The norm sums squares (in float64) over this rank's counted parameters, then all-reduces over
    tp and pp (a 1-element tensor each); all dp replicas hold equal gradients and need no
    reduction. If ``max_norm > 0`` and the norm exceeds it, every gradient is multiplied by
    ``max_norm / (norm + 1e-6)``. Returns the norm before clipping (nan or inf if a gradient is).
    """
    sq = torch.zeros((), dtype=torch.float64, device=buffer.data.device)
    for param in model.parameters():
        if counts_in_norm(param, groups):
            sq += buffer.grad(param).double().pow(2).sum()
    all_reduce(sq, groups.tp, tag="grad_norm")
    all_reduce(sq, groups.pp, tag="grad_norm")
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        buffer.data.mul_(max_norm / (norm + 1e-6))
    return norm
