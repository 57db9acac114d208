"""The process groups of one process, built once from a :class:`~ptdp.layout.grid.ParallelLayout`.

:class:`ParallelGroups` holds this process's tp, cp, pp and dp groups, the dp x cp gradient group
and the embedding group; it is passed explicitly (there are no module-level groups).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from ptdp.engine.comm import AxisGroup, CommStats
from ptdp.layout.expert_grid import ExpertLayout
from ptdp.layout.grid import Coords, ParallelLayout


@dataclass(frozen=True, eq=False)
class ExpertGroups:
    """The expert grid's groups an MoE layer uses: ``ep`` exchanges tokens, ``etp`` splits each
    expert, ``ep_etp`` holds a whole layer's experts (the allgather dispatcher's group); and the
    ``dispatcher`` (``--moe-token-dispatcher-type``) that moves tokens over them."""

    ep: AxisGroup
    etp: AxisGroup
    ep_etp: AxisGroup
    dispatcher: str = "alltoall"

    @classmethod
    def single(cls) -> ExpertGroups:
        """Every expert on this rank (ep = etp = 1)."""
        return cls(AxisGroup.single("ep"), AxisGroup.single("etp"), AxisGroup.single("ep"))


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This process's groups along every axis.

    ``tp``, ``pp``, ``dp``, ``cp``, ``world``: groups along each axis (``AxisGroup.rank`` is this
    process's coordinate). ``dp_cp``: the gradient group, the dp x cp ranks sharing this rank's tp
    and pp ranks (index ``cp_rank + cp * dp_rank``); the ``dp`` object itself when cp == 1, else
    its own communicator counted on "dp". ``embedding``: first + last stage (size 1 when pp == 1).
    ``stats``: the counters shared by all groups. ``ep``, ``etp``, ``ep_etp`` and ``edp``: the expert
    grid's (:class:`~ptdp.layout.expert_grid.ExpertLayout`) expert-parallel and expert
    tensor-parallel groups, the ranks whose experts make a whole layer, and the group averaging the
    expert gradients, counted on "ep", "etp", "ep" and "dp"; None without ep or etp > 1.
    """

    layout: ParallelLayout
    global_rank: int
    tp: AxisGroup
    pp: AxisGroup
    dp: AxisGroup
    embedding: AxisGroup
    world: AxisGroup
    stats: CommStats
    cp: AxisGroup
    dp_cp: AxisGroup
    ep: AxisGroup | None = None
    edp: AxisGroup | None = None
    etp: AxisGroup | None = None
    ep_etp: AxisGroup | None = None

    @property
    def experts(self) -> ExpertGroups | None:
        """The MoE layers' groups; None without ep or etp > 1."""
        if self.ep is None or self.etp is None or self.ep_etp is None:
            return None
        return ExpertGroups(self.ep, self.etp, self.ep_etp)

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.global_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @classmethod
    def single_process(cls) -> ParallelGroups:
        """Groups for tp = cp = pp = dp = 1 without torch.distributed (an ordinary single process)."""
        stats = CommStats()
        one = {n: AxisGroup.single(n, 0, stats) for n in ("tp", "pp", "dp", "cp", "embedding", "world")}
        one["dp_cp"] = one["dp"]
        return cls(ParallelLayout(1, 1, 1), 0, stats=stats, **one)

    @classmethod
    def build(cls, layout: ParallelLayout, timeout: datetime.timedelta, *, ep: int = 1, etp: int = 1) -> ParallelGroups:
        """Create every group of ``layout``, and with ``ep`` or ``etp`` > 1 those of its expert grid
        (collective: all ranks of the world must call it).

        Requires ``torch.distributed`` initialised with ``world_size == layout.world_size``. Every
        group gets ``timeout`` so a stalled collective fails instead of hanging.
        """
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(f"world_size={world} != tp*cp*pp*dp = {layout.tp}*{layout.cp}*{layout.pp}*{layout.dp}")
        rank = dist.get_rank()
        stats = CommStats()
        axes = {}
        for name in ("tp", "pp", "dp", "cp"):
            axes[name] = _build_axis(name, layout.group_ranks(name), rank, timeout, stats)
        if layout.cp == 1:
            axes["dp_cp"] = axes["dp"]
        else:  # the gradient traffic of data parallelism, counted on the dp axis
            axes["dp_cp"] = _build_axis("dp", layout.group_ranks("dp_cp"), rank, timeout, stats, desc="dp_cp")
        emb = layout.embedding_group_ranks()
        if emb:
            axes["embedding"] = _build_axis("embedding", emb, rank, timeout, stats)
        else:
            axes["embedding"] = AxisGroup.single("embedding", rank, stats)
        if ep * etp > 1:
            experts = ExpertLayout(layout, ep=ep, etp=etp)
            axes["ep"] = _build_axis("ep", experts.group_ranks("ep"), rank, timeout, stats)
            axes["etp"] = _build_axis("etp", experts.group_ranks("etp"), rank, timeout, stats)
            axes["ep_etp"] = _build_axis("ep", experts.group_ranks("ep_etp"), rank, timeout, stats, desc="ep_etp")
            axes["edp"] = _build_axis("dp", experts.group_ranks("edp"), rank, timeout, stats, desc="edp")
        world_ranks = tuple(range(world))
        world_group = dist.group.WORLD if world > 1 else None
        # the default group's timeout is init_process_group's: ptdp passes the same value there
        axes["world"] = AxisGroup("world", world_ranks, rank, world_group, stats, timeout.total_seconds())
        return cls(layout, rank, stats=stats, **axes)


def _build_axis(
    name: str,
    all_groups: list[list[int]],
    rank: int,
    timeout: datetime.timedelta,
    stats: CommStats,
    desc: str | None = None,
) -> AxisGroup:
    """Create every group along one axis (all ranks call new_group for each) and keep ours; its
    calls are counted on axis ``name``; ``desc`` names the communicator (default ``name``)."""
    mine = None
    for ranks in all_groups:
        if len(ranks) == 1:
            group = None
        else:
            group = dist.new_group(ranks=ranks, timeout=timeout, group_desc=f"ptdp_{desc or name}")
        if rank in ranks:
            mine = AxisGroup(name, tuple(ranks), ranks.index(rank), group, stats, timeout.total_seconds())
    if mine is None:  # the embedding axis covers only first/last stages
        mine = AxisGroup.single(name, rank, stats)
    return mine


def host_group(timeout: datetime.timedelta, stats: CommStats | None = None) -> AxisGroup:
    """A gloo group over the whole world for CPU-side coordination (e.g. waiting while one rank
    prepares data), with its own ``timeout``. Collective: every rank must call it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    stats = stats if stats is not None else CommStats()
    if world == 1:
        return AxisGroup.single("host", rank, stats)
    group = dist.new_group(ranks=list(range(world)), timeout=timeout, backend="gloo", group_desc="ptdp_host")
    return AxisGroup("host", tuple(range(world)), rank, group, stats, timeout.total_seconds())
