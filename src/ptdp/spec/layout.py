"""Pure rank math for the tp x pp x dp grid. Imports nothing from torch.distributed.

Ranks are ordered ``tp-dp-pp``: the tensor-parallel rank varies fastest, the pipeline rank slowest::

    rank = tp_rank + tp * dp_rank + tp * dp * pp_rank

so a tensor-parallel group is a run of consecutive ranks (inside one node, on NVLink) and pipeline
stages are far apart (across nodes). Worked example, world 8, tp=2, pp=2, dp=2::

    rank      0  1  2  3  4  5  6  7
    tp_rank   0  1  0  1  0  1  0  1
    dp_rank   0  0  1  1  0  0  1  1
    pp_rank   0  0  0  0  1  1  1  1

    tp groups  [0,1] [2,3] [4,5] [6,7]
    dp groups  [0,2] [1,3] [4,6] [5,7]
    pp groups  [0,4] [1,5] [2,6] [3,7]
    embedding  [0,4] [1,5] [2,6] [3,7]   (first and last stage of each pipeline)

Source: the ordering of Narayanan et al., SC21 (arXiv:2104.04473), §3.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("tp", "dp", "pp")


@dataclass(frozen=True)
class Coords:
    """Position of one rank in the grid."""

    tp_rank: int
    dp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of the three parallel axes; ``world_size = tp * pp * dp``.

    Sizes are positive integers; 1 means the axis is not used. Raises ``ValueError`` for a
    non-positive size (``ConfigError`` in ``ptdp.spec`` gives the user-facing checks).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis} size must be a positive integer, got {size!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> Coords:
        """Grid position of global ``rank``; raises ``ValueError`` outside ``[0, world_size)``."""
        self._check_rank(rank)
        return Coords(
            tp_rank=rank % self.tp,
            dp_rank=(rank // self.tp) % self.dp,
            pp_rank=rank // (self.tp * self.dp),
        )

    def rank(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank at the given grid position (the inverse of :meth:`coords`)."""
        for axis, value in (("tp", tp_rank), ("dp", dp_rank), ("pp", pp_rank)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(f"{axis}_rank {value} outside [0, {getattr(self, axis)})")
        return tp_rank + self.tp * dp_rank + self.tp * self.dp * pp_rank

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` ("tp", "dp" or "pp"), each a sorted list of global ranks.

        The groups of one axis partition the world; a rank's index inside its group equals its
        coordinate on that axis.
        """
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(getattr(c, f"{a}_rank") for a in AXES if a != axis)
            groups.setdefault(key, []).append(r)
        return sorted(groups.values())

    def embedding_group_ranks(self) -> list[list[int]]:
        """Groups of (first stage, last stage) ranks holding the two copies of a tied embedding.

        Empty when pp == 1 (the one stage holds the only copy).
        """
        if self.pp == 1:
            return []
        return [[g[0], g[-1]] for g in self.group_ranks("pp")]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={self.world_size})")
