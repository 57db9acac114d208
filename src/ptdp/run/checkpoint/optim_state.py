"""Adam's state per parameter, in the parameter's local (tp-shard) shape, whatever optimizer holds it.

``torch.optim.AdamW`` keeps it on the parameters, :class:`~ptdp.engine.optim.adamw.MainParamsAdamW`
on fp32 main copies of 16-bit parameters, :class:`~ptdp.engine.optim.zero.ShardedAdamW` on this dp
rank's flat segments. Checkpoints see ``exp_avg``, ``exp_avg_sq`` (and ``main`` for 16-bit) shaped
like the local shard, plus one step count. Sharded state is assembled on save with one sum
all-reduce per tensor over ``ParallelGroups.dp_cp`` (each element non-zero on exactly one rank, so
the sum is exact); each rank takes its segments back on load.
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.engine.comm import all_reduce
from ptdp.engine.optim.adamw import MainParamsAdamW
from ptdp.engine.optim.zero import ShardedAdamW

MOMENTS = ("exp_avg", "exp_avg_sq")


def state_kinds(optimizer) -> tuple[str, ...]:
    """Per-parameter tensors this optimizer checkpoints."""
    low_precision = isinstance(optimizer, MainParamsAdamW) or (
        isinstance(optimizer, ShardedAdamW) and (bool(optimizer.pairs) or optimizer.main_is_shard)
    )
    return MOMENTS + (("main",) if low_precision else ())


def _inner_and_map(optimizer) -> tuple[torch.optim.Optimizer, dict[int, nn.Parameter]]:
    """The torch optimizer holding the state, and model parameter id -> the tensor it is keyed by."""
    if isinstance(optimizer, MainParamsAdamW):
        return optimizer.inner, {id(p): main for p, main in optimizer.pairs}
    return optimizer, {}


def step_count(optimizer) -> int:
    """Adam's step count (the same for every parameter; 0 before the first step)."""
    inner = optimizer.inner if isinstance(optimizer, (MainParamsAdamW, ShardedAdamW)) else optimizer
    if inner is None:
        return 0
    for state in inner.state.values():
        return int(state["step"])
    return 0


def gather_local_state(
    optimizer, params: list[nn.Parameter], dp, kinds: tuple[str, ...] | None = None
) -> dict[int, dict[str, torch.Tensor]]:
    """``{id(param): {kind: tensor of param's local shape}}`` for every parameter (zeros before the
    first step); ``kinds`` default :func:`state_kinds`. Collective over ``dp``, the group the
    distributed optimizer shards over (``ParallelGroups.dp_cp``, or ``edp`` for experts).

    Nothing is cloned on the device: the optimizer's own tensors are returned detached; the
    distributed optimizer's are assembled one parameter at a time on the device and moved to the CPU.
    """
    kinds = state_kinds(optimizer) if kinds is None else kinds
    if isinstance(optimizer, ShardedAdamW):
        return _gather_sharded(optimizer, params, kinds, dp)
    inner, to_key = _inner_and_map(optimizer)
    out = {}
    for p in params:
        key = to_key.get(id(p), p)
        state = inner.state.get(key, {})
        entry = {k: state[k].detach() if k in state else torch.zeros_like(key) for k in MOMENTS}
        if "main" in kinds:
            entry["main"] = key.detach()
        out[id(p)] = entry
    return out


def _gather_sharded(optimizer: ShardedAdamW, params, kinds, dp) -> dict[int, dict[str, torch.Tensor]]:
    """Per parameter, in ``params`` order: its kinds assembled on the device from this rank's
    segments (zeros elsewhere), summed over dp, moved to the CPU."""
    state_dtype = torch.float64 if params and params[0].dtype == torch.float64 else torch.float32
    segments: dict[int, list] = {}
    for seg, main in optimizer.segment_mains:
        segments.setdefault(id(seg.param), []).append((seg, main))
    state, out = optimizer.state, {}
    for p in params:
        entry = {k: torch.zeros(p.numel(), dtype=state_dtype, device=p.device) for k in kinds}
        for seg, main in segments.get(id(p), ()):
            for k in MOMENTS:
                if main in state and k in state[main]:
                    entry[k][seg.lo : seg.hi] = state[main][k]
            if "main" in kinds:
                entry["main"][seg.lo : seg.hi] = main.detach()
        for k in kinds:
            all_reduce(entry[k], dp, tag="checkpoint")
        out[id(p)] = {k: t.view(p.shape).to("cpu") for k, t in entry.items()}
    return out


@torch.no_grad()
def load_local_state(
    optimizer, params: list[nn.Parameter], tensors: dict[int, dict[str, torch.Tensor]], step: int
) -> None:
    """Put loaded per-parameter tensors (local shapes) into ``optimizer``; ``step`` is Adam's count.
    A ``main`` entry also becomes the 16-bit parameter's float32 main copy."""
    if isinstance(optimizer, ShardedAdamW):
        if optimizer.inner is None:  # this rank's shards hold only padding: no state
            return
        for seg, main in optimizer.segment_mains:
            entry = tensors[id(seg.param)]
            if "main" in entry:
                main.copy_(entry["main"].reshape(-1)[seg.lo : seg.hi])
            _set_state(optimizer.inner, main, {k: entry[k].reshape(-1)[seg.lo : seg.hi] for k in MOMENTS}, step)
        return
    inner, to_key = _inner_and_map(optimizer)
    for p in params:
        key, entry = to_key.get(id(p), p), tensors[id(p)]
        if "main" in entry and key is not p:
            key.copy_(entry["main"])
        _set_state(inner, key, {k: entry[k] for k in MOMENTS}, step)


def _set_state(inner: torch.optim.Optimizer, key: torch.Tensor, moments: dict[str, torch.Tensor], step: int) -> None:
    if step == 0:
        inner.state.pop(key, None)
        return
    # on the parameter's device: fused AdamW keeps (and needs) its step count there
    inner.state[key] = {
        "step": torch.tensor(float(step), dtype=torch.float32, device=key.device),
        **{k: v.to(key.dtype).clone().view_as(key) for k, v in moments.items()},
    }
