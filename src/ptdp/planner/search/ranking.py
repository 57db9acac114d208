"""Fitting plans ranked fastest first, some timed only when the ranking reaches them.

A layout whose pipeline schedule runs B and W apart is timed by simulating its program
(:func:`~ptdp.planner.time.pipeline_bubble.step_bubble`), the costliest part of a search. The
search keeps it as :class:`Pending`: a lower bound of its step time (the same time with
:func:`~ptdp.planner.time.pipeline_bubble.bubble_floor` for its bubble) and the call that times
it. :class:`RankedPlans` times a pending plan only when no plan ranked before it is left unknown,
so it lists the same plans in the same order as timing every one first: by step time, ties in the
order the search found them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from ptdp.planner.candidate import Plan


@dataclass(frozen=True)
class Pending:
    """A fitting plan not timed yet: ``bound`` seconds, at most its step time; ``timed()`` the plan."""

    bound: float
    timed: Callable[[], Plan]


def fastest(pending: Sequence[Pending]) -> Plan:
    """The fastest of ``pending`` (the first of equals), timing only those whose bound is below
    the fastest step timed so far."""
    best: Plan | None = None
    for item in pending:
        if best is not None and item.bound > best.need_time().step:
            continue
        plan = item.timed()
        if best is None or plan.need_time().step < best.need_time().step:
            best = plan
    if best is None:
        raise ValueError("no plan to time")
    return best


class RankedPlans(Sequence[Plan]):
    """Plans fastest first (step time, then the order given), from timed plans and
    :class:`Pending` ones; a pending plan is timed when the ranking reaches its bound. Indexing,
    slicing, iteration and ``+`` with a list give timed plans; ``len`` counts them all untimed."""

    def __init__(self, items: Iterable[Plan | Pending]) -> None:
        self._heap: list[tuple[float, int, Plan | Pending]] = [
            (item.bound if isinstance(item, Pending) else item.need_time().step, i, item)
            for i, item in enumerate(items)
        ]
        self._size = len(self._heap)
        heapq.heapify(self._heap)
        self._ranked: list[Plan] = []

    def _rank(self, count: int) -> None:
        """Rank the first ``count`` plans (all of them when ``count`` is larger)."""
        heap = self._heap
        while len(self._ranked) < count and heap:
            _, i, item = heapq.heappop(heap)
            if isinstance(item, Pending):
                plan = item.timed()
                heapq.heappush(heap, (plan.need_time().step, i, plan))
            else:
                self._ranked.append(item)

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> Plan: ...

    @overload
    def __getitem__(self, index: slice) -> list[Plan]: ...

    def __getitem__(self, index: int | slice) -> Plan | list[Plan]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._size)
            self._rank(stop if step > 0 else self._size)
            return self._ranked[index]
        position = index + self._size if index < 0 else index
        if not 0 <= position < self._size:
            raise IndexError("plan index out of range")
        self._rank(position + 1)
        return self._ranked[position]

    def __iter__(self) -> Iterator[Plan]:
        for position in range(self._size):
            self._rank(position + 1)
            yield self._ranked[position]

    def __add__(self, other: list[Plan]) -> list[Plan]:
        return list(self) + list(other)

    def __radd__(self, other: list[Plan]) -> list[Plan]:
        return list(other) + list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, RankedPlans)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RankedPlans({len(self._ranked)} of {self._size} ranked)"
