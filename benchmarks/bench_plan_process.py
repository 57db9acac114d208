"""``ptdp plan`` as the process a user starts: the search for the 1T-parameter GPT of Narayanan et
al. SC21 Table 1 on 3,072 A100s (``--case gpt-1t``) or for DeepSeek-V3 on 2,048 H100s with ep and
etp searched (``--case deepseek-v3``), against a bare interpreter start beside it.

Each repeat runs, alternating, ``python -c pass`` and ``python -m ptdp.cli plan`` (interpreter,
imports, search over every layout, report) and reads their user + system CPU seconds from
``RUSAGE_CHILDREN``; reported: the median and minimum of each, their ratio, and the layouts the
search evaluated (counted in a separate, untimed run).

    python benchmarks/bench_plan_process.py [--case gpt-1t|deepseek-v3] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

#: the largest model of Narayanan et al. SC21 Table 1 (1T parameters) at its published size and batch
ONE_T = [
    "--model",
    "gpt-1008b",
    "--gpus",
    "3072",
    "--gpu",
    "a100-80gb",
    "--global-batch-size",
    "3072",
    "--seq-length",
    "2048",
]

#: DeepSeek-V3 (62 layers with its MTP module, 256 experts, MLA) on 2,048 H100s, 8,192 sequences
DEEPSEEK_V3 = ["--model", "deepseek-v3", "--gpus", "2048", "--gpu", "h100", "--global-batch-size", "8192"]
CASES = {"gpt-1t": ONE_T, "deepseek-v3": DEEPSEEK_V3}

COUNT = """
import contextlib, io, sys
import ptdp.planner.request as command
searched = []
def counted(*args, **kwargs):
    result = search(*args, **kwargs)
    searched.append(result.evaluated)
    return result
search, command.search = command.search, counted
from ptdp.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    main(sys.argv[1:])
print(sum(searched))
"""


def cpu_seconds(cmd: list[str]) -> float:
    """User + system CPU seconds of a child process running ``cmd`` (which must succeed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="gpt-1t")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    flags = CASES[args.case]
    bare, plan = [], []
    for _ in range(args.repeats):
        bare.append(cpu_seconds([sys.executable, "-c", "pass"]))
        plan.append(cpu_seconds([sys.executable, "-m", "ptdp.cli", "plan", *flags]))
    layouts = int(
        subprocess.run(
            [sys.executable, "-c", COUNT, "plan", *flags], check=True, capture_output=True, text=True, timeout=300
        ).stdout.split()[-1]
    )
    result = {
        "command": "ptdp plan " + " ".join(flags),
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "layouts_evaluated": layouts,
        "plan_cpu_s": {"median": statistics.median(plan), "min": min(plan)},
        "interpreter_cpu_s": {"median": statistics.median(bare), "min": min(bare)},
        "plan_over_interpreter": statistics.median(plan) / statistics.median(bare),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['command']}: {layouts:,} layouts evaluated")
    print(f"  ptdp plan CPU s: median {result['plan_cpu_s']['median']:.3f}, min {result['plan_cpu_s']['min']:.3f}")
    print(f"  python -c pass CPU s: median {result['interpreter_cpu_s']['median']:.3f}")
    print(f"  ratio (median): {result['plan_over_interpreter']:.2f}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
