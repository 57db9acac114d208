"""Optimizer post-validation (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241,
§4): update before the step's global state is known, then roll back where it says otherwise.

Each optimizer saves what its update writes (:class:`Snapshot`) and updates with the unclipped
gradients, unskipped (:func:`step_optimistically`), while the world all-reduce of the gradient
norm and the non-finite / float16 overflow flags is in flight. Once they are known, ``redo`` (the
step is skipped, or its clip coefficient is not 1) puts the saved tensors back
(:meth:`Snapshot.restore`) and the optimizer's ordinary step runs with the clipped gradients,
skipped on the device unless ``redo`` and not skipped: bit for bit the synchronous step on the
same global state.

Costs: the copy (the parameters AdamW updates, float32 main parameters for 16-bit models, both
moments: 12 bytes per updated float32 parameter, 24 in float64), held during the step; one
``torch.where`` per saved tensor; a second update, a no-op on the device (fused AdamW's
``found_inf``) when the first was right. No host read (but for a non-fused AdamW, as
:func:`~ptdp.engine.optim.adamw.step_unless`). Buys: no update waits for the all-reduce; they
overlap where the all-reduce is asynchronous to the update (NCCL: its own stream; gloo: its own
threads, sharing the CPU cores with the update).
"""

from __future__ import annotations

import torch

from ptdp.engine.optim.adamw import MainParamsAdamW
from ptdp.engine.optim.zero import ShardedAdamW

Optimizer = torch.optim.Optimizer | MainParamsAdamW | ShardedAdamW


class Snapshot:
    """The tensors a step of ``optimizer`` (a torch AdamW, or None: nothing) writes, as they are
    now: its parameters and each parameter's state (moments, step count); a parameter without
    state yet gets it from the step, zeros before it (as torch creates it)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.state = optimizer.state if optimizer is not None else {}
        params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self.saved = [
            (p, p.detach().clone(), {k: v.clone() for k, v in self.state.get(p, {}).items() if torch.is_tensor(v)})
            for p in params
        ]

    @torch.no_grad()
    def restore(self, redo: torch.Tensor) -> None:
        """Where the 0-dim bool tensor ``redo`` is true, put every saved tensor back (state the
        step created: zeros); otherwise change nothing. ``torch.where`` on the device."""
        for p, saved, saved_state in self.saved:
            torch.where(redo, saved, p.detach(), out=p.detach())
            for key, now in self.state.get(p, {}).items():
                if torch.is_tensor(now):
                    before = saved_state.get(key, torch.zeros((), dtype=now.dtype, device=now.device))
                    torch.where(redo.to(now.device), before, now, out=now)


def step_optimistically(optimizer: Optimizer) -> Snapshot:
    """Save what ``optimizer``'s update writes, then update with the gradients as they are
    (unclipped), unskipped: the AdamW update alone (a wrapper's :meth:`update`: no copy into
    16-bit model parameters, no parameter all-gather; its ordinary ``step`` follows validation)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        snapshot = Snapshot(optimizer)
        optimizer.step()
        return snapshot
    if isinstance(optimizer, ShardedAdamW):
        optimizer.finish_gathers()  # they write the parameters saved here
    snapshot = Snapshot(optimizer.inner)
    optimizer.update()
    return snapshot
