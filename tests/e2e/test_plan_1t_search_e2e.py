"""A full ``ptdp plan`` search for a 1T-parameter GPT on 3,072 GPUs, as a process: no torch, a
bounded number of layouts, each evaluated once."""

from __future__ import annotations

from helpers.bench_scripts import import_scripts
from helpers.cli import in_subprocess

COUNT = """
import contextlib, io, sys
import ptdp.planner.request as command
results = []
def counted(*args, **kwargs):
    result = search(*args, **kwargs)
    results.append(result)
    return result
search, command.search = command.search, counted
from ptdp.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
layouts = [p.layout for r in results for p in [*r.plans, *(plan for plan, _ in r.rejected)]]
print("exit", code)
print("torch imported:", "torch" in sys.modules)
print("evaluated:", sum(r.evaluated for r in results), "distinct:", len(set(layouts)), "fitting:", sum(len(r.plans) for r in results))
"""

#: the layouts the 1T search may evaluate: every (tp, cp, pp, dp, v, schedule, micro-batch,
#: recompute, sharding) it tries is counted, whatever the machine's speed (the CPU time is a
#: benchmark: benchmarks/bench_plan_process.py); the zero-bubble schedules add about a quarter
MAX_LAYOUTS = 13_000


def test_one_trillion_parameter_search_is_bounded_and_imports_no_torch(tmp_path, monkeypatch):
    """The 1T / 3,072-GPU search as a process: no torch, each layout evaluated once, at most
    MAX_LAYOUTS of them, and some fit."""
    (bench,) = import_scripts(monkeypatch, "bench_plan_process")  # the search its benchmark times
    out = in_subprocess(["plan", *bench.ONE_T], tmp_path, COUNT)
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert "exit 0" in out and lines["torch imported"] == "False", out
    counts = lines["evaluated"].split()
    evaluated, distinct, fitting = int(counts[0]), int(counts[2]), int(counts[4])
    assert 0 < fitting <= evaluated == distinct <= MAX_LAYOUTS, out
