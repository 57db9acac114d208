"""ptdp's pipeline runtime side by side with PyTorch's own (``torch.distributed.pipelining``).

The model is a stack of identical pre-LayerNorm MLP blocks (``x + fc2(gelu(fc1(ln(x))))``, hidden
h, inner 4h) between an input lift (``[b, s]`` floats -> ``[b, s, h]``, a ``Linear(1, h)``) and an
output head (``Linear(h, 1)`` -> ``[b, s]``), trained with the mean squared error against
``[b, s]`` targets. Every rank builds the whole model from one seed and keeps its pieces, so ptdp
and PyTorch run the *same module objects* with the same stage split: stage k of P virtual stages
holds blocks [k L / P, (k + 1) L / P), stage 0 also the lift, the last stage also the head.
Virtual stage ``c * pp + r`` lives on rank ``r`` in both libraries.

- ptdp: ``run_schedule(build_programs(kind, pp, m, v)[rank], chunks, microbatches, ...)``; the last
  chunk returns the loss (the runtime backpropagates ``loss / m``).
- PyTorch: ``PipelineStage`` (static shapes given) + ``ScheduleGPipe`` / ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B`` with ``loss_fn = mse_loss`` (gradients scaled by 1/m, the default);
  ``schedule.step(x, target=y, losses=[...], return_outputs=False)`` splits the batch into the
  same m microbatches.

A step is forward + backward over all m microbatches, no optimizer. Before timing, one step of each
checks that both give the same per-microbatch losses and the same gradients (``torch.testing.
assert_close``; the script exits non-zero if they differ). Then steps alternate (ptdp, torch),
(torch, ptdp), ... (all ranks released by a barrier, step time = slowest rank); the report gives
the medians and ptdp / torch per schedule (target <= 1.0).

    python benchmarks/bench_vs_torch_pipelining.py            # pp=2, 8 blocks, h=256
    python benchmarks/bench_vs_torch_pipelining.py --pp 4
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import pipeline_common as pc
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining

from ptdp.engine.pipeline.runtime import run_schedule
from ptdp.layout.pipeline.program import build_programs

SCHEDULES = (
    ("gpipe", 1, "ScheduleGPipe"),
    ("1f1b", 1, "Schedule1F1B"),
    ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B"),
)


class Block(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))`` on ``[b, s, h]``."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Lift(nn.Module):
    """``[b, s]`` -> ``[b, s, h]``."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.proj = nn.Linear(1, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.unsqueeze(-1))


class Head(nn.Module):
    """``[b, s, h]`` -> ``[b, s]``."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.proj = nn.Linear(h, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).squeeze(-1)


def build_stages(h: int, num_blocks: int, num_stages: int, seed: int = 0) -> list[nn.Sequential]:
    """The whole model (same weights on every rank) cut into ``num_stages`` consecutive stages."""
    torch.manual_seed(seed)
    lift, blocks, head = Lift(h), [Block(h) for _ in range(num_blocks)], Head(h)
    per = num_blocks // num_stages
    if per * num_stages != num_blocks:
        raise ValueError(f"{num_blocks} blocks do not split evenly into {num_stages} stages")
    stages = [nn.Sequential(*blocks[k * per : (k + 1) * per]) for k in range(num_stages)]
    stages[0].insert(0, lift)
    stages[-1].append(head)
    return stages


class PtdpChunk(nn.Module):
    """ptdp's runtime contract around a stage: ``chunk(x, labels)``; the last returns the loss."""

    def __init__(self, stage: nn.Module, last: bool) -> None:
        super().__init__()
        self.stage, self.last = stage, last

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        out = self.stage(x)
        return F.mse_loss(out, labels) if self.last else out


def worker(pp_size: int, h: int, num_blocks: int, b: int, s: int, m: int, steps: int, warmup: int) -> dict:
    groups = pc.init_pipeline(pp_size)
    results = []
    try:
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(m * b, s, generator=gen), torch.randn(m * b, s, generator=gen)
        for kind, v, torch_name in SCHEDULES:
            results.append(_compare(groups, kind, v, torch_name, h, num_blocks, b, s, m, x, y, steps, warmup))
    finally:
        torch.distributed.destroy_process_group()
    return {"results": results}


def _compare(groups, kind, v, torch_name, h, num_blocks, b, s, m, x, y, steps, warmup) -> dict:
    p, r = groups.pp.size, groups.pp.rank
    num_stages = p * v
    stages = build_stages(h, num_blocks, num_stages)
    mine = [stages[c * p + r] for c in range(v)]  # chunk c of rank r = virtual stage c * p + r
    params = [q for st in mine for q in st.parameters()]
    chunks = [PtdpChunk(st, last=c * p + r == num_stages - 1) for c, st in enumerate(mine)]
    schedule = build_programs(kind, p, m, v)[r]
    microbatches = list(zip(x.split(b), y.split(b)))

    def ptdp_step() -> list[torch.Tensor]:
        return run_schedule(
            schedule,
            chunks,
            microbatches,
            pp=groups.pp,
            hidden_shape=(b, s, h),
            dtype=torch.float32,
            device=torch.device("cpu"),
        )

    row = {"schedule": kind, "torch_schedule": torch_name, "v": v, "num_stages": num_stages}
    try:
        torch_schedule = _torch_schedule(torch_name, mine, groups, r, p, v, b, s, h, m)
    except Exception as e:
        torch_schedule, row["torch_error"] = None, f"construction: {type(e).__name__}: {e}"

    def torch_step() -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        is_first = r == 0
        torch_schedule.step(*((x,) if is_first else ()), target=y, losses=losses, return_outputs=False)
        return losses

    ptdp_losses, ptdp_grads = _one_step(ptdp_step, params)
    local = None
    if torch_schedule is not None:
        try:
            torch_losses, torch_grads = _one_step(torch_step, params)
            local = _local_equivalence(ptdp_losses, torch_losses, ptdp_grads, torch_grads)
        except Exception as e:
            row["torch_error"] = f"step: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    # every rank learns whether torch ran everywhere before any further collective
    errors = [e for e in pc.all_gather_object(row.get("torch_error"), groups.world) if e]
    if errors:
        row["torch_error"], torch_schedule = errors[0], None
    else:
        row.update(_equivalence(local, ptdp_losses, groups))
    fns = {"ptdp": ptdp_step} | ({"torch": torch_step} if torch_schedule is not None else {})
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + steps):
        order = list(fns.items()) if i % 2 == 0 else list(fns.items())[::-1]  # who goes first alternates
        for name, fn in order:
            _zero(params)
            elapsed = pc.timed_step(fn, groups.world)
            if i >= warmup:
                times[name].append(elapsed)
    row["median_step_s"] = {name: pc.median(t) for name, t in times.items()}
    row["steps_s"] = times
    if "torch" in times:
        row["ratio_ptdp_over_torch"] = row["median_step_s"]["ptdp"] / row["median_step_s"]["torch"]
    return row


def _torch_schedule(name, mine, groups, r, p, v, b, s, h, m):
    """PyTorch's stages (static shapes, no metadata inference) and schedule for this rank."""
    num_stages = p * v
    torch_stages = []
    for c, module in enumerate(mine):
        k = c * p + r
        # requires_grad on the examples matters: a static output example without it makes the
        # stage skip receiving its gradient (backward then fails with "grad can be implicitly
        # created only for scalar outputs").
        inp = torch.empty(b, s) if k == 0 else torch.empty(b, s, h, requires_grad=True)
        out = torch.empty(b, s, requires_grad=True) if k == num_stages - 1 else torch.empty(b, s, h, requires_grad=True)
        torch_stages.append(
            pipelining.PipelineStage(
                module, k, num_stages, torch.device("cpu"), input_args=inp, output_args=out, group=groups.pp.group
            )
        )
    cls = getattr(pipelining, name)
    if v == 1:
        return cls(torch_stages[0], n_microbatches=m, loss_fn=F.mse_loss)
    return cls(torch_stages, n_microbatches=m, loss_fn=F.mse_loss)


def _zero(params: list[torch.Tensor]) -> None:
    for q in params:
        q.grad = None


def _one_step(fn, params):
    _zero(params)
    losses = [t.detach().clone() for t in fn()]
    grads = [q.grad.detach().clone() if q.grad is not None else None for q in params]
    _zero(params)
    return losses, grads


def _local_equivalence(ptdp_losses, torch_losses, ptdp_grads, torch_grads) -> tuple:
    """(same?, mismatch message, largest loss difference, largest relative gradient difference)
    on this rank; ``assert_close`` with its float32 default tolerances."""
    ok, detail = True, ""
    try:
        torch.testing.assert_close(
            torch.stack(ptdp_losses) if ptdp_losses else torch.empty(0),
            torch.stack(torch_losses) if torch_losses else torch.empty(0),
        )
        for a, c in zip(ptdp_grads, torch_grads, strict=True):
            torch.testing.assert_close(a, c)
    except AssertionError as e:
        ok, detail = False, str(e)
    loss_diff = max((abs(a - c).item() for a, c in zip(ptdp_losses, torch_losses)), default=0.0)
    grad_diff = max(
        (((a - c).abs().max() / c.abs().max().clamp_min(1e-30)).item() for a, c in zip(ptdp_grads, torch_grads)),
        default=0.0,
    )
    return ok, detail, loss_diff, grad_diff


def _equivalence(local: tuple, ptdp_losses, groups) -> dict:
    """The per-rank checks of :func:`_local_equivalence`, combined over the world."""
    per_rank = pc.all_gather_object((*local, [t.item() for t in ptdp_losses]), groups.world)
    losses = [x for rank in per_rank for x in rank[4]]
    return {
        "same_losses_and_grads": all(x[0] for x in per_rank),
        "mismatch": [x[1] for x in per_rank if x[1]],
        "max_abs_loss_diff": max(x[2] for x in per_rank),
        "max_rel_grad_diff": max(x[3] for x in per_rank),
        "mean_loss": sum(losses) / len(losses),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="timed steps of each library per schedule")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    start = time.perf_counter()
    out = pc.launch(
        worker,
        args.pp,
        args.pp,
        args.hidden,
        args.blocks,
        args.micro_batch_size,
        args.seq,
        args.microbatches,
        args.steps,
        args.warmup,
    )
    results = out["results"]
    report = {
        "benchmark": "vs_torch_pipelining",
        "machine": pc.machine(),
        "pp": args.pp,
        "model": {"blocks": args.blocks, "hidden": args.hidden, "ffn": 4 * args.hidden},
        "batch": {"micro": args.micro_batch_size, "seq": args.seq, "microbatches": args.microbatches},
        "steps": args.steps,
        "warmup": args.warmup,
        "results": results,
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2))
    rows = []
    for r in results:
        med = r["median_step_s"]
        rows.append(
            [
                r["schedule"],
                r["torch_schedule"],
                r["num_stages"],
                f"{med['ptdp']:.3f}",
                f"{med['torch']:.3f}" if "torch" in med else "-",
                f"**{r['ratio_ptdp_over_torch']:.3f}**" if "ratio_ptdp_over_torch" in r else "-",
                r.get("same_losses_and_grads", "-"),
                f"{r['max_rel_grad_diff']:.1e}" if "max_rel_grad_diff" in r else "-",
                r.get("torch_error", "").splitlines()[0] if r.get("torch_error") else "",
            ]
        )
    print()
    print(
        pc.table(
            [
                "ptdp schedule",
                "torch schedule",
                "virtual stages",
                "ptdp s/step",
                "torch s/step",
                "ptdp / torch",
                "same loss & grads",
                "max rel grad diff",
                "torch error",
            ],
            rows,
        )
    )
    if any(r.get("same_losses_and_grads") is False for r in results):
        raise SystemExit("ptdp and torch.distributed.pipelining computed different losses or gradients")


if __name__ == "__main__":
    main()
