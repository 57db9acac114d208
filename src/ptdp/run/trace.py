"""``ptdp train --trace``: what every rank did and when, as a Chrome trace and a PNG timeline.

Each rank's :class:`Tracer` records every forward, backward, transfer group, gradient sync and
optimizer step of the traced iterations; rank 0 gathers them into ``trace.json`` and
``timeline.png``. CPU times are wall-clock (``time.time``); on a GPU a span is a pair of CUDA events
(device time, not host queueing), read once by :meth:`Tracer.collect` and placed on the wall clock
through an anchor event.

A rank's measured bubble is its idle time inside the schedule over its compute time, ideally
(p - 1) / (v m) (Narayanan et al. SC21, §2.2).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ptdp.layout.pipeline.schedule import Action

COLORS = {
    "forward": "#1f77b4",
    "backward": "#ff7f0e",
    "backward_input": "#ffbb78",
    "backward_weight": "#d62728",
    "transfer": "#7f7f7f",
    "wait": "#e0e0e0",
    "grad_sync": "#2ca02c",
    "optimizer": "#9467bd",
}
LABELS = {
    "transfer": "send/recv group (posted and waited)",
    "wait": "wait for recv",
    "backward_input": "B (input gradient)",
    "backward_weight": "W (weight gradient)",
}
#: the schedule's computes, each timed as its own span; short names F, B (whole), Bi and W
COMPUTES = {"forward": "F", "backward": "B", "backward_input": "Bi", "backward_weight": "W"}


class _Span:
    def __init__(self, tracer: Tracer, name: str, cat: str, args: dict) -> None:
        self.tracer, self.name, self.cat, self.args = tracer, name, cat, args
        self.start = tracer.now()

    def end(self) -> None:
        self.tracer.add(self.name, self.cat, self.start, self.tracer.now(), self.args)


def _nothing() -> None:
    """The synchronisation of the wall clock: none needed."""


class Tracer:
    """Collects this rank's events (``pid`` = global rank) while ``active``.

    ``device``: a CUDA device times spans with CUDA events (module docstring), anything else with
    the wall clock. ``make_event`` and ``synchronize`` replace ``torch.cuda.Event(enable_timing=True)``
    and ``torch.cuda.synchronize`` (stand-ins run the event path on a CPU).
    """

    def __init__(
        self,
        rank: int,
        pp_rank: int,
        device: torch.device | str | None = None,
        *,
        make_event: Callable | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self.rank, self.pp_rank = rank, pp_rank
        self.events: list[dict] = []
        self.iteration = 0
        self.active = False
        cuda = device is not None and torch.device(device).type == "cuda"
        self._make_event = make_event or (partial(torch.cuda.Event, enable_timing=True) if cuda else None)
        self._synchronize: Callable[[], object] = synchronize or (
            partial(torch.cuda.synchronize, device) if cuda else _nothing
        )
        self._anchor: tuple[Any, float] | None = None  # (event, wall-clock seconds) of the first traced span's start
        self._pending: list[tuple] = []  # spans timed by events, not read yet

    def now(self):
        """A time stamp: wall-clock seconds, or a CUDA event recorded now on the current stream."""
        if self._make_event is None:
            return time.time()
        if not self.active:
            return None  # nothing is recorded outside the traced iterations
        if self._anchor is None:
            self._synchronize()
            anchor = self._make_event()
            anchor.record()
            self._anchor = (anchor, time.time())
        event = self._make_event()
        event.record()
        return event

    def add(self, name: str, cat: str, start, end, args: dict | None = None) -> None:
        """Record a span from ``start`` to ``end`` (both from :meth:`now`) if tracing is active."""
        if not self.active or start is None:
            return
        args = {"iteration": self.iteration, **(args or {})}
        if self._make_event is not None:
            self._pending.append((name, cat, start, end, args))
            return
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": self.rank,
                "tid": 0,
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": args,
            }
        )

    def collect(self) -> list[dict]:
        """Every recorded event, with the spans timed by events read (one synchronisation)."""
        if self._pending:
            if self._anchor is None:  # now() records it before the first event-timed span
                raise RuntimeError("event-timed spans without the anchor event")
            self._synchronize()
            anchor, wall = self._anchor
            for name, cat, start, end, args in self._pending:
                ts = wall * 1e6 + anchor.elapsed_time(start) * 1e3  # elapsed_time is in ms
                self.events.append(
                    {
                        "name": name,
                        "cat": cat,
                        "ph": "X",
                        "pid": self.rank,
                        "tid": 0,
                        "ts": ts,
                        "dur": start.elapsed_time(end) * 1e3,
                        "args": args,
                    }
                )
            self._pending = []
        return self.events

    def span(self, step: list[Action] | str, cat: str | None = None) -> _Span:
        """Start timing a schedule step (a compute action or a batch of transfers) or a phase."""
        if isinstance(step, str):
            return _Span(self, step, cat or step, {})
        first = step[0]
        if first.kind in COMPUTES:
            return _Span(
                self,
                f"{COMPUTES[first.kind]}{first.microbatch}.{first.chunk}",
                first.kind,
                {"microbatch": first.microbatch, "chunk": first.chunk},
            )
        name = " + ".join(f"{a.kind} {a.microbatch}.{a.chunk}" for a in step)
        return _Span(self, name, "transfer", {})


def bubble_by_rank(events: list[dict]) -> dict[int, float]:
    """Per rank: idle / compute time inside the pipeline schedules of the traced iterations."""
    out = {}
    for rank in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == rank]
        busy = idle = 0.0
        for it in sorted({e["args"]["iteration"] for e in mine}):
            sched = [e for e in mine if e["args"]["iteration"] == it and e["cat"] in (*COMPUTES, "transfer", "wait")]
            if not sched:
                continue
            span = max(e["ts"] + e["dur"] for e in sched) - min(e["ts"] for e in sched)
            compute = sum(e["dur"] for e in sched if e["cat"] in COMPUTES)
            busy += compute
            idle += span - compute
        out[rank] = idle / busy if busy else 0.0
    return out


def write_trace(events: list[dict], run_dir: Path, labels: dict[int, str]) -> None:
    """``trace.json`` (Chrome trace) and ``timeline.png`` in ``run_dir``."""
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": label}} for r, label in labels.items()]
    (run_dir / "trace.json").write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
    _draw(events, run_dir / "timeline.png", labels)


def _draw(events: list[dict], path: Path, labels: dict[int, str]) -> None:
    """One row per rank; forwards and backwards labelled with their microbatch (and chunk when
    interleaved); each traced iteration's start marked by a dashed line and its number; the
    legend below the rows, never over them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        return
    origin = min(e["ts"] for e in events)
    ranks = sorted(labels)
    width_ms = (max(e["ts"] + e["dur"] for e in events) - origin) / 1e3
    fig, ax = plt.subplots(figsize=(14, 0.55 * len(ranks) + 2.2))
    chunks = max((e["args"].get("chunk", 0) for e in events), default=0) > 0
    for row, rank in enumerate(ranks):
        mine = [e for e in events if e["pid"] == rank]
        for cat, color in COLORS.items():
            bars = [((e["ts"] - origin) / 1e3, e["dur"] / 1e3) for e in mine if e["cat"] == cat]
            if bars:
                ax.broken_barh(
                    bars, (row - 0.4, 0.8), facecolors=color, label=LABELS.get(cat, cat) if row == 0 else None
                )
        for e in mine:  # microbatch numbers where the bar is wide enough to hold them
            if e["cat"] in COMPUTES and e["dur"] / 1e3 > width_ms / 300:
                text = f"{e['args']['microbatch']}" + (f".{e['args']['chunk']}" if chunks else "")
                ax.text(
                    (e["ts"] - origin + e["dur"] / 2) / 1e3,
                    row,
                    text,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                    clip_on=True,
                )
    starts: dict[int, float] = {}
    for e in events:
        it = e["args"]["iteration"]
        starts[it] = min(starts.get(it, e["ts"]), e["ts"])
    for it, ts in sorted(starts.items()):
        x = (ts - origin) / 1e3
        ax.axvline(x, color="k", ls="--", lw=0.8)
        ax.text(x, -0.65, f" iteration {it}", fontsize=7, va="bottom", ha="left")
    ax.set_yticks(range(len(ranks)), [labels[r] for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.9)
    ax.set_xlabel(
        "ms from the first traced event (numbers: microbatch" + (".chunk" if chunks else "") + "; white: idle)"
    )
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 0.3 / max(1, len(ranks))),
        fontsize=8,
        ncol=len(COLORS),
        frameon=False,
    )
    ax.set_title("ptdp pipeline timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
