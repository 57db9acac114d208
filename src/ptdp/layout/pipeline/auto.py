"""The ``auto`` schedule: the automatic scheduling heuristic of Qi et al., "Zero Bubble Pipeline
Parallelism" (arXiv:2401.10241, §3.1), built from measured F, B, W and p2p times and a memory limit
(pure, no torch; one chunk per rank).

The ranks' passes are placed in simulated time (a pass starts when its rank is free and its input
has arrived, the p2p time added between ranks), each rank deciding when it falls free:

1. Warm-up: forwards while the memory limit allows and the first B has not arrived; a forward that
   would delay that B is run or not by a switch (``fill_warmup``).
2. Then a forward and a B in turn. While the one due has not arrived, a W runs when the wait is at
   least W long, or, by a second switch (``fill_small_gaps``), whatever the wait; a W also runs
   when the memory limit stops the forward due.
3. With no forward or B left, the Ws left one by one.

Memory: a microbatch's activations count from its forward to its W (a B keeps what its W needs),
at most ``memory_limit`` microbatches per rank. The four settings of the two switches are tried and
the schedule with the shortest longest span kept (the paper's grid search).
"""

from __future__ import annotations

import heapq
import itertools
import math

from ptdp.layout.pipeline.timing import StageTimes

Order = list[tuple[str, int, int]]


def auto_orders(p: int, m: int, times: StageTimes, memory_limit: int) -> list[Order]:
    """Each rank's order (see the module docstring). Raises ValueError for a memory limit < 1."""
    if memory_limit < 1:
        raise ValueError(f"the auto schedule's memory limit is {memory_limit} microbatches; it must be >= 1")
    best: tuple[float, list[Order]] | None = None
    for fill_warmup, fill_small_gaps in itertools.product((False, True), repeat=2):
        span, orders = _greedy(p, m, times, memory_limit, fill_warmup, fill_small_gaps)
        if best is None or span < best[0] - 1e-9:
            best = (span, orders)
    assert best is not None
    return best[1]


def _greedy(p: int, m: int, t: StageTimes, limit: int, fill_warmup: bool, fill_small_gaps: bool):
    """One run of the heuristic: (the longest span, each rank's order)."""
    F, B, W = "forward", "backward_input", "backward_weight"
    took = {F: t.forward, B: t.backward_input, W: t.backward_weight}
    end: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, rank) -> end time
    done = [{F: 0, B: 0, W: 0} for _ in range(p)]
    due = [F] * p  # after warm-up: a forward and a B in turn
    orders: list[Order] = [[] for _ in range(p)]
    first = [0.0] * p
    queue = [(0.0, r, r, 0) for r in range(p)]  # (time, sequence, rank, its version)
    version, waiting, seq = [0] * p, set(), p

    def arrival(kind: str, r: int) -> float | None:
        """When rank r's next pass of ``kind`` has its input (None: not known yet)."""
        k = done[r][kind]
        if kind == F and r == 0:
            return 0.0
        source = (F, k, r - 1) if kind == F else (F, k, r) if r == p - 1 else (B, k, r + 1)
        if source not in end:
            return None
        return end[source] + (t.p2p if source[2] != r else 0.0)

    def ready(at: float | None, now: float) -> bool:
        return at is not None and at <= now

    while queue:
        now, _, r, v = heapq.heappop(queue)
        if v != version[r]:
            continue
        f, b, w = done[r][F], done[r][B], done[r][W]
        if w == m:
            continue
        can_f = f < m and f - w < limit
        at_f = arrival(F, r) if can_f else None
        at_b = arrival(B, r) if b < f else None
        choice = None
        if f == m and b == m:
            choice = W
        elif b == 0:  # warm-up: forwards until the first B arrives
            expected = at_b if at_b is not None else now + t.backward_input + t.p2p
            if ready(at_b, now):
                choice = B
            elif ready(at_f, now) and (fill_warmup or now + t.forward <= expected):
                choice = F
        elif due[r] == F and ready(at_f, now):
            choice = F
        elif ready(at_b, now):
            choice = B
        elif due[r] == F and not can_f and f < m and w < b:
            choice = W  # the memory limit stops the forward: recycle
        if choice is None and b > 0 and w < b:
            wanted = [x for x in (at_f if due[r] == F else None, at_b) if x is not None]
            gap = min(wanted) - now if wanted else math.inf
            if gap >= t.backward_weight or fill_small_gaps:
                choice = W
        seq += 1
        if choice is None:  # wait: until its next known arrival or another rank's next pass
            waiting.add(r)
            later = [x for x in (at_f, at_b) if x is not None and x > now]
            if later:
                heapq.heappush(queue, (min(later), seq, r, version[r]))
            continue
        waiting.discard(r)
        for q in waiting:  # a new pass: the waiting ranks decide again
            version[q] += 1
            heapq.heappush(queue, (now, seq, q, version[q]))
        waiting.clear()
        k = done[r][choice]
        if not orders[r]:
            first[r] = now
        orders[r].append((choice, k, 0))
        end[(choice, k, r)] = now + took[choice]
        done[r][choice] += 1
        if choice == B:
            due[r] = F
        elif choice == F and b > 0:
            due[r] = B
        heapq.heappush(queue, (now + took[choice], seq, r, version[r]))
    if any(done[r][W] < m for r in range(p)):
        raise ValueError(f"the auto schedule is stuck: ranks {sorted(waiting)} wait for each other")
    span = max(end[(W, m - 1, r)] - first[r] for r in range(p))
    return span, orders
