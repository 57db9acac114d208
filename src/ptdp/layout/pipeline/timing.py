"""When each compute of a pipeline schedule runs, for given durations (pure, no torch).

A compute starts when its rank has finished the computes before it and its input exists: a
forward needs the previous virtual stage's forward of the microbatch, a whole backward or a B
(``backward_input``) the next stage's whole backward or B, each plus ``p2p`` when that stage is on
another rank (a hand-over on the same rank is free). A W (``backward_weight``) needs only its rank's
own B, earlier in its list. Transfers and hand-overs take no time of their own. Schedules here are
anything with per-rank lists of items with ``kind``, ``microbatch`` and ``chunk``
(:class:`ptdp.layout.pipeline.schedule.Action`).

:func:`simulate_times` runs a schedule with measured :class:`StageTimes` and gives the bubble rate
as Qi et al. define it for their Table 5 ("Zero Bubble Pipeline Parallelism", arXiv:2401.10241):
(span - m (F + B + W)) / span, span the longest time of a rank from its first operation's start to
its last one's end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ptdp.layout.pipeline.placement import virtual_stage


class Item(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def chunk(self) -> int: ...


#: (direction, microbatch, virtual stage) -> (rank, compute) making that stage's output
#: ("forward") or the gradient of its input ("backward": a whole backward or a B)
Producers = dict[tuple[str, int, int], tuple[int, Any]]


def producers(schedule: Sequence[Sequence[Item]], placement: str = "looped") -> Producers:
    """Which compute of which rank makes each stage's output and each stage's input gradient."""
    p = len(schedule)
    out: Producers = {}
    for r, acts in enumerate(schedule):
        for a in acts:
            if a.kind in ("forward", "backward", "backward_input"):
                direction = "forward" if a.kind == "forward" else "backward"
                out[(direction, a.microbatch, virtual_stage(r, a.chunk, p, placement))] = (r, a)
    return out


def input_producer(
    a: Item, r: int, p: int, stages: int, made: Producers, placement: str = "looped"
) -> tuple[int, Any] | None:
    """The compute on a neighbouring virtual stage whose output ``a`` (on rank r) needs: None for
    the first stage's forward, the last stage's backward and every W. Raises ValueError when no
    rank computes it."""
    if a.kind not in ("forward", "backward", "backward_input"):
        return None
    stage = virtual_stage(r, a.chunk, p, placement)
    source = stage - 1 if a.kind == "forward" else stage + 1
    if not 0 <= source < stages:
        return None
    key = ("forward" if a.kind == "forward" else "backward", a.microbatch, source)
    if key not in made:
        raise ValueError(f"rank {r}'s {a.kind} of microbatch {a.microbatch}, chunk {a.chunk} has no input")
    return made[key]


def compute_times(
    schedule: Sequence[Sequence[Item]],
    durations: Mapping[str, Any],
    *,
    virtual_stages: int = 1,
    placement: str = "looped",
    p2p: Any = 0,
) -> tuple[dict, dict]:
    """Start and end of every compute, keyed ``(rank, item)``, each taking ``durations[kind]``
    (items of other kinds are skipped). Raises ValueError when the computes wait on each other in a
    cycle (the schedule deadlocks whatever its transfers)."""
    p = len(schedule)
    made = producers(schedule, placement)
    computes = [[a for a in acts if a.kind in durations] for acts in schedule]
    start: dict[tuple[int, Any], Any] = {}
    end: dict[tuple[int, Any], Any] = {}
    pc, clock = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(computes[r]):
                a = computes[r][pc[r]]
                dep = input_producer(a, r, p, p * virtual_stages, made, placement)
                if dep is not None and dep not in end:
                    break
                ready = 0 if dep is None else end[dep] + (p2p if dep[0] != r else 0)
                start[(r, a)] = begin = max(clock[r], ready)
                clock[r] = end[(r, a)] = begin + durations[a.kind]
                pc[r] += 1
                progress = True
    stuck = [(r, computes[r][pc[r]]) for r in range(p) if pc[r] < len(computes[r])]
    if stuck:
        raise _cycle(stuck)
    return start, end


def _cycle(stuck: list[tuple[int, Any]]) -> ValueError:
    """The error naming where each rank waits when the computes wait on each other in a cycle."""
    return ValueError(
        "the schedule's computes wait on each other: "
        + "; ".join(f"rank {r} at {a.kind} of microbatch {a.microbatch} chunk {a.chunk}" for r, a in stuck)
    )


@dataclass(frozen=True)
class Dependencies:
    """A schedule's computes compiled once, to be timed under many durations: each compute after
    the ones it waits for (its rank's previous compute and the compute making its input), so one
    pass over them gives the times :func:`compute_times` gives. Build with :func:`dependencies`.

    Attributes:
        kinds: each compute's kind.
        before: index of the rank's previous compute (-1 for its first).
        source: index of the compute making its input (-1: none).
        remote: the source is on another rank (``p2p`` added).
        firsts, lasts: each rank's first and last compute.
        counts: per rank, its computes of each kind.
        folded: the same computes without those that wait for no other rank and that no compute
            waits for (a W): :class:`Folded`, what :meth:`idle` times.
    """

    kinds: tuple[str, ...]
    before: tuple[int, ...]
    source: tuple[int, ...]
    remote: tuple[bool, ...]
    firsts: tuple[int, ...]
    lasts: tuple[int, ...]
    counts: tuple[tuple[tuple[str, int], ...], ...]
    folded: Folded

    def ends(self, durations: Mapping[str, float], p2p: float = 0.0) -> list[float]:
        """When each compute ends (each rank starting at 0)."""
        end = [0.0] * len(self.kinds)
        took = [durations[kind] for kind in self.kinds]
        for i, (prev, src, far) in enumerate(zip(self.before, self.source, self.remote)):
            begin = end[prev] if prev >= 0 else 0.0
            if src >= 0:
                ready = end[src] + p2p if far else end[src]
                if ready > begin:
                    begin = ready
            end[i] = begin + took[i]
        return end

    def idle(self, times: StageTimes, virtual_stages: int = 1, *, synchronous: bool = True) -> float:
        """Idle seconds of the step under ``times``: with ``synchronous`` the whole step's (the
        last compute's end over all ranks, each rank's first starting at 0 at the earliest, less
        the busiest rank's work: every rank waits for the last before the next step, as a global
        gradient norm makes it), else Qi et al.'s, the longest rank's own span less its work."""
        durations = times.durations(virtual_stages)
        f = self.folded
        runs = [sum(n * durations[kind] for kind, n in sig) for sig in f.signatures]
        end = f.ends(durations, times.p2p, runs)
        busy = [sum(n * durations[kind] for kind, n in counts) for counts in self.counts]
        last = [end[i] + runs[sig] for i, sig in f.tails]
        if synchronous:
            return max(last) - max(busy)
        starts = [0.0 if i < 0 else end[i] - durations[f.kinds[i]] for i in f.heads]
        spans = [b - a for a, b in zip(starts, last)]
        r = max(range(len(spans)), key=spans.__getitem__)
        return spans[r] - busy[r]


@dataclass(frozen=True)
class Folded:
    """A :class:`Dependencies`' computes less the folded ones (no input from another compute, no
    compute waiting for their output: each starts when its rank's previous one ends), whose time
    is added to the next kept compute of their rank as a run. Indices are into the kept computes.

    Attributes:
        kinds, before, source, remote: as :class:`Dependencies`' for the kept computes.
        run: per kept compute, the index in ``signatures`` of the folded run just before it.
        signatures: the distinct runs, each as ``((kind, count), ...)`` (the first: empty).
        tails: per rank, (its last kept compute or -1, the run after it).
        heads: per rank, its first compute when kept, else -1 (it starts at 0).
    """

    kinds: tuple[str, ...]
    before: tuple[int, ...]
    source: tuple[int, ...]
    remote: tuple[bool, ...]
    run: tuple[int, ...]
    signatures: tuple[tuple[tuple[str, int], ...], ...]
    tails: tuple[tuple[int, int], ...]
    heads: tuple[int, ...]

    def ends(self, durations: Mapping[str, float], p2p: float, runs: Sequence[float]) -> list[float]:
        """When each kept compute ends, its rank's folded run before it (``runs``, seconds per
        signature) added to its previous kept compute's end; the last entry, a 0, is what index
        -1 reads."""
        n = len(self.kinds)
        end = [0.0] * (n + 1)
        took = list(map(durations.__getitem__, self.kinds))
        wait = [p2p if far else 0.0 for far in self.remote]
        pre = list(map(runs.__getitem__, self.run))
        for i, prev, src, extra, lag, t in zip(range(n), self.before, self.source, pre, wait, took):
            begin = end[prev] + extra
            ready = end[src] + lag
            end[i] = (begin if begin >= ready else ready) + t
        return end


def dependencies(
    schedule: Sequence[Sequence[Item]], *, virtual_stages: int = 1, placement: str = "looped"
) -> Dependencies:
    """``schedule``'s computes (forwards, whole backwards, Bs and Ws) as :class:`Dependencies`;
    every rank must run at least one. Raises ValueError when they wait on each other in a cycle."""
    steps = [[(a.kind, a.microbatch, a.chunk) for a in acts] for acts in schedule]
    return compile_steps(steps, virtual_stages=virtual_stages, placement=placement)


def compile_steps(
    schedule: Sequence[Sequence[tuple[str, int, int]]], *, virtual_stages: int = 1, placement: str = "looped"
) -> Dependencies:
    """:func:`dependencies` of a schedule given as ``(kind, microbatch, chunk)`` per step."""
    p = len(schedule)
    stages = p * virtual_stages
    steps_at: list[tuple[str, int, int]] = []  # each compute, rank after rank
    kinds_at: list[str] = []
    needs: list[int] = []  # the key of the output each needs (-1: none)
    made: dict[int, int] = {}  # (microbatch, stage, forward?) as one key -> the compute making it
    starts = [0]
    for r, acts in enumerate(schedule):
        for step in acts:
            kind, mb, chunk = step
            if kind not in COMPUTES:
                continue
            stage = virtual_stage(r, chunk, p, placement)
            if kind == "forward":
                made[(mb * stages + stage) * 2 + 1] = len(kinds_at)
                needs.append((mb * stages + stage - 1) * 2 + 1 if stage > 0 else -1)
            elif kind == "backward_weight":
                needs.append(-1)
            else:
                made[(mb * stages + stage) * 2] = len(kinds_at)
                needs.append((mb * stages + stage + 1) * 2 if stage + 1 < stages else -1)
            kinds_at.append(kind)
            steps_at.append(step)
        starts.append(len(kinds_at))
    rank_at = [r for r in range(p) for _ in range(starts[r + 1] - starts[r])]
    source_at = []
    for c, key in enumerate(needs):
        if key < 0:
            source_at.append(-1)
        elif key in made:
            source_at.append(made[key])
        else:
            kind, mb, chunk = steps_at[c]
            raise ValueError(f"rank {rank_at[c]}'s {kind} of microbatch {mb}, chunk {chunk} has no input")
    placed = [-1] * len(kinds_at)  # each compute's position in the order below
    order: list[int] = []
    pc = starts[:-1]
    waiting: dict[int, list[int]] = {}  # an unplaced compute -> the ranks stopped at it
    ready = list(range(p - 1, -1, -1))  # ranks to advance, a stack (each rank once per unblocking)
    while ready:
        r = ready.pop()
        c, stop = pc[r], starts[r + 1]
        while c < stop:
            dep = source_at[c]
            if dep >= 0 and placed[dep] < 0:
                waiting.setdefault(dep, []).append(r)
                break
            placed[c] = len(order)
            order.append(c)
            if c in waiting:
                ready.extend(waiting.pop(c))
            c += 1
        pc[r] = c
    stuck = [(r, Step(*steps_at[pc[r]])) for r in range(p) if pc[r] < starts[r + 1]]
    if stuck:
        raise _cycle(stuck)
    kinds = [kinds_at[c] for c in order]
    before = [placed[c - 1] if c > starts[rank_at[c]] else -1 for c in order]
    source = [placed[source_at[c]] if source_at[c] >= 0 else -1 for c in order]
    remote = [source_at[c] >= 0 and rank_at[source_at[c]] != rank_at[c] for c in order]
    ranks = [placed[starts[r] : starts[r + 1]] for r in range(p)]
    counts = tuple(
        tuple((kind, n) for kind in COMPUTES if (n := kinds_at[starts[r] : starts[r + 1]].count(kind)))
        for r in range(p)
    )
    return Dependencies(
        tuple(kinds),
        tuple(before),
        tuple(source),
        tuple(remote),
        tuple(done[0] for done in ranks),
        tuple(done[-1] for done in ranks),
        counts,
        _fold(kinds, before, source, remote, ranks),
    )


class Step(NamedTuple):
    """A compute as :func:`compile_steps` names it in its errors."""

    kind: str
    microbatch: int
    chunk: int


def _fold(
    kinds: list[str], before: list[int], source: list[int], remote: list[bool], placed: list[list[int]]
) -> Folded:
    """:class:`Folded` of the compiled computes (``placed``: each rank's computes in its order)."""
    waited = set(source)
    fold = [src < 0 and i not in waited for i, src in enumerate(source)]
    index = [-1] * len(kinds)
    keep = [i for i in range(len(kinds)) if not fold[i]]
    for k, i in enumerate(keep):
        index[i] = k
    signatures: dict[tuple[tuple[str, int], ...], int] = {(): 0}
    runs: dict[tuple[str, ...], int] = {(): 0}  # a run of folded kinds -> its signature's index

    def signature(pending: list[str]) -> int:
        run = tuple(pending)
        if run not in runs:
            sig = tuple((kind, n) for kind in COMPUTES if (n := pending.count(kind)))
            runs[run] = signatures.setdefault(sig, len(signatures))
        return runs[run]

    k_before, run = [-1] * len(keep), [0] * len(keep)
    tails, heads = [], []
    for done in placed:
        prev, pending = -1, []
        for i in done:
            if fold[i]:
                pending.append(kinds[i])
                continue
            k_before[index[i]], run[index[i]] = prev, signature(pending)
            prev, pending = index[i], []
        tails.append((prev, signature(pending)))
        heads.append(index[done[0]])
    return Folded(
        tuple(kinds[i] for i in keep),
        tuple(k_before),
        tuple(index[source[i]] if source[i] >= 0 else -1 for i in keep),
        tuple(remote[i] for i in keep),
        tuple(run),
        tuple(signatures),
        tuple(tails),
        tuple(heads),
    )


#: the computes a schedule's ranks run (transfers and hand-overs take no time)
COMPUTES = ("forward", "backward", "backward_input", "backward_weight")


@dataclass(frozen=True)
class StageTimes:
    """Times of one pipeline rank's layers for one microbatch, all its chunks together (a chunk
    takes 1/v of each): the forward F, the input gradient B, the weight gradient W, and one
    point-to-point transfer between ranks. A whole backward takes B + W."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p: float = 0.0

    def durations(self, virtual_stages: int = 1) -> dict[str, float]:
        """Each compute's time on one chunk."""
        f, b, w = (t / virtual_stages for t in (self.forward, self.backward_input, self.backward_weight))
        return {"forward": f, "backward": b + w, "backward_input": b, "backward_weight": w}


@dataclass(frozen=True)
class TimedRun:
    """A simulated step: per rank, ``(item, start, end)`` of each compute, in its order."""

    events: list[list[tuple[Any, float, float]]]

    @property
    def spans(self) -> list[float]:
        """Each rank's time from its first compute's start to its last one's end."""
        return [e[-1][2] - e[0][1] if e else 0.0 for e in self.events]

    @property
    def busy(self) -> list[float]:
        return [sum(end - start for _, start, end in e) for e in self.events]

    @property
    def makespan(self) -> float:
        return max((e[-1][2] for e in self.events if e), default=0.0)

    @property
    def bubble_rate(self) -> float:
        """(span - busy) / span of the rank with the longest span: with m microbatches each rank is
        busy m (F + B + W), which gives Qi et al.'s rate."""
        spans = self.spans
        r = max(range(len(spans)), key=spans.__getitem__)
        return (spans[r] - self.busy[r]) / spans[r] if spans[r] else 0.0


def simulate_times(
    schedule: Sequence[Sequence[Item]], times: StageTimes, *, virtual_stages: int = 1, placement: str = "looped"
) -> TimedRun:
    """Run ``schedule`` with ``times`` (see the module docstring); ValueError on a cycle."""
    start, end = compute_times(
        schedule, times.durations(virtual_stages), virtual_stages=virtual_stages, placement=placement, p2p=times.p2p
    )
    events = [[(a, start[(r, a)], end[(r, a)]) for a in acts if (r, a) in start] for r, acts in enumerate(schedule)]
    return TimedRun(events)


def bubble_formula(kind: str, p: int, m: int, v: int = 1) -> tuple[str, float | None]:
    """A schedule's bubble with F = B = W and free transfers, as a fraction of the ideal time
    m (F + B + W): its formula and value (None where it has none). GPipe and 1F1B (p - 1) / m,
    interleaved (p - 1) / (v m) (SC21, §2.2); ZB-H1 (p - 1) / (3 m), ZB-H2 0 from m = 2p, ZB-V 0
    from m = 2p - 1 (Qi et al.); DualPipeV (p - 1) / (6 m), its pairs timed one after the other."""
    if kind in ("gpipe", "1f1b", "interleaved-1f1b", "forward-only"):
        return "(p - 1) / (v m)", (p - 1) / (v * m)
    if kind == "zb-h1":
        return "(p - 1) / (3 m)", (p - 1) / (3 * m)
    if kind == "zb-h2":
        return "0 from m = 2p", 0.0 if m >= 2 * p else None
    if kind == "zb-v":
        return "0 from m = 2p - 1", 0.0 if m >= 2 * p - 1 else None
    if kind == "dualpipev":
        return "(p - 1) / (6 m)", (p - 1) / (6 * m)
    return "no closed form (built from the measured times)", None
