"""``ptdp train --profile``: a ``torch.profiler`` trace of a few steps, and each rank's peak memory.

The ranks of ``--profile-ranks`` profile the 0-based steps ``[--profile-step-start,
--profile-step-end)`` (Megatron-LM's flags and defaults: steps 10 and 11 of rank 0), CPU always and
CUDA on a GPU, each step marked ``ptdp iteration N``, into ``profile/rank<r>.json`` (Chrome trace).
One warm-up step of ``torch.profiler.schedule`` precedes them.

:func:`peak_memory_bytes`: on a GPU ``torch.cuda.max_memory_allocated``; on a CPU ``VmHWM`` of
``/proc/self/status`` (``ru_maxrss`` would carry over the forking launcher's peak), ``getrusage``
where there is no ``/proc``.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule


def peak_memory_bytes(device: torch.device | str) -> tuple[int, str]:
    """This process's peak memory in bytes and what it measures (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    return process_peak_rss(), "peak RSS"


def process_peak_rss() -> int:
    """This process's peak resident set size in bytes: ``VmHWM`` (Linux), else ``ru_maxrss``; the
    highest value read so far in this process. Linux counts resident pages approximately (per-CPU
    counters), so ``VmHWM`` read twice can fall by a page: a peak so far never does."""
    _HIGHEST[0] = max(_HIGHEST[0], _read_peak_rss())
    return _HIGHEST[0]


#: the highest peak :func:`process_peak_rss` has read in this process
_HIGHEST = [0]


def _read_peak_rss() -> int:
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class StepProfiler:
    """Runs ``torch.profiler`` around the configured steps on a profiled rank.

    ``around(step)`` is a context manager for 0-based ``step``. The profiler starts one step before
    ``start`` when there is one (a warm-up step whose events are discarded, so the profiler's own
    start-up is not in the trace), records steps ``start .. end - 1``, each marked, and after step
    ``end - 1`` writes the trace and stops.
    """

    def __init__(
        self,
        *,
        rank: int,
        ranks: tuple[int, ...],
        start: int,
        end: int,
        run_dir: Path,
        device: torch.device | str,
        first_step: int = 0,
    ) -> None:
        self.start, self.end = max(start, first_step), end  # a resumed run profiles what is left
        self.ranks, self.first_step = tuple(sorted(set(ranks))), first_step
        self.enabled = rank in ranks and self.start < end
        self.first = max(self.start - 1, first_step)  # the warm-up step, when this run has one
        self.path = Path(run_dir) / "profile" / f"rank{rank}.json"
        self.cuda = torch.device(device).type == "cuda"
        self._prof: profile | None = None
        self.written: Path | None = None

    @contextlib.contextmanager
    def around(self, step: int):
        if not self.enabled or not self.first <= step < self.end:
            yield
            return
        if self._prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            plan = schedule(wait=0, warmup=self.start - self.first, active=self.end - self.start, repeat=1)
            self._prof = profile(activities=activities, record_shapes=True, schedule=plan, on_trace_ready=self._write)
            self._prof.start()
        prof = self._prof
        with record_function(f"ptdp iteration {step + 1}"):
            yield
        if step == self.end - 1 and self.cuda:
            torch.cuda.synchronize()  # the profiled steps' kernels have run (the steps do not wait for them)
        prof.step()  # after the last profiled step this calls _write
        if step == self.end - 1:
            prof.stop()
            self._prof = None

    def _write(self, prof) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self.written = self.path

    @classmethod
    def for_run(cls, config, rank: int, run_dir: Path, device: torch.device | str, first_step: int = 0) -> StepProfiler:
        """The profiler of a run's ``config.train`` (``--profile``, its steps and ranks) on global
        ``rank``, for a run whose first step is ``first_step`` (0-based; > 0 when it resumed)."""
        t = config.train
        return cls(
            rank=rank,
            ranks=t.profile_ranks if t.profile else (),
            start=t.profile_step_start,
            end=t.profile_step_end,
            run_dir=run_dir,
            device=device,
            first_step=first_step,
        )

    def summary(self) -> dict | None:
        """What the run summary says of ``--profile`` (None without it): the iterations profiled
        (1-based, first and last; none when the run resumed after them) and the files written by
        the profiled ranks (the same on every rank)."""
        if not self.ranks:
            return None
        if self.start >= self.end:
            return {
                "iterations": [],
                "files": [],
                "note": f"nothing profiled: the run resumed at iteration {self.first_step}, after "
                f"--profile-step-end {self.end}",
            }
        return {"iterations": [self.start + 1, self.end], "files": [f"profile/rank{r}.json" for r in self.ranks]}
