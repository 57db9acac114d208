"""What a pipeline rank holds for backward at each point of its schedule, counted from the
schedule's own order of computes (:data:`ptdp.layout.pipeline.schedule.SPLIT_ORDERS`, the orders
:func:`~ptdp.layout.pipeline.schedule.build_schedule` adds the transfers to), per model chunk:
the microbatches whose forward ran and whose B (or whole backward) has not, which keep their
activations, and those whose B ran and whose W has not, which keep what their W needs.

A point is taken after each forward and after each B: between them the counts only fall. Under
F = B = W this gives the papers' peaks on rank 0: 1F1B and ZB-H1 p microbatches, ZB-H2 2p - 1
(Qi et al., arXiv:2401.10241, §2), ZB-V 2p chunks of half the layers each (arXiv:2405.15362),
DualPipeV 2p + 1 chunks (DeepSeek-V3, arXiv:2412.19437, the DualPipe repository's table).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from ptdp.layout.pipeline.schedule import SPLIT_ORDERS, check_schedule_args

Point = tuple[tuple[int, ...], tuple[int, ...]]
"""(per chunk: microbatches from forward to B, microbatches from B to W)."""


@lru_cache(maxsize=4096)
def held_points(kind: str, pp: int, num_microbatches: int, virtual_stages: int, pp_rank: int) -> tuple[Point, ...]:
    """The points of rank ``pp_rank``'s ``kind`` schedule (one of
    :data:`~ptdp.layout.pipeline.schedule.SPLIT_ORDERS`; see the module docstring) that no other
    point holds at least as much of everywhere, in order of first appearance. Raises ValueError
    for sizes the kind cannot run with."""
    if kind not in SPLIT_ORDERS:
        raise ValueError(f"schedule {kind!r} does not run B and W apart; expected one of {tuple(SPLIT_ORDERS)}")
    check_schedule_args(kind, pp, num_microbatches, virtual_stages)
    v = virtual_stages
    full, pending = [0] * v, [0] * v
    seen: dict[Point, None] = {}
    for step, _, chunk in SPLIT_ORDERS[kind](pp, num_microbatches, pp_rank):
        if step == "forward":
            full[chunk] += 1
        elif step == "backward":
            full[chunk] -= 1
        elif step == "backward_input":
            full[chunk] -= 1
            pending[chunk] += 1
        else:  # backward_weight
            pending[chunk] -= 1
        if step in ("forward", "backward_input"):
            seen.setdefault((tuple(full), tuple(pending)))
    kept: list[tuple[tuple[int, ...], Point]] = []  # the largest totals first: only they can cover
    for counts, point in sorted(((f + w, (f, w)) for f, w in seen), key=lambda x: -sum(x[0])):
        if not any(_below(counts, other) for other, _ in kept):
            kept.append((counts, point))
    order = list(seen)
    return tuple(sorted((point for _, point in kept), key=order.index)) or (((0,) * v, (0,) * v),)


def _below(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """``a`` is at most ``b`` everywhere and differs: never the larger held with weights >= 0."""
    return a != b and all(x <= y for x, y in zip(a, b))


def peak_held(points: Sequence[Point], full: Sequence[float], pending: Sequence[float]) -> float:
    """The most a rank holds at one of its ``points``: the largest sum over chunks of ``full[c]``
    per microbatch from forward to B and ``pending[c]`` per microbatch from B to W (bytes, or any
    unit)."""
    return max(sum(n * x for n, x in zip(f, full)) + sum(n * x for n, x in zip(w, pending)) for f, w in points)
