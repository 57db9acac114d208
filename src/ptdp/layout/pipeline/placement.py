"""Where each virtual stage runs: the (pipeline rank, model chunk) of virtual stage k, for p ranks of
v chunks each (pure, no torch).

- ``looped`` (Narayanan et al. SC21, arXiv:2104.04473, §2.2): chunk c of rank r is virtual stage
  ``c p + r``; the activation leaving rank p - 1 wraps round to rank 0. Example, p = 4, v = 2:
  rank 0 holds stages 0 and 4, rank 3 stages 3 and 7.
- ``v`` (Qi et al., "Pipeline Parallelism with Controllable Memory", arXiv:2405.15362): v = 2,
  chunk 0 of rank r is stage r and chunk 1 is stage ``2p - 1 - r``, so rank 0 holds the first and
  the last stage. Example, p = 4: rank 0 holds stages 0 and 7, rank 3 stages 3 and 4. Chunk 0's
  activations go to rank r + 1, chunk 1's to rank r - 1; at rank p - 1 stage p - 1 hands its
  output to stage p on the same rank (no transfer: a hand-over, see
  :data:`ptdp.layout.pipeline.schedule.HANDOVER`).
"""

from __future__ import annotations

PLACEMENTS = ("looped", "v")
#: the schedules that run on the V placement
V_SCHEDULES = ("zb-v", "dualpipev")


def placement_of(kind: str) -> str:
    """The placement a pipeline schedule runs on."""
    return "v" if kind in V_SCHEDULES else "looped"


def virtual_stage(rank: int, chunk: int, pp_size: int, placement: str = "looped") -> int:
    """Virtual stage of model chunk ``chunk`` on pipeline rank ``rank``."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp_size - 1 - rank
    return chunk * pp_size + rank


def stage_owner(stage: int, pp_size: int, placement: str = "looped") -> tuple[int, int]:
    """``(rank, chunk)`` running virtual stage ``stage``: the inverse of :func:`virtual_stage`."""
    if placement == "v":
        return (stage, 0) if stage < pp_size else (2 * pp_size - 1 - stage, 1)
    return stage % pp_size, stage // pp_size
