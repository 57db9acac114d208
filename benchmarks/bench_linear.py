"""One linear layer, forward + backward: ptdp's ``linear`` (``ptdp.engine.tensor_parallel.linear``)
against ``torch.nn.functional.linear``, side by side in one process, eager and compiled.

Each case is ``x [T, h] -> [T, h]`` with a bias (``--tokens``, ``--hidden``, ``--dtype``); one call
is the forward and the backward for an output gradient drawn once (the input, weight and bias
gradients). Variants:

- ``F.linear``: autograd's weight gradient into ``weight.grad`` (a new tensor each call).
- ``ptdp``: ``linear(x, w, b)`` for a weight without ``main_grad`` (ptdp hands it to ``F.linear``).
- ``ptdp main_grad``: a weight with a float32 ``main_grad``, the path training takes: eager, the
  autograd function with explicit dgrad and wgrad GEMMs adding the weight gradient into
  ``main_grad`` (16-bit: a 16-bit GEMM added into float32 on the CPU); compiled, ptdp's linear is
  ``F.linear`` and a post-accumulate hook adds ``weight.grad`` into ``main_grad`` as ptdp's
  gradient buffer does.
- ``fp8 RECIPE`` (eager, for information; ``--fp8-recipes``): the FP8 path in the hybrid format,
  emulated as on every CPU, the weight quantised at every call (one microbatch per step).

Calls rotate over the variants (noise hits all alike): median seconds per call after the warm-up
(compiled: the first call compiles), and the ratio to ``F.linear`` in the same mode. Before timing,
each variant's output and three gradients are compared with ``F.linear``'s (largest difference
relative to the largest value): exit 1 when a non-FP8 variant differs (above 0).

    python benchmarks/bench_linear.py                      # T 2048, h 512 and 1024, float32 and bfloat16
    python benchmarks/bench_linear.py --json
    python benchmarks/bench_linear.py --tokens 64 --hidden 32 --reps 2 --modes eager
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpu_report import Budget, alternating_medians

from ptdp.engine.eager import prepare_for_compile
from ptdp.engine.fp8 import RECIPES, FP8Recipe
from ptdp.engine.fp8_layout import whole
from ptdp.engine.tensor_parallel.linear import FP8Settings, LinearPlan, end_fp8_step, linear

MODES = ("eager", "compile")
BASELINE = "F.linear"
CPU = torch.device("cpu")


def _main_grad_hook(param: torch.Tensor) -> None:
    """What ptdp's gradient buffer does with a gradient autograd accumulated for a ``main_grad`` weight."""
    if param.grad is not None:
        param.main_grad.add_(param.grad)
        param.grad = None


class Case:
    """One size and dtype: the input, the output gradient and two copies of the weight and bias,
    one plain, one with a float32 ``main_grad`` (and the hook)."""

    def __init__(self, tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(tokens, hidden, generator=g).to(dtype)
        self.grad_y = torch.randn(tokens, hidden, generator=g).to(dtype)
        w = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(dtype)
        b = (0.1 * torch.randn(hidden, generator=g)).to(dtype)
        self.plain = (w.clone().requires_grad_(), b.clone().requires_grad_())
        self.main = (w.clone().requires_grad_(), b.clone().requires_grad_())
        for p in self.main:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.register_post_accumulate_grad_hook(_main_grad_hook)

    def reset(self) -> None:
        for p in (*self.plain, *self.main):
            p.grad = None
        for p in self.main:
            p.main_grad.zero_()


def _forward_fns(case: Case, recipes: list[str]) -> dict[str, tuple[Callable, tuple[torch.Tensor, torch.Tensor]]]:
    """Each variant's ``x -> y`` and the weight and bias it reads (module docstring)."""
    w, b = case.plain
    wm, bm = case.main
    h = w.shape[0]
    fns: dict[str, tuple[Callable, tuple[torch.Tensor, torch.Tensor]]] = {
        BASELINE: (lambda x: F.linear(x, w, b), case.plain),
        "ptdp": (lambda x: linear(x, w, b), case.plain),
        "ptdp main_grad": (lambda x: linear(x, wm, bm), case.main),
    }
    for recipe in recipes:
        gemms = FP8Settings(FP8Recipe(format="hybrid", recipe=recipe)).gemms(whole(h), whole(h), "bench")
        plan = LinearPlan(fp8=gemms)

        def fp8(x, plan=plan, gemms=gemms):
            end_fp8_step([gemms], [])  # a new step: the weight quantised again
            return linear(x, wm, bm, plan)

        fns[f"fp8 {recipe}"] = (fp8, case.main)
    return fns


def _call(forward: Callable, case: Case) -> Callable[[], None]:
    """One forward + backward of ``forward`` (a new leaf input each call)."""

    def run() -> None:
        x = case.x.detach().requires_grad_()
        forward(x).backward(case.grad_y)
        for p in case.plain:
            p.grad = None

    return run


def _results(forward: Callable, params, case: Case) -> list[torch.Tensor]:
    """``y``, the input, weight and bias gradients of one call from zero gradients, in float32."""
    case.reset()
    x = case.x.detach().requires_grad_()
    y = forward(x)
    y.backward(case.grad_y)
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad for p in params]
    out = [t.detach().float().clone() for t in (y, x.grad, *grads)]
    case.reset()
    return out


def _rel_diff(a: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Largest difference of the tensors relative to the largest value of each reference."""
    return max(float((x - r).abs().max() / r.abs().max().clamp_min(1e-30)) for x, r in zip(a, ref))


def run_case(tokens: int, hidden: int, dtype: str, mode: str, args: argparse.Namespace) -> list[dict]:
    """The rows of one case in one mode: every variant's median seconds, ratio and difference."""
    case = Case(tokens, hidden, getattr(torch, dtype))
    fns = _forward_fns(case, args.fp8_recipes if mode == "eager" else [])
    if mode == "compile":
        torch._dynamo.reset()
        prepare_for_compile()
        fns = {name: (torch.compile(fn, dynamic=False), p) for name, (fn, p) in fns.items()}
    reference = _results(*fns[BASELINE], case)  # compiled: compiles the forward and backward
    diffs = {name: _rel_diff(_results(fn, params, case), reference) for name, (fn, params) in fns.items()}
    medians, timed = alternating_medians(
        [_call(fn, case) for fn, _ in fns.values()], CPU, args.reps, Budget(float("inf")), max(1, args.warmup)
    )
    base = medians[0]
    flops = 3 * 2 * tokens * hidden * hidden
    return [
        {
            "mode": mode,
            "tokens": tokens,
            "hidden": hidden,
            "dtype": dtype,
            "variant": name,
            "reps": timed,
            "median_s": s,
            "ratio_vs_F_linear": s / base,
            "gflops": flops / s / 1e9,
            "max_rel_diff_vs_F_linear": diffs[name],
        }
        for name, s in zip(fns, medians)
    ]


def failures(rows: list[dict]) -> list[str]:
    """Variants other than FP8 whose results differ from ``F.linear``'s."""
    return [
        f"{r['mode']} T {r['tokens']} h {r['hidden']} {r['dtype']}: {r['variant']} differs from F.linear by "
        f"{r['max_rel_diff_vs_F_linear']:.2e}"
        for r in rows
        if not r["variant"].startswith("fp8") and r["max_rel_diff_vs_F_linear"] > 0
    ]


def format_rows(rows: list[dict]) -> str:
    lines = [
        f"{'mode':<8} {'T':>5} {'h':>5} {'dtype':<9} {'variant':<15} {'ms/call':>9} {'vs F.linear':>11} "
        f"{'GFLOP/s':>8} {'max rel diff':>12}"
    ]
    for r in rows:
        lines.append(
            f"{r['mode']:<8} {r['tokens']:>5} {r['hidden']:>5} {r['dtype']:<9} {r['variant']:<15} "
            f"{1e3 * r['median_s']:>9.3f} {r['ratio_vs_F_linear']:>11.3f} {r['gflops']:>8.1f} "
            f"{r['max_rel_diff_vs_F_linear']:>12.2e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--dtype", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--fp8-recipes", nargs="*", choices=RECIPES, default=["tensorwise", "rowwise"])
    ap.add_argument("--reps", type=int, default=20, help="timed calls of each variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for mode in args.modes:
        for dtype in args.dtype:
            for tokens in args.tokens:
                for hidden in args.hidden:
                    rows += run_case(tokens, hidden, dtype, mode, args)
    bad = failures(rows)
    if args.json:
        print(
            json.dumps({"torch": torch.__version__, "threads": args.threads, "rows": rows, "failures": bad}, indent=2)
        )
    else:
        print(
            f"linear forward + backward, x [T, h] -> [T, h] with bias; torch {torch.__version__}, "
            f"{platform.processor() or platform.machine()}, {args.threads} thread(s); medians of {args.reps} calls"
        )
        print(format_rows(rows))
        for line in bad:
            print(f"FAILED {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
