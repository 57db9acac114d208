"""Pure rank math for the tp x cp x dp x pp grid. Imports nothing from torch.distributed.

Ranks are ordered ``tp-cp-dp-pp``, tensor-parallel rank fastest, pipeline rank slowest::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a tp group is consecutive ranks (one node, NVLink) and pipeline stages are far apart. Example,
world 8, tp=2, dp=2, pp=2 (cp=1)::

    rank      0  1  2  3  4  5  6  7
    tp_rank   0  1  0  1  0  1  0  1
    dp_rank   0  0  1  1  0  0  1  1
    pp_rank   0  0  0  0  1  1  1  1
    tp groups  [0,1] [2,3] [4,5] [6,7]      dp groups  [0,2] [1,3] [4,6] [5,7]
    pp groups  [0,4] [1,5] [2,6] [3,7]      embedding  = the pp groups (first and last stage)

With cp=2 (world 16, tp=2, cp=2, dp=2, pp=2) the cp groups are [0,2] [1,3] ..., dp groups [0,4]
[1,5] ..., pp groups [0,8] [1,9] .... Gradients are reduced over the ``dp_cp`` group (same tp_rank
and pp_rank, e.g. [0,2,4,6]), where a rank's index is ``cp_rank + cp * dp_rank``.

Source: Narayanan et al., SC21 (arXiv:2104.04473), §3; the cp axis sits next to tp as in
Megatron-Core's grid.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("tp", "cp", "dp", "pp")
"""The grid's axes, fastest-varying first."""

GROUPS = AXES + ("dp_cp",)
"""Every name :meth:`ParallelLayout.group_ranks` accepts."""


@dataclass(frozen=True)
class Coords:
    """Position of one rank in the grid."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of the four parallel axes; ``world_size = tp * cp * dp * pp``.

    ``cp`` comes last so that ``ParallelLayout(tp, pp, dp)`` keeps its meaning. Sizes are positive
    integers; 1 means the axis is not used. Raises ``ValueError`` for a non-positive size
    (``ConfigError`` in ``ptdp.config`` gives the user-facing checks).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis} size must be a positive integer, got {size!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int) -> Coords:
        """Grid position of global ``rank``; raises ``ValueError`` outside ``[0, world_size)``."""
        self._check_rank(rank)
        rest, tp_rank = divmod(rank, self.tp)
        rest, cp_rank = divmod(rest, self.cp)
        pp_rank, dp_rank = divmod(rest, self.dp)
        return Coords(tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, cp_rank=cp_rank)

    def rank(self, *, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """Global rank at the given grid position (the inverse of :meth:`coords`)."""
        for axis, value in (("tp", tp_rank), ("cp", cp_rank), ("dp", dp_rank), ("pp", pp_rank)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(f"{axis}_rank {value} outside [0, {getattr(self, axis)})")
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` ("tp", "cp", "dp", "pp" or "dp_cp"), each a sorted list of
        global ranks.

        The groups of one axis partition the world; a rank's index inside its group equals its
        coordinate on that axis (for "dp_cp", the ranks sharing tp_rank and pp_rank, it is
        ``cp_rank + cp * dp_rank``).
        """
        if axis not in GROUPS:
            raise ValueError(f"unknown axis {axis!r}; expected one of {GROUPS}")
        varying = ("cp", "dp") if axis == "dp_cp" else (axis,)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(getattr(c, f"{a}_rank") for a in AXES if a not in varying)
            groups.setdefault(key, []).append(r)
        return sorted(groups.values())

    def embedding_group_ranks(self) -> list[list[int]]:
        """Groups of (first stage, last stage) ranks holding the two copies of a tied embedding:
        the two ends of each pipeline, with the same tp, cp and dp ranks.

        Empty when pp == 1 (the one stage holds the only copy).
        """
        if self.pp == 1:
            return []
        return [[g[0], g[-1]] for g in self.group_ranks("pp")]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={self.world_size})")
