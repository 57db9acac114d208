"""Pure rank math of the experts' grid, ``etp x ep x edp x pp``, folded over the same ranks as the
dense ``tp x cp x dp x pp`` grid (Megatron-Core's parallel folding). Imports nothing from torch.

Within one pipeline stage the dense grid's ``tp cp dp`` ranks are renumbered for the experts,
expert tensor-parallel rank fastest::

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank)),  edp = tp cp dp / (etp ep)

so a stage's ranks and the pipeline groups are the same in both grids. Example, world 8, tp=2,
dp=2, pp=2, ep=2, etp=1 (edp 2)::

    rank      0  1  2  3  4  5  6  7
    ep_rank   0  1  0  1  0  1  0  1
    edp_rank  0  0  1  1  0  0  1  1
    ep groups  [0,1] [2,3] [4,5] [6,7]      edp groups [0,2] [1,3] [4,6] [5,7]

An ep group exchanges tokens (the experts of an MoE layer are split over it); an etp group splits
each expert's MLP; expert gradients are averaged over the edp group, the ranks holding the same
expert shard in one stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.layout.grid import ParallelLayout

EXPERT_AXES = ("etp", "ep", "edp", "pp")
"""The expert grid's axes, fastest-varying first."""

EXPERT_GROUPS = EXPERT_AXES + ("ep_etp",)
"""Every name :meth:`ExpertLayout.group_ranks` accepts (``ep_etp``: the ranks whose experts
together make a whole MoE layer, what the allgather dispatcher gathers over)."""


@dataclass(frozen=True)
class ExpertCoords:
    """Position of one rank in the expert grid."""

    etp_rank: int
    ep_rank: int
    edp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class ExpertLayout:
    """The expert grid of a dense ``layout`` with ``ep`` and ``etp``. Raises ValueError when
    ``etp x ep`` does not divide a stage's ``tp cp dp`` ranks (``ptdp.config.rules.moe`` gives the
    user-facing message)."""

    layout: ParallelLayout
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in ("ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.stage_size % (self.ep * self.etp):
            raise ValueError(
                f"etp x ep = {self.etp} x {self.ep} does not divide a stage's tp x cp x dp = {self.stage_size} ranks"
            )

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: ``tp cp dp``."""
        return self.layout.world_size // self.layout.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ``tp cp dp / (etp ep)``."""
        return self.stage_size // (self.ep * self.etp)

    def coords(self, rank: int) -> ExpertCoords:
        """Expert-grid position of global ``rank`` (its pp rank is the dense grid's)."""
        pp_rank, within = divmod(rank, self.stage_size)
        if not 0 <= pp_rank < self.layout.pp:
            raise ValueError(f"rank {rank} outside [0, world_size={self.layout.world_size})")
        rest, etp_rank = divmod(within, self.etp)
        edp_rank, ep_rank = divmod(rest, self.ep)
        return ExpertCoords(etp_rank=etp_rank, ep_rank=ep_rank, edp_rank=edp_rank, pp_rank=pp_rank)

    def rank(self, *, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
        """Global rank at the given expert-grid position (the inverse of :meth:`coords`)."""
        for axis, value, size in (
            ("etp", etp_rank, self.etp),
            ("ep", ep_rank, self.ep),
            ("edp", edp_rank, self.edp),
            ("pp", pp_rank, self.layout.pp),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{axis}_rank {value} outside [0, {size})")
        return etp_rank + self.etp * (ep_rank + self.ep * (edp_rank + self.edp * pp_rank))

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (:data:`EXPERT_GROUPS`), each a sorted list of global ranks; a
        rank's index in its group is its coordinate on that axis (``ep_etp``: ``etp_rank + etp x
        ep_rank``)."""
        if axis not in EXPERT_GROUPS:
            raise ValueError(f"unknown expert axis {axis!r}; expected one of {EXPERT_GROUPS}")
        varying = ("etp", "ep") if axis == "ep_etp" else (axis,)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.layout.world_size):
            c = self.coords(r)
            key = tuple(getattr(c, f"{a}_rank") for a in EXPERT_AXES if a not in varying)
            groups.setdefault(key, []).append(r)
        return sorted(groups.values())

    def local_experts(self, num_experts: int, ep_rank: int) -> range:
        """Global indices of the experts ep rank ``ep_rank`` holds: ``E / ep`` consecutive ones."""
        per = num_experts // self.ep
        return range(ep_rank * per, (ep_rank + 1) * per)
