"""Soak run: a long ``ptdp train`` at (tp, pp, dp) = (2, 2, 2) with checkpoints, one injected worker
kill and ``--max-restarts 1``; checks that it completes, that no worker's memory grows, and what the
restart cost.

The run: a small GPT (2 layers, h=64, 4 heads, s=64, a 512-token vocabulary) on a few modules of
the standard library, ``--iters`` iterations (default 2,000), a checkpoint every
``--save-interval`` (default 100; ``--keep-last 2``), every iteration logged. Global rank 1 kills
itself with SIGKILL after iteration ``--kill-at`` (default 1,050) through the test-only hook
``PTDP_TEST_KILL_AT_ITERATION`` (``tests/helpers/faults.py``); the launcher restarts all 8
workers, which resume from the newest checkpoint.

Measured while the run goes, every ``--poll`` seconds:
- resident memory (``VmRSS`` of ``/proc/<pid>/status``) of every worker process: the launcher's
  children started by multiprocessing's spawn, labelled by attempt and pid order (which is the
  local rank order the launcher starts them in);
- the arrival time of each new ``metrics.jsonl`` line.

Memory: per worker, the samples after warm-up (the first ``--warmup`` iterations of its attempt)
must stay within 10% of their minimum (max / min - 1 <= 0.10).

Time lost to the restart = (arrival of the resumed attempt's line for the last iteration the killed
attempt logged) - (arrival of the killed attempt's line for it): the time the job needed to get back
to where it was. It splits into the recomputed iterations (count x the resumed attempt's median
step time) and the rest: detecting the death, stopping and starting the workers, process groups,
loading the checkpoint and the validation pass at the resumed iteration. Line arrival is seen to
within the polling interval.

    python benchmarks/bench_soak.py [--iters 2000 --save-interval 100 --kill-at 1050] [--json]
"""

from __future__ import annotations

import argparse
import email
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.faults import environment

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--vocab-size",
    "512",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
]
WORLD = 8  # ptdp train's default layout: tp = pp = dp = 2


def corpus(root: Path) -> Path:
    docs = root / "docs"
    docs.mkdir(exist_ok=True)
    for i, path in enumerate(sorted(Path(email.__file__).parent.glob("*.py"))[:24]):
        (docs / f"doc{i}.txt").write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    return docs


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def workers(launcher: int) -> list[int]:
    """The launcher's spawned worker processes (not multiprocessing's resource tracker)."""
    found = []
    for pid in children(launcher):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(pid)
    return found


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Watch:
    """Polls the worker processes' RSS and the new lines of metrics.jsonl."""

    def __init__(self, launcher: int, metrics: Path) -> None:
        self.launcher, self.metrics = launcher, metrics
        self.lines: list[tuple[float, dict]] = []  # (arrival time, record)
        self.first_seen: dict[int, float] = {}
        self.samples: dict[int, list[tuple[float, int]]] = {}  # pid -> [(time, rss KiB)]
        self._offset = 0
        self._partial = ""

    def poll(self) -> None:
        now = time.monotonic()
        if self.metrics.exists():
            with open(self.metrics, encoding="utf-8") as f:
                f.seek(self._offset)
                text = self._partial + f.read()
                self._offset = f.tell()
            *complete, self._partial = text.split("\n")
            self.lines += [(now, json.loads(line)) for line in complete if line]
        for pid in workers(self.launcher):
            self.first_seen.setdefault(pid, now)
            kib = rss_kib(pid)
            if kib is not None:
                self.samples.setdefault(pid, []).append((now, kib))


def run(args: argparse.Namespace, root: Path) -> dict:
    docs = corpus(root)
    env = environment(
        os.environ,
        PTDP_CACHE_DIR=str(root / "cache"),
        OMP_NUM_THREADS="1",
        PTDP_TEST_KILL_AT_ITERATION=str(args.kill_at),
    )
    out = root / "run"
    cmd = [
        sys.executable,
        "-m",
        "ptdp.cli",
        "train",
        *MODEL,
        "--train-iters",
        str(args.iters),
        "--lr-warmup-iters",
        "20",
        "--log-interval",
        "1",
        "--eval-interval",
        str(args.iters),
        "--eval-iters",
        "1",
        "--save",
        str(root / "ckpt"),
        "--save-interval",
        str(args.save_interval),
        "--keep-last",
        "2",
        "--max-restarts",
        "1",
        "--data",
        str(docs),
        "--output-dir",
        str(out),
        "--no-progress",
    ]
    log = open(root / "train.log", "w+")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    watch = Watch(proc.pid, out / "metrics.jsonl")
    try:
        while proc.poll() is None:
            if time.monotonic() - start > args.timeout:
                raise TimeoutError(f"the run took more than {args.timeout} s")
            watch.poll()
            time.sleep(args.poll)
        watch.poll()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - start
    log.seek(0)
    tail = log.read()[-3000:]
    log.close()
    return {
        "returncode": proc.returncode,
        "wall_s": wall,
        "watch": watch,
        "log_tail": tail,
        "summary": json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None,
    }


def attempts(watch: Watch) -> list[list[int]]:
    """Worker pids grouped by attempt: the first WORLD seen, then the next WORLD, ... (pid order within)."""
    pids = sorted(watch.first_seen, key=lambda p: (watch.first_seen[p], p))
    return [sorted(pids[i : i + WORLD]) for i in range(0, len(pids), WORLD)]


def warm(watch: Watch, attempt: int, warmup: int) -> float:
    """When attempt ``attempt`` logged its ``warmup``-th iteration (inf: never)."""
    events = [r for _, r in watch.lines if r.get("event") == "restart"]
    begin = 0 if attempt == 0 else events[attempt - 1]["resumed_from_iteration"] if attempt <= len(events) else None
    if begin is None:
        return float("inf")
    return min(
        (
            t
            for t, r in watch.lines
            if "loss" in r and r.get("restart", 0) == attempt and r["iteration"] >= begin + warmup
        ),
        default=float("inf"),
    )


def memory(watch: Watch, warmup: int) -> list[dict]:
    rows = []
    for a, pids in enumerate(attempts(watch)):
        since = warm(watch, a, warmup)
        for w, pid in enumerate(pids):
            after = [kib for t, kib in watch.samples.get(pid, []) if t >= since]
            if not after:
                rows.append({"attempt": a, "worker": w, "pid": pid, "samples": 0})
                continue
            rows.append(
                {
                    "attempt": a,
                    "worker": w,
                    "pid": pid,
                    "samples": len(after),
                    "first_mib": after[0] / 1024,
                    "last_mib": after[-1] / 1024,
                    "min_mib": min(after) / 1024,
                    "max_mib": max(after) / 1024,
                    "growth": max(after) / min(after) - 1,
                }
            )
    return rows


def restart_cost(watch: Watch) -> dict | None:
    first = {r["iteration"]: t for t, r in watch.lines if "loss" in r and "restart" not in r}
    second = {r["iteration"]: t for t, r in watch.lines if "loss" in r and r.get("restart") == 1}
    events = [r for _, r in watch.lines if r.get("event") == "restart"]
    if not first or not second or not events:
        return None
    last = max(first)
    resumed = events[0]["resumed_from_iteration"]
    steps = [r["step_time_s"] for _, r in watch.lines if "loss" in r and r.get("restart") == 1]
    step = statistics.median(steps)
    lost = second[last] - first[last]
    recomputed = last - resumed
    return {
        "killed_after_iteration": last,
        "resumed_from_iteration": resumed,
        "recomputed_iterations": recomputed,
        "median_step_s": step,
        "lost_s": lost,
        "recompute_s": recomputed * step,
        "overhead_s": lost - recomputed * step,
    }


def report(result: dict, args: argparse.Namespace) -> dict:
    watch = result["watch"]
    final = max((r["iteration"] for _, r in watch.lines if "loss" in r), default=0)
    rows = memory(watch, args.warmup)
    cost = restart_cost(watch)
    ok_memory = all(r["samples"] and r["growth"] <= 0.10 for r in rows)
    print(
        f"run: exit {result['returncode']}, wall {result['wall_s']:.1f} s, last iteration {final} of {args.iters}, "
        f"{len(attempts(watch))} attempt(s)"
    )
    print(f"\nresident memory per worker after {args.warmup} warm-up iterations of its attempt (MiB):")
    print(
        f"{'attempt':>7} {'worker':>6} {'pid':>7} {'samples':>7} {'first':>7} {'last':>7} {'min':>7} {'max':>7} "
        f"{'max/min-1':>9}"
    )
    for r in rows:
        if not r["samples"]:
            print(f"{r['attempt']:>7} {r['worker']:>6} {r['pid']:>7} {0:>7}  (no samples after warm-up)")
            continue
        print(
            f"{r['attempt']:>7} {r['worker']:>6} {r['pid']:>7} {r['samples']:>7} {r['first_mib']:>7.1f} "
            f"{r['last_mib']:>7.1f} {r['min_mib']:>7.1f} {r['max_mib']:>7.1f} {r['growth']:>8.1%}"
        )
    print(f"memory within 10% after warm-up on every worker: {'yes' if ok_memory else 'NO'}")
    if cost:
        print(
            f"\nrestart: killed after iteration {cost['killed_after_iteration']}, resumed from "
            f"{cost['resumed_from_iteration']}; time lost {cost['lost_s']:.1f} s = "
            f"{cost['recomputed_iterations']} recomputed iterations x {cost['median_step_s']:.3f} s "
            f"({cost['recompute_s']:.1f} s) + restart overhead {cost['overhead_s']:.1f} s"
        )
    else:
        print("\nrestart: not observed")
    return {
        "returncode": result["returncode"],
        "wall_s": result["wall_s"],
        "last_iteration": final,
        "memory": rows,
        "memory_ok": ok_memory,
        "restart": cost,
        "poll_s": args.poll,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--save-interval", type=int, default=100)
    parser.add_argument("--kill-at", type=int, default=1050)
    parser.add_argument("--warmup", type=int, default=100, help="iterations of each attempt before memory counts")
    parser.add_argument("--poll", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--timeout", type=float, default=1800, help="give up (and kill the run) after this long")
    parser.add_argument("--dir", default=None, help="a new working folder, kept (default: a temporary one, removed)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args()
    if not 0 < args.save_interval <= args.kill_at < args.iters:
        parser.error("need 0 < --save-interval <= --kill-at < --iters (a checkpoint before the kill)")
    with tempfile.TemporaryDirectory(prefix="ptdp-soak-") as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        result = run(args, root)
        out = report(result, args)
        if result["returncode"] != 0:
            print("\nthe run failed:\n" + result["log_tail"], file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=2))
    return 0 if result["returncode"] == 0 and out["last_iteration"] == args.iters and out["memory_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
