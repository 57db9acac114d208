"""Layout-independent form of ptdp's parameters (and per-parameter optimizer state): every parameter
is stored as its global tensor, whatever layout wrote it:

- tp shards are pieces at their offsets (a ``ShardedTensor`` over the tp group);
- a fused ``[q | k | v]`` (``GlobalParam.tp_groups = 3``) is stored ``[3, h, ...]``, a tp rank's
  shard being ``[3, h / tp, ...]`` at offset ``(0, tp_rank * h / tp, 0)``; SwiGLU fc1 ``[gate |
  up]`` likewise ``[2, ffn, ...]``;
- grouped-query QKV is laid out group by group (:class:`ptdp.engine.model.attention.Attention`),
  stored as its global ``[(a + 2 G) d, h]`` with each rank's whole groups at their offset;
- vocabulary tensors keep only their ``real_rows``; replicated tensors are stored once;
- a stacked expert parameter (:class:`~ptdp.engine.moe.experts.ExpertParam`) is stored as ``[E,
  *one expert's stored form]`` by global expert index (SwiGLU fc1 ``[E, 2, f, h]``), an ep rank's
  experts at offset ``ep_rank * E / ep`` of dim 0, an etp rank's shard inside each expert.

Per rank, the local view has this rank's shard shape in the stored form.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

from ptdp.engine.comm import AxisGroup
from ptdp.engine.moe.experts import ExpertParam
from ptdp.engine.tensor_parallel.sharding import GlobalParam


@dataclass(frozen=True)
class StoredForm:
    """Where this rank's shard lies in the stored (global) tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: torch.Tensor
    """A view of the local tensor (writing into it writes the parameter or state)."""
    sharded: bool


def stored_form(local: torch.Tensor, spec: GlobalParam, tp_rank: int, tp_size: int) -> StoredForm:
    """The stored form of the local shard ``local`` of a parameter described by ``spec``."""
    shape = list(spec.global_shape)
    if spec.tp_dim is None:
        view = local
        if spec.real_rows is not None:
            view, shape[0] = local[: spec.real_rows], spec.real_rows
        return StoredForm(tuple(shape), (0,) * len(shape), view, False)
    dim, groups = spec.tp_dim, spec.tp_groups
    local_shape = list(local.shape)
    if groups > 1:  # [.., n, ..] -> [.., groups, n / groups, ..]
        view = local.view(local_shape[:dim] + [groups, local_shape[dim] // groups] + local_shape[dim + 1 :])
        shape = shape[:dim] + [groups, shape[dim] // groups] + shape[dim + 1 :]
        offsets = [0] * len(shape)
        offsets[dim + 1] = tp_rank * view.shape[dim + 1]
        return StoredForm(tuple(shape), tuple(offsets), view, tp_size > 1)
    offsets = [0] * len(shape)
    offsets[dim] = tp_rank * local_shape[dim]
    view = local
    if spec.real_rows is not None:
        if dim != 0:
            raise ValueError("real_rows is only supported for a split along dim 0")
        keep = max(0, min(local_shape[0], spec.real_rows - offsets[0]))
        view, shape[0] = local[:keep], spec.real_rows
        if keep == 0:
            offsets[0] = 0
    return StoredForm(tuple(shape), tuple(offsets), view, tp_size > 1)


def expert_stored_form(
    local: torch.Tensor, spec: ExpertParam, *, ep_rank: int, ep: int, etp_rank: int = 0, etp: int = 1
) -> StoredForm:
    """The stored form of a rank's stacked experts ``local`` (``[E / ep, *expert shard]``)."""
    one = stored_form(torch.empty(local.shape[1:], device="meta"), spec.expert, etp_rank, etp)
    view = local.view(local.shape[0], *one.local.shape)
    return StoredForm(
        (spec.num_experts, *one.global_shape), (ep_rank * local.shape[0], *one.offsets), view, ep * etp > 1
    )


def to_checkpoint_value(form: StoredForm, tp: AxisGroup, global_rank: int):
    """What goes into the ``torch.distributed.checkpoint`` state dict for one tensor: a plain
    tensor when nothing is split, else a ``ShardedTensor`` over ``tp``, the group whose ranks hold
    its pieces (tp, or for experts ep; a collective over it: every rank of it must call this for
    the same tensors in the same order)."""
    if not form.sharded:
        return form.local
    shards = []
    if form.local.numel() > 0:
        md = ShardMetadata(
            list(form.offsets),
            list(form.local.shape),
            f"rank:{global_rank}/cpu" if form.local.device.type == "cpu" else f"rank:{global_rank}/{form.local.device}",
        )
        shards.append(Shard(form.local, md))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        return init_from_local_shards(shards, list(form.global_shape), process_group=tp.group)
