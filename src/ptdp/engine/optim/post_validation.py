"""Optimizer post-validation (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241,
§4): update before the step's global state is known, then roll back where it says otherwise.

The synchronous step waits for the global gradient norm (clipping) and for every rank's
non-finite and float16 overflow flags before it updates. Post-validated, each optimizer saves
what its update writes (:class:`Snapshot`) and updates with the unclipped gradients, as if
nothing were wrong (:func:`step_optimistically`), while the world all-reduce of that state is in
flight. Once it is known, ``redo`` (the step is skipped, or its clip coefficient is not 1) puts
the saved tensors back (:meth:`Snapshot.restore`) and the optimizer's ordinary step runs again
with the clipped gradients, skipped on the device unless ``redo`` and not skipped. AdamW being
deterministic, the result equals the synchronous step bit for bit.

Costs: a copy of every tensor the update writes (the parameters AdamW updates, float32 main
parameters for 16-bit models, both moments, the step counts: 12 bytes per parameter the rank
updates in float32, 24 in float64, 1/d of that when sharded over d ranks), held during the step;
one ``torch.where`` per saved tensor; a second update, which the fused AdamW skips on the device
(its ``found_inf``) when the first was right. All decisions stay on the device: no host read.
What it buys: no update waits for the all-reduce. It overlaps only where the all-reduce is
asynchronous to the update: on NCCL it runs on its own stream while the update's kernels run;
gloo runs an ``async_op`` collective on its own threads, which compete with the update for the
same CPU cores.
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
