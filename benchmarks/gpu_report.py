"""The GPU check's stage reports (a JSON file rewritten after every result), its time budget and timing.

A stage (``gpu_check.py STAGE``) writes ``<output dir>/gpu_check_<stage>.json`` as soon as it
starts and again after each result it gets (a row, a timed step, a probe), each time to a
temporary file renamed over the report (``os.replace``: a reader, or a kill mid-write, sees the
old or the new report, never half of one). ``"complete"`` is false until the stage ends, so a
stage killed from outside (its command's time limit) leaves what it had measured, marked
unfinished. The budget is in seconds of wall time from the stage's start; the stage checks it
before each item and each timed step and stops when the next one would not fit.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

NOT_ON_CPU = "not applicable on cpu"
"""The ``status`` of a measurement that exists on CUDA only, in a report of a CPU run."""


class Budget:
    """``seconds`` of wall time from ``start`` (``time.perf_counter()``; default now)."""

    def __init__(self, seconds: float, start: float | None = None) -> None:
        self.seconds = seconds
        self.start = time.perf_counter() if start is None else start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds left (negative once spent)."""
        return self.seconds - self.elapsed()

    def allows(self, seconds: float) -> bool:
        """Whether ``seconds`` more fit in what is left."""
        return self.left() >= seconds


def report_path(output_dir: str | Path, stage: str) -> Path:
    """Where stage ``stage`` writes its report."""
    return Path(output_dir) / f"gpu_check_{stage}.json"


def write_json(path: Path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, atomically (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


class StageReport:
    """A stage's report, written to ``path`` at once and again on every :meth:`update`.

    Keys set here: ``stage``, ``complete``, ``budget_s``, ``elapsed_s``, ``budget_exhausted``,
    ``notes``, ``failures``, and the run's description (:func:`run_header`)."""

    def __init__(self, path: Path, stage: str, budget: Budget, header: dict) -> None:
        self.path, self.budget = path, budget
        self.data: dict = {
            "stage": stage,
            "complete": False,
            "budget_s": budget.seconds,
            "elapsed_s": 0.0,
            "budget_exhausted": False,
            **header,
            "notes": [],
            "failures": [],
        }
        self.write()

    def update(self, **values) -> None:
        """Set ``values`` and rewrite the file."""
        self.data.update(values)
        self.write()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.write()

    def fail(self, text: str) -> None:
        self.data["failures"].append(text)
        self.write()

    def out_of_budget(self, what: str) -> None:
        """Record that ``what`` was cut short or left out because the budget was spent."""
        self.data["budget_exhausted"] = True
        self.note(f"{what}: stopped, the stage's budget of {self.budget.seconds:g} s was spent")

    def write(self) -> None:
        self.data["elapsed_s"] = self.budget.elapsed()
        write_json(self.path, self.data)

    def finish(self) -> None:
        self.data["complete"] = True
        self.write()


def run_header(device: torch.device, dtype: str, command: list[str]) -> dict:
    """What ran where: device, machine, torch and CUDA versions, ptdp's commit, date, command."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_type": device.type,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(command),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
    }


def git_commit() -> str | None:
    """The commit of the checkout this script runs from, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def median_seconds(fn, device: torch.device, reps: int, budget: Budget, warmup: int = 1) -> tuple[float | None, int]:
    """The median seconds of ``fn()`` over up to ``reps`` calls after ``warmup`` untimed ones, and
    how many were timed (:func:`alternating_medians` of ``fn`` alone)."""
    medians, timed = alternating_medians([fn], device, reps, budget, warmup)
    return medians[0], timed


def alternating_medians(fns: list, device: torch.device, reps: int, budget: Budget, warmup: int = 1):
    """The median seconds of each of ``fns`` over up to ``reps`` rounds calling each once in turn
    (noise hits all alike), after ``warmup`` untimed rounds, and how many rounds were timed: CUDA
    events read after one synchronisation (GPU), wall clock (CPU). Stops early (at least one timed
    round) when the next round would not fit in ``budget``. Returns ``(list of median or None,
    rounds)``."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    cuda = device.type == "cuda"
    marks: list[list] = [[] for _ in fns]
    t0 = time.perf_counter()
    for i in range(reps):
        if i and not budget.allows(2 * (time.perf_counter() - t0) / i):
            break
        for fn, mine in zip(fns, marks):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                mine.append((start, end))
            else:
                t = time.perf_counter()
                fn()
                mine.append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize(device)
        times = [[s.elapsed_time(e) / 1e3 for s, e in mine] for mine in marks]
    else:
        times = marks
    return [statistics.median(t) if t else None for t in times], len(times[0])


def train_steps(
    step: Callable[[int], Any],
    run: dict,
    *,
    warmup: int,
    steps: int,
    tokens: int,
    budget: Budget,
    report: StageReport,
    what: str,
    reserve_s: float,
) -> None:
    """``step(i)`` for ``i`` in ``range(warmup + steps)`` into ``run``, the report rewritten after
    each: ``losses`` (of each step's result, read to the host: the step has ended on the device),
    ``step_s`` (wall clock, after the warm-up), ``timed_steps``, ``median_step_s`` and
    ``tokens_per_s`` (``tokens`` per step). The first step runs whatever the budget; a later one
    only when 1.5 times the last step and ``reserve_s`` fit (else ``stopped_by_budget`` and a note).
    Then ``finite`` and ``falling`` (last loss below the first; None after one step), and a
    failure of the stage when a loss is not finite or does not fall."""
    run.update(requested_steps=steps, warmup=warmup, losses=[], step_s=[], stopped_by_budget=False)
    total, last = warmup + steps, 0.0
    for i in range(total):
        if i and not budget.allows(1.5 * last + reserve_s):
            run["stopped_by_budget"] = True
            report.out_of_budget(f"{what}: training after {i} of {total} steps")
            break
        t = time.perf_counter()
        result = step(i)
        last = time.perf_counter() - t
        run["losses"].append(result.loss)
        if i >= warmup:
            run["step_s"].append(last)
        timed = run["step_s"]
        run["timed_steps"] = len(timed)
        run["median_step_s"] = statistics.median(timed) if timed else None
        run["tokens_per_s"] = tokens / run["median_step_s"] if timed else None
        report.write()
    losses = run["losses"]
    run["finite"] = all(math.isfinite(x) for x in losses)
    run["falling"] = losses[-1] < losses[0] if len(losses) > 1 else None  # None: one step, cut by the budget
    report.write()
    if not run["finite"]:
        report.fail(f"{what}: a loss is not finite: {losses}")
    elif run["falling"] is False:
        report.fail(f"{what}: the loss did not fall over {len(losses)} steps on one batch: {losses}")
