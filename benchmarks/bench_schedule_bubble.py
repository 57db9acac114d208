"""Pipeline bubble of ptdp's schedules, measured with synthetic stages of known duration.

Each virtual stage is a model chunk (:class:`SleepChunk`, ``y = x * weight`` on activations
``[1, 1, 8]``) whose forward sleeps F / v, whose backward sleeps B / v for the input gradient and
W / v for the weight gradient: inline (a whole backward, B + W) unless the chunk's ``wgrad_queue``
is deferring, as ptdp's runtime has it in a zero-bubble B, in which case the weight gradient
becomes a closure that the runtime's W runs. The time is spent off the CPU, so four workers on a
two-core machine do not slow each other down; what is measured is the schedule (its order, its
waits on peers) plus the runtime's and gloo's overheads. Each kind runs ptdp's own programs
(``build_programs``) through ``run_schedule``, with gloo point-to-point between ``pp`` processes
started by ptdp's launcher (one thread each, every group with a timeout).

The step time (median over steps after a warm-up step, slowest rank, all ranks released by a
barrier) is compared with the same schedule simulated by
:func:`ptdp.layout.pipeline.timing.simulate_times` (free transfers): its makespan. With F = B = W = t
(Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, §2): 1F1B and GPipe
(m + p - 1) 3t, ZB-H1 3mt + (p - 1) t. Target: measured within 5% of simulated.

Three more numbers locate a difference: the time actually slept per rank (``time.sleep`` wakes
late), the step with zero-length stages (runtime and gloo costs alone), and the schedule simulated
again with every compute lengthened by what one chunk's forward, whole backward, B and W cost
outside their sleeps when run alone in the launching process (no pipeline, no communication).

Each kind runs in its own launch.

    python benchmarks/bench_schedule_bubble.py
    python benchmarks/bench_schedule_bubble.py --kinds 1f1b zb-h1 --microbatches 8 16 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import pipeline_common as pc
import torch
from torch import nn

from ptdp.engine.comm import AxisGroup
from ptdp.engine.pipeline.runtime import run_schedule
from ptdp.engine.tensor_parallel.linear import WgradQueue
from ptdp.layout.pipeline.placement import placement_of, virtual_stage
from ptdp.layout.pipeline.program import P2PGroup, build_programs
from ptdp.layout.pipeline.schedule import COMPUTE, KINDS, build_schedule, check_schedule_args
from ptdp.layout.pipeline.timing import StageTimes, compute_times, simulate_times

HIDDEN = 8
HIDDEN_SHAPE = (1, 1, HIDDEN)
CHOICES = tuple(k for k in KINDS if k != "forward-only")
DEFAULT_KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev")
#: what a chunk counts per step: forwards, backward calls (each B, whole or not), weight gradients
#: computed inline, queued as a closure, and queued closures run
CALLS = ("forward", "backward", "wgrad_inline", "wgrad_queued", "wgrad_run")


def _sleep(seconds: float) -> float:
    """Sleep ``seconds`` (to a deadline, so a late wake-up is not compounded); the time slept."""
    if seconds <= 0:
        return 0.0
    start = time.perf_counter()
    deadline = start + seconds
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
    return time.perf_counter() - start


class _SleepMul(torch.autograd.Function):
    """``x * weight`` (``weight [h]`` over the last dim); forward sleeps the chunk's F, backward its
    B and then W for ``weight``'s gradient, or queues W to the chunk's ``wgrad_queue``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, chunk: SleepChunk) -> torch.Tensor:
        chunk.count("forward")
        chunk.sleep("forward")
        ctx.save_for_backward(x)
        ctx.chunk = chunk
        return x * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        chunk: SleepChunk = ctx.chunk
        chunk.count("backward")
        chunk.sleep("backward_input")
        grad_x = grad * chunk.weight

        def weight_grad() -> torch.Tensor:
            chunk.sleep("backward_weight")
            return (grad * x).sum(dim=tuple(range(grad.dim() - 1)))

        if not chunk.wgrad_queue.deferring:
            chunk.count("wgrad_inline")
            return grad_x, weight_grad(), None

        def job() -> None:  # W: run later by the runtime (WgradQueue.run)
            chunk.count("wgrad_run")
            g = weight_grad()
            w = chunk.weight
            w.grad = g if w.grad is None else w.grad + g

        chunk.count("wgrad_queued")
        chunk.wgrad_queue.put(job, chunk.weight)
        return grad_x, None, None


class SleepChunk(nn.Module):
    """One virtual stage: ``[b, s]`` tokens (first stage, spread to ``[b, s, h]`` as
    ``token + arange(h)``) or ``[b, s, h]`` activations -> ``x * weight``, or on the last stage the
    loss ``mean((x * weight)²)``. ``durations``: seconds of each compute on this chunk (keys of
    :meth:`StageTimes.durations`); ``slept``: the seconds actually slept; ``calls``: see
    :data:`CALLS`."""

    def __init__(self, durations: dict[str, float], weight: torch.Tensor, *, first: bool, last: bool) -> None:
        super().__init__()
        self.durations, self.first, self.last = durations, first, last
        self.weight = nn.Parameter(weight)
        self.wgrad_queue = WgradQueue()
        self.slept = 0.0
        self.calls = dict.fromkeys(CALLS, 0)

    def sleep(self, compute: str) -> None:
        self.slept += _sleep(self.durations[compute])

    def count(self, what: str) -> None:
        self.calls[what] += 1

    def reset(self) -> None:
        self.slept, self.calls = 0.0, dict.fromkeys(CALLS, 0)
        self.weight.grad = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if self.first:
            x = x.unsqueeze(-1) + torch.arange(HIDDEN, dtype=self.weight.dtype)
        y = _SleepMul.apply(x, self.weight, self)
        return y.square().mean() if self.last else y


def stage_weight(stage: int, dtype: torch.dtype) -> torch.Tensor:
    """The initial weight ``[h]`` of virtual stage ``stage`` (a different one per stage)."""
    return 1.0 + 0.01 * (stage + 1) * torch.arange(1, HIDDEN + 1, dtype=dtype)


def virtual_stages_of(kind: str, interleaved_v: int) -> int:
    """Chunks per rank of ``kind``: 2 on the V placement, ``interleaved_v`` for interleaved-1f1b."""
    if placement_of(kind) == "v":
        return 2
    return interleaved_v if kind == "interleaved-1f1b" else 1


def sleep_chunks(
    kind: str, rank: int, pp_size: int, v: int, times: StageTimes, dtype: torch.dtype = torch.float32
) -> list[SleepChunk]:
    """The ``v`` chunks of pipeline rank ``rank``, each taking 1/v of ``times``."""
    placement, stages = placement_of(kind), pp_size * v
    chunks = []
    for c in range(v):
        stage = virtual_stage(rank, c, pp_size, placement)
        weight = stage_weight(stage, dtype)
        chunks.append(SleepChunk(times.durations(v), weight, first=stage == 0, last=stage == stages - 1))
    return chunks


def microbatches(m: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``m`` microbatches ``(tokens [1, 1], labels [1, 1])``, token i + 1 in microbatch i."""
    return [(torch.full((1, 1), float(i + 1), dtype=dtype), torch.zeros(1, 1, dtype=dtype)) for i in range(m)]


def programs(kind: str, pp_size: int, m: int, v: int, times: StageTimes):
    """The runtime's programs of ``kind`` (``auto``: built from ``times``)."""
    return build_programs(kind, pp_size, m, v, times=times if kind == "auto" else None)


def expected_calls(program, v: int) -> list[dict[str, int]]:
    """Per chunk, the :data:`CALLS` counts a step of ``program`` must leave."""
    out = [dict.fromkeys(CALLS, 0) for _ in range(v)]
    for step in program:
        if isinstance(step, P2PGroup) or step.kind not in COMPUTE:
            continue
        calls = out[step.chunk]
        if step.kind == "forward":
            calls["forward"] += 1
        elif step.kind == "backward":
            calls["backward"] += 1
            calls["wgrad_inline"] += 1
        elif step.kind == "backward_input":
            calls["backward"] += 1
            calls["wgrad_queued"] += 1
        else:
            calls["wgrad_run"] += 1
    return out


def run_step(program, chunks: list[SleepChunk], mbs, pp: AxisGroup, placement: str = "looped") -> None:
    """One step of ``program``; RuntimeError unless every chunk ran exactly the program's computes."""
    for chunk in chunks:
        chunk.reset()
    run_schedule(
        program,
        chunks,
        mbs,
        pp=pp,
        hidden_shape=HIDDEN_SHAPE,
        dtype=chunks[0].weight.dtype,
        device=torch.device("cpu"),
        placement=placement,
    )
    got, want = [c.calls for c in chunks], expected_calls(program, len(chunks))
    if got != want:
        raise RuntimeError(f"pipeline rank {pp.rank}: the chunks ran {got}, the program has {want}")


def time_kind(groups, kind: str, m: int, v: int, times: StageTimes, steps: int, warmup: int) -> dict:
    """Step times (slowest rank) and this rank's seconds slept, per timed step."""
    p, r = groups.pp.size, groups.pp.rank
    program = programs(kind, p, m, v, times)[r]
    chunks = sleep_chunks(kind, r, p, v, times)
    mbs = microbatches(m)
    step_s, slept_s = [], []
    for i in range(warmup + steps):
        elapsed = pc.timed_step(lambda: run_step(program, chunks, mbs, groups.pp, placement_of(kind)), groups.world)
        if i >= warmup:
            step_s.append(elapsed)
            slept_s.append(sum(c.slept for c in chunks))
    return {"step_s": step_s, "slept_s": slept_s, "calls": [c.calls for c in chunks]}


def worker(kind: str, pp_size: int, m: int, v: int, times: StageTimes, steps: int, warmup: int) -> dict:
    """One launch: ``kind`` timed with ``times``, then with zero-length stages."""
    groups = pc.init_pipeline(pp_size)
    try:
        timed = time_kind(groups, kind, m, v, times, steps, warmup)
        empty = time_kind(groups, kind, m, v, StageTimes(0.0, 0.0, 0.0), steps, warmup)
        slept = pc.gather_floats(pc.median(timed["slept_s"]), groups.world)
        calls = pc.all_gather_object(timed["calls"], groups.world)
    finally:
        torch.distributed.destroy_process_group()
    return {"step_s": timed["step_s"], "empty_step_s": empty["step_s"], "slept_s_per_rank": slept, "calls": calls}


def simulated_s(kind: str, p: int, m: int, v: int, times: StageTimes, durations: dict | None = None) -> float:
    """The schedule's simulated makespan with ``times`` (or per-chunk ``durations``), free transfers."""
    schedule = build_schedule(kind, p, m, v, times=times if kind == "auto" else None)
    placement = placement_of(kind)
    if durations is None:
        return simulate_times(schedule, times, virtual_stages=v, placement=placement).makespan
    _, end = compute_times(schedule, durations, virtual_stages=v, placement=placement)
    return max(end.values())


def solo_overhead(durations: dict[str, float], repeats: int = 6) -> dict[str, float]:
    """One chunk run alone in this process (no pipeline, no communication), ``durations`` per
    compute: median seconds each compute spends outside its sleep (the first call left out)."""
    chunk = SleepChunk(durations, stage_weight(1, torch.float32), first=False, last=False)
    extra: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "backward_input", "backward_weight")}

    def outside(compute: str, fn):
        chunk.slept = 0.0
        start = time.perf_counter()
        out = fn()
        extra[compute].append(time.perf_counter() - start - chunk.slept)
        return out

    for _ in range(repeats):
        x = torch.zeros(HIDDEN_SHAPE, requires_grad=True)
        y = outside("forward", lambda: chunk(x, None))
        outside("backward", lambda: y.backward(torch.ones_like(y)))
        y = chunk(x, None)
        with chunk.wgrad_queue.defer():
            outside("backward_input", lambda: y.backward(torch.ones_like(y)))
        jobs = chunk.wgrad_queue.take()
        outside("backward_weight", lambda: chunk.wgrad_queue.run(jobs))
    return {k: pc.median(v[1:]) for k, v in extra.items()}


def row(kind: str, p: int, m: int, v: int, times: StageTimes, result: dict, solo: dict, target: float) -> dict:
    """One kind's line of the report: the measured step against the simulated one."""
    step = pc.median(result["step_s"])
    simulated = simulated_s(kind, p, m, v, times)
    chunk = times.durations(v)
    lengthened = {k: chunk[k] + solo[k] for k in chunk}
    return {
        "kind": kind,
        "pp": p,
        "v": v,
        "m": m,
        "ideal_s": m * (times.forward + times.backward_input + times.backward_weight),
        "simulated_s": simulated,
        "step_s": step,
        "step_min_s": min(result["step_s"]),
        "step_max_s": max(result["step_s"]),
        "ratio": step / simulated,
        "within_target": abs(step / simulated - 1) <= target,
        "empty_step_s": pc.median(result["empty_step_s"]),
        "slept_s_per_rank": result["slept_s_per_rank"],
        "simulated_with_solo_overhead_s": simulated_s(kind, p, m, v, times, lengthened),
        "calls_per_rank": result["calls"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks p (processes)")
    ap.add_argument("--microbatches", "-m", type=int, nargs="+", default=[8], help="microbatches m per step")
    ap.add_argument("--forward-ms", type=float, default=40.0, help="F: a rank's forward of one microbatch")
    ap.add_argument("--backward-input-ms", type=float, default=40.0, help="B: its input gradient")
    ap.add_argument("--backward-weight-ms", type=float, default=40.0, help="W: its weight gradient")
    ap.add_argument("--kinds", nargs="+", choices=CHOICES, default=list(DEFAULT_KINDS), metavar="KIND")
    ap.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank of interleaved-1f1b")
    ap.add_argument("--steps", type=int, default=7, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--target", type=float, default=0.05, help="allowed |measured / simulated - 1|")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    args = ap.parse_args(argv)
    problems = []
    if args.pp < 2:
        problems.append(f"--pp {args.pp}: needs at least 2 pipeline ranks")
    if min(args.forward_ms, args.backward_input_ms, args.backward_weight_ms) < 0:
        problems.append("--forward-ms, --backward-input-ms and --backward-weight-ms must be >= 0")
    if args.steps < 1 or args.warmup < 0:
        problems.append(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    for kind in args.kinds:
        for m in args.microbatches:
            try:
                check_schedule_args(kind, args.pp, m, virtual_stages_of(kind, args.virtual_stages))
            except ValueError as err:
                problems.append(f"{err} (choose others with --kinds)")
    if problems:
        ap.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    times = StageTimes(args.forward_ms / 1e3, args.backward_input_ms / 1e3, args.backward_weight_ms / 1e3)
    start = time.perf_counter()
    vs = sorted({virtual_stages_of(kind, args.virtual_stages) for kind in args.kinds})
    solo = {v: solo_overhead(times.durations(v)) for v in vs}
    results = []
    for kind in args.kinds:
        v = virtual_stages_of(kind, args.virtual_stages)
        for m in args.microbatches:
            out = pc.launch(worker, args.pp, kind, args.pp, m, v, times, args.steps, args.warmup)
            results.append(row(kind, args.pp, m, v, times, out, solo[v], args.target))
    report = {
        "benchmark": "schedule_bubble",
        "machine": pc.machine(),
        "pp": args.pp,
        "times_ms": {
            "forward": args.forward_ms,
            "backward_input": args.backward_input_ms,
            "backward_weight": args.backward_weight_ms,
        },
        "steps": args.steps,
        "warmup": args.warmup,
        "target": args.target,
        "solo_overhead_s_by_v": solo,
        "results": results,
        "all_within_target": all(r["within_target"] for r in results),
        "wall_s": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(table(results))
    for v, cost in solo.items():
        print(
            f"\none chunk alone (v = {v}; no pipeline): outside its sleep {cost['forward'] * 1e3:.2f} ms per forward, "
            f"{cost['backward'] * 1e3:.2f} ms per whole backward, {cost['backward_input'] * 1e3:.2f} ms per B, "
            f"{cost['backward_weight'] * 1e3:.2f} ms per W"
        )
    print(f"\nwall time {report['wall_s']:.0f} s")
    return 0


def table(results: list[dict]) -> str:
    rows = [
        [
            r["kind"],
            r["v"],
            r["m"],
            f"{r['ideal_s'] * 1e3:.0f}",
            f"{r['simulated_s'] * 1e3:.0f}",
            f"{r['step_s'] * 1e3:.1f}",
            f"**{r['ratio']:.3f}**",
            f"{r['empty_step_s'] * 1e3:.1f}",
            f"{max(r['slept_s_per_rank']) * 1e3:.1f}",
            f"{r['simulated_with_solo_overhead_s'] * 1e3:.1f}",
        ]
        for r in results
    ]
    headers = [
        "kind",
        "v",
        "m",
        "ideal ms",
        "simulated ms",
        "measured ms",
        "measured / simulated",
        "empty-stage step ms",
        "max slept ms/rank",
        "simulated + solo overhead ms",
    ]
    return pc.table(headers, rows)


if __name__ == "__main__":
    sys.exit(main())
