"""AdamW as ptdp steps it: torch's fused (or foreach) AdamW without its ``torch._dynamo``
wrappers, an update skipped on the device, and AdamW on float32 main parameters of 16-bit models."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ptdp.engine.data_parallel.buffer import GradBuffer


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose parameter-group setup and step run torch's own code without its
    ``torch._dynamo`` wrappers (which import ``torch._dynamo`` on first use; ptdp never compiles
    the optimizer): the undecorated ``AdamW.step`` under ``torch.no_grad()``, as the decorator
    does outside compilation. The state, the state dict and the arithmetic are torch's."""

    def add_param_group(self, param_group: dict) -> None:
        inspect.unwrap(torch.optim.Optimizer.add_param_group)(self, param_group)

    def step(self, closure=None):  # the profiler hook wraps it as torch's
        with torch.no_grad():
            return inspect.unwrap(torch.optim.AdamW.step)(self, closure)


def adamw(groups: list[dict], **adam_kwargs) -> torch.optim.AdamW:
    """:class:`AdamW` with ``fused=True`` (one multi-tensor kernel per device and dtype, the
    step count kept on the device, the update skippable on the device: :func:`step_unless`)
    where torch has the fused kernel for the parameters' device and dtype (torch 2.13: CUDA,
    CPU, XPU, MPS; floating-point parameters); the default (foreach) implementation otherwise."""
    try:
        return AdamW(groups, fused=True, **adam_kwargs)
    except RuntimeError:  # "`fused=True` requires all the params to be floating point Tensors of supported devices"
        return AdamW(groups, **adam_kwargs)


def step_unless(optimizer: torch.optim.Optimizer | None, skip: torch.Tensor | None) -> None:
    """``optimizer.step()``, unless the 0-dim bool tensor ``skip`` is true: then nothing changes
    (parameters, moments, step count).

    A fused AdamW decides on the device: ``skip`` is its kernel's ``found_inf`` (as
    ``torch.amp.GradScaler`` passes it), so no host synchronisation; otherwise ``skip`` is read
    to the host."""
    if optimizer is None:
        return
    if skip is None:
        optimizer.step()
    elif optimizer.defaults.get("fused"):
        # found_inf: a dynamic attribute the fused kernel reads (GradScaler's hand-over)
        optimizer.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    elif not bool(skip):
        optimizer.step()


class MainParamsAdamW:
    """AdamW on float32 copies ("main parameters") of low-precision model parameters.

    Each step updates the float32 copies from the float32 gradient buffer, then rounds them into
    the model's parameters, so small updates are not lost (Micikevicius et al., "Mixed Precision
    Training", arXiv:1710.03740, §3.1). The main parameters are views of one flat float32 tensor
    (:attr:`main_data`) laid out like the gradient buffer; 4 bytes per parameter more than AdamW.
    A bfloat16 buffer (``--grad-reduce-in-bf16``) is copied to float32 for the step and freed after
    it (a transient of 4 bytes per parameter).
    """

    def __init__(self, groups: list[dict], grads: GradBuffer, **adam_kwargs) -> None:
        self._grads = grads if grads.data.dtype != torch.float32 else None  # bf16: copied at each step
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self.main_data = torch.zeros_like(grads.data, dtype=torch.float32)
        main_groups = []
        for group in groups:
            mains = []
            for p in group["params"]:
                grad = grads.grad(p)
                view = self.main_data[grad.storage_offset() : grad.storage_offset() + p.numel()].view_as(p)
                view.copy_(p.detach())
                main = nn.Parameter(view)
                main.grad = grad if self._grads is None else None
                self.pairs.append((p, main))
                mains.append(main)
            main_groups.append({**group, "params": mains})
        self.inner = adamw(main_groups, **adam_kwargs)
        self._model: list[torch.Tensor] = [p for p, _ in self.pairs]
        self._mains: list[torch.Tensor] = [m for _, m in self.pairs]

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def update(self, skip: torch.Tensor | None = None) -> None:
        """Update the main parameters (unless ``skip``: :func:`step_unless`), not the model's."""
        if self._grads is None:
            step_unless(self.inner, skip)
        else:
            views = [self._grads.grad(p) for p, _ in self.pairs]
            with float32_grads(self._mains, self._grads.data, views, self._grads.step_scale):
                step_unless(self.inner, skip)

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> None:
        """:meth:`update`, then round the main parameters into the model's parameters (after a
        skipped step this rewrites the same values)."""
        self.update(skip)
        torch._foreach_copy_(self._model, self._mains)


@contextlib.contextmanager
def float32_grads(
    mains: Sequence[torch.Tensor], flat: torch.Tensor, views: list[torch.Tensor], scale: torch.Tensor | None = None
) -> Iterator[None]:
    """Give each float32 main parameter, for the block, a float32 gradient: its view (one of
    ``views``, into the 16-bit ``flat``) in one float32 copy of ``flat`` times ``scale`` (the clip
    coefficient, if any), freed afterwards."""
    copy = flat.float()
    if scale is not None:
        copy.mul_(scale)
    for main, view in zip(mains, views):
        offset = view.storage_offset() - flat.storage_offset()
        main.grad = copy[offset : offset + main.numel()].view_as(main)
    try:
        yield
    finally:
        for main in mains:
            main.grad = None


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
