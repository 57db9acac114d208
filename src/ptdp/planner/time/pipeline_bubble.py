"""The pipeline bubble of the schedules that split the backward into B and W (zb-h1, zb-h2, zb-v,
dualpipev): the idle time of their own programs, timed by :mod:`ptdp.layout.pipeline.timing` with
one rank's F, B and W and the point-to-point time on each dependency between ranks.

Under F = B = W = t and free transfers the idle time of the longest rank is Qi et al.'s ("Zero
Bubble Pipeline Parallelism", arXiv:2401.10241; "Pipeline Parallelism with Controllable Memory",
arXiv:2405.15362): 1F1B 3 (p - 1) t, ZB-H1 (p - 1) t ((p - 1)(F + B - W) in general), ZB-H2 0 from
m = 2p, ZB-V 0 from m = 2p - 1; DualPipeV (p - 1)(F&B + B - 3W) in chunk times (DeepSeek-V3,
arXiv:2412.19437, §3.2.1), its overlapped pairs timed one pass after the other (F&B = F + B + W).
A ``ptdp train`` step waits for its last rank (the gradient norm is summed over all ranks before
the optimizer steps), so the step's bubble is the whole step's idle time (:func:`step_bubble`):
ZB-H2 and ZB-V keep the last rank's late start, (p - 1) F of one chunk, which the papers remove by
validating the optimizer step after it runs.
"""

from __future__ import annotations

from functools import lru_cache

from ptdp.layout.pipeline.placement import placement_of
from ptdp.layout.pipeline.schedule import SPLIT_ORDERS, build_schedule, check_schedule_args
from ptdp.layout.pipeline.timing import Dependencies, StageTimes, compile_steps, dependencies


def splits_backward(kind: str) -> bool:
    """Whether the schedule runs B and W apart (its bubble is :func:`step_bubble`'s)."""
    return kind in SPLIT_ORDERS


@lru_cache(maxsize=128)
def schedule_dependencies(kind: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Dependencies:
    """The computes of ``kind``'s schedule (:data:`~ptdp.layout.pipeline.schedule.SPLIT_ORDERS`,
    the orders :func:`~ptdp.layout.pipeline.schedule.build_schedule` adds the transfers to)
    compiled for timing; cached, a search times the same schedule under many layouts' times.
    Raises ValueError for sizes the kind cannot run with."""
    check_schedule_args(kind, pp, num_microbatches, virtual_stages)
    steps = [SPLIT_ORDERS[kind](pp, num_microbatches, r) for r in range(pp)]
    return compile_steps(steps, virtual_stages=virtual_stages, placement=placement_of(kind))


@lru_cache(maxsize=4096)
def step_bubble(
    kind: str, pp: int, num_microbatches: int, virtual_stages: int, times: StageTimes, *, synchronous: bool = True
) -> float:
    """Seconds one step of ``kind`` idles beyond its work, with ``times`` one rank's F, B, W (all
    its chunks) and one transfer: the last compute's end less a rank's work with ``synchronous``
    (``ptdp train``'s step), else the longest rank's own span less its work (Qi et al.'s bubble).

    From ``m = 5 pp`` microbatches on, the schedules repeat one pattern per microbatch between
    their warm-up and their drain, and the idle time grows by the same amount every ``pp``
    microbatches once the pattern has settled (a max-plus system's periodic regime): timed at
    ``b``, ``b + pp`` and ``b + 2 pp`` microbatches (``2 pp <= b < 3 pp``, ``b = m`` mod ``pp``),
    the two steps equal, it is extended to ``m``; else ``m`` is timed in full."""
    m, v = num_microbatches, virtual_stages

    def idle(n: int) -> float:
        return schedule_dependencies(kind, pp, n, v).idle(times, v, synchronous=synchronous)

    if m < 5 * pp:
        return idle(m)
    base = 2 * pp + (m - 2 * pp) % pp
    first, second, third = idle(base), idle(base + pp), idle(base + 2 * pp)
    step = third - second
    if abs(step - (second - first)) > 1e-9 * max(1.0, abs(third)):
        return idle(m)
    return third + (m - base - 2 * pp) // pp * step


def bubble_floor(pp: int, virtual_stages: int, times: StageTimes) -> float:
    """At most :func:`step_bubble` (synchronous) of any schedule on ``pp`` ranks, ``times`` on every
    rank: each rank does the same work, and the last starts no earlier than ``pp - 1`` forwards of
    a chunk and as many transfers (every compute of it waits, through its stage's forward, for the
    first stage's), so the last compute ends that much after the work of a rank."""
    return (pp - 1) * (times.forward / virtual_stages + times.p2p)


@lru_cache(maxsize=256)
def ideal_bubble(kind: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The step's idle time of any training schedule (``build_schedule``'s kinds but forward-only)
    with F = B = W and free transfers, as a fraction of its work ``m (F + B + W)``, every rank
    waiting for the last (:meth:`~ptdp.layout.pipeline.timing.Dependencies.idle`): 1F1B and GPipe
    (p - 1) / m, interleaved (p - 1) / (v m), ZB-H1 (p - 1) / (3 m), ZB-H2 (p - 1) / (3 m), ZB-V
    (p - 1) / (6 m) from m = 2p, DualPipeV (p - 1) / (6 m). Raises ValueError for sizes the kind
    cannot run with."""
    schedule = build_schedule(kind, pp, num_microbatches, virtual_stages)
    graph = dependencies(schedule, virtual_stages=virtual_stages, placement=placement_of(kind))
    return graph.idle(StageTimes(), virtual_stages) / (3 * num_microbatches)
