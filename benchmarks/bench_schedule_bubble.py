"""Pipeline bubble of ptdp's schedules, measured with synthetic stages of known duration.

Each virtual stage is a model chunk whose forward sleeps ``t_f / v`` seconds and whose backward
sleeps ``t_b / v`` (a custom autograd function), on activations of shape ``[1, 1, 8]``: the time is
spent off the CPU, so four workers on a two-core machine do not slow each other down, and what is
measured is the schedule (its order of actions, its waits on peers) plus the runtime's and gloo's
overheads. For each schedule (gpipe, 1f1b, interleaved-1f1b with v = 2) and number of microbatches
m, the step time (median over steps, slowest rank, all ranks released by a barrier) is compared
with Narayanan et al. SC21 (arXiv:2104.04473), §2.2:

    ideal step      m (t_f + t_b)
    predicted step  m (t_f + t_b) + (p - 1) (t_f + t_b) / v       bubble (p - 1) / (v m)

and with ``ptdp.layout.pipeline.verify.simulate`` (the same schedule, zero-cost communication).
Target: measured step within 5% of the predicted step.

Three more numbers locate the difference: the time actually slept per rank (``time.sleep`` wakes
late), the step with zero-length stages (the same schedule with ``t_f = t_b = 0``: runtime and
gloo costs alone, with the CPUs busy instead of idle), and one chunk's forward and backward run
alone in the launching process (no pipeline, no communication): the time each spends outside its
sleep, i.e. what the few tensor operations around the sleep cost right after the CPU sat idle
(on a shared virtual machine far more than on a busy CPU, and more after longer sleeps). The last
column simulates the schedule again with every chunk call lengthened by that solo cost. The
defaults (40 ms / 80 ms per stage) keep the run near 1.5 minutes.

    python benchmarks/bench_schedule_bubble.py
    python benchmarks/bench_schedule_bubble.py --t-f 0.02 --t-b 0.04 --microbatches 8 16 32
"""

from __future__ import annotations

import argparse
import json
import time

import pipeline_common as pc
import torch
from torch import nn

from ptdp.engine.pipeline.runtime import run_schedule
from ptdp.layout.pipeline.program import build_programs
from ptdp.layout.pipeline.schedule import build_schedule
from ptdp.layout.pipeline.verify import simulate

HIDDEN = 8
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))


def _sleep(seconds: float) -> float:
    """Sleep ``seconds`` (to a deadline, so a late wake-up is not compounded); return the time slept."""
    start = time.perf_counter()
    deadline = start + seconds
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
    return time.perf_counter() - start


class SleepFn(torch.autograd.Function):
    """Identity whose forward takes ``t_forward`` and backward ``t_backward`` seconds; adds the
    time actually slept to ``busy[0]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t_forward: float, t_backward: float, busy: list) -> torch.Tensor:
        ctx.t_backward, ctx.busy = t_backward, busy
        busy[0] += _sleep(t_forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.busy[0] += _sleep(ctx.t_backward)
        return grad, None, None, None


class SleepChunk(nn.Module):
    """One virtual stage: ``[b, s]`` inputs (first stage) or ``[b, s, h]`` activations ->
    ``[b, s, h]``, or a scalar loss on the last stage."""

    def __init__(self, t_forward: float, t_backward: float, *, first: bool, last: bool, busy: list) -> None:
        super().__init__()
        self.t_forward, self.t_backward, self.first, self.last, self.busy = t_forward, t_backward, first, last, busy
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        x = (x.unsqueeze(-1) if self.first else x) * self.weight
        y = SleepFn.apply(x, self.t_forward, self.t_backward, self.busy)
        return y.square().mean() if self.last else y


def worker(pp_size: int, t_f: float, t_b: float, microbatches: list[int], steps: int, warmup: int) -> dict:
    groups = pc.init_pipeline(pp_size)
    rank, results = groups.pp.rank, []
    try:
        for kind, v in SCHEDULES:
            for m in microbatches:
                schedule = build_schedule(kind, pp_size, m, v)
                timed = {}
                for name, (f, b) in (("sleep", (t_f, t_b)), ("empty", (0.0, 0.0))):
                    timed[name] = _time_schedule(
                        build_programs(kind, pp_size, m, v)[rank], groups, v, m, f, b, steps, warmup
                    )
                per_rank_busy = pc.gather_floats(pc.median(timed["sleep"][1]), groups.world)
                results.append(
                    _row(kind, pp_size, v, m, t_f, t_b, timed["sleep"][0], timed["empty"][0], per_rank_busy, schedule)
                )
    finally:
        torch.distributed.destroy_process_group()
    return {"results": results}


def _time_schedule(actions, groups, v: int, m: int, t_f: float, t_b: float, steps: int, warmup: int):
    """Step times (slowest rank) and this rank's time inside the chunks, per timed step."""
    p, r, busy = groups.pp.size, groups.pp.rank, [0.0]
    chunks = [
        SleepChunk(t_f / v, t_b / v, first=r == 0 and c == 0, last=r == p - 1 and c == v - 1, busy=busy)
        for c in range(v)
    ]
    mbs = [(torch.full((1, 1), float(i)), torch.zeros(1, 1)) for i in range(m)]

    def run() -> None:
        run_schedule(
            actions,
            chunks,
            mbs,
            pp=groups.pp,
            hidden_shape=(1, 1, HIDDEN),
            dtype=torch.float32,
            device=torch.device("cpu"),
        )

    times, busy_times = [], []
    for i in range(warmup + steps):
        busy[0] = 0.0
        elapsed = pc.timed_step(run, groups.world)
        if i >= warmup:
            times.append(elapsed)
            busy_times.append(busy[0])
    return times, busy_times


def _row(kind, p, v, m, t_f, t_b, times, empty_times, per_rank_busy, schedule) -> dict:
    ideal = m * (t_f + t_b)
    predicted = ideal + (p - 1) * (t_f + t_b) / v
    step = pc.median(times)
    return {
        "schedule": kind,
        "pp": p,
        "v": v,
        "m": m,
        "step_s": step,
        "step_min_s": min(times),
        "step_max_s": max(times),
        "ideal_s": ideal,
        "predicted_s": predicted,
        "simulated_s": simulate(schedule, virtual_stages=v, forward_time=t_f, backward_time=t_b).makespan,
        "bubble_measured": (step - ideal) / ideal,
        "bubble_formula": (p - 1) / (v * m),
        "rel_error_vs_predicted": (step - predicted) / predicted,
        "empty_step_s": pc.median(empty_times),
        "slept_s_per_rank": per_rank_busy,
    }


def solo_overhead(t_f: float, t_b: float, repeats: int = 6) -> dict:
    """One chunk's forward and backward in this process alone (no pipeline, no communication):
    median milliseconds each spends outside its sleep, and the median oversleep per call."""
    busy = [0.0]
    chunk = SleepChunk(t_f, t_b, first=False, last=False, busy=busy)
    fwd, bwd, late = [], [], []
    for _ in range(repeats):
        x = torch.zeros(1, 1, HIDDEN, requires_grad=True)
        busy[0] = 0.0
        start = time.perf_counter()
        y = chunk(x, None)
        mid, slept_f = time.perf_counter(), busy[0]
        torch.autograd.backward(y, grad_tensors=torch.ones_like(y))
        end = time.perf_counter()
        fwd.append((mid - start - slept_f) * 1e3)
        bwd.append((end - mid - (busy[0] - slept_f)) * 1e3)
        late.append((busy[0] - t_f - t_b) / 2 * 1e3)
    return {
        "forward_outside_sleep_ms": pc.median(fwd[1:]),
        "backward_outside_sleep_ms": pc.median(bwd[1:]),
        "oversleep_ms_per_call": pc.median(late[1:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--t-f", type=float, default=0.04, help="forward seconds of a whole stage (all chunks)")
    ap.add_argument("--t-b", type=float, default=0.08, help="backward seconds of a whole stage")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.05, help="allowed |step - predicted| / predicted")
    args = ap.parse_args()

    start = time.perf_counter()
    solo = {v: solo_overhead(args.t_f / v, args.t_b / v) for v in sorted({v for _, v in SCHEDULES})}
    out = pc.launch(worker, args.pp, args.pp, args.t_f, args.t_b, args.microbatches, args.steps, args.warmup)
    results = out["results"]
    for r in results:  # the schedule again, each chunk call lengthened by what it costs when alone
        cost = solo[r["v"]]
        extra_f = r["v"] * (cost["forward_outside_sleep_ms"] + cost["oversleep_ms_per_call"]) / 1e3
        extra_b = r["v"] * (cost["backward_outside_sleep_ms"] + cost["oversleep_ms_per_call"]) / 1e3
        schedule = build_schedule(r["schedule"], args.pp, r["m"], r["v"])
        r["simulated_with_solo_overhead_s"] = simulate(
            schedule, virtual_stages=r["v"], forward_time=args.t_f + extra_f, backward_time=args.t_b + extra_b
        ).makespan
    report = {
        "benchmark": "schedule_bubble",
        "machine": pc.machine(),
        "pp": args.pp,
        "t_f": args.t_f,
        "t_b": args.t_b,
        "steps": args.steps,
        "warmup": args.warmup,
        "target_rel_error": args.target,
        "solo_chunk_overhead_by_v": solo,
        "results": results,
        "all_within_target": all(abs(r["rel_error_vs_predicted"]) <= args.target for r in results),
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2))
    rows = [
        [
            r["schedule"],
            r["v"],
            r["m"],
            f"{r['ideal_s'] * 1e3:.0f}",
            f"{r['predicted_s'] * 1e3:.0f}",
            f"{r['simulated_s'] * 1e3:.0f}",
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['bubble_formula']:.3f}",
            f"{r['bubble_measured']:.3f}",
            f"{r['rel_error_vs_predicted'] * 100:+.2f}%",
            f"{r['empty_step_s'] * 1e3:.1f}",
            f"{max(r['slept_s_per_rank']) * 1e3:.1f}",
            f"{r['simulated_with_solo_overhead_s'] * 1e3:.1f}",
        ]
        for r in results
    ]
    print()
    print(
        pc.table(
            [
                "schedule",
                "v",
                "m",
                "ideal ms",
                "predicted ms",
                "simulated ms",
                "measured ms",
                "bubble formula",
                "bubble measured",
                "step vs predicted",
                "empty-stage step ms",
                "max slept ms/rank",
                "simulated + solo overhead ms",
            ],
            rows,
        )
    )
    for v, cost in solo.items():
        print(
            f"\none chunk alone (sleeps {args.t_f / v * 1e3:g} ms / {args.t_b / v * 1e3:g} ms, no pipeline): "
            f"{cost['forward_outside_sleep_ms']:.2f} ms outside the sleep per forward, "
            f"{cost['backward_outside_sleep_ms']:.2f} ms per backward, "
            f"oversleep {cost['oversleep_ms_per_call']:.2f} ms per call"
        )


if __name__ == "__main__":
    main()
