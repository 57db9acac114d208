"""Mixture of experts on the CPU: a dense GPT against an MoE GPT with the same active weights per
token at expert-parallel sizes ep = 1, 2, 4; one step's ep all-to-all bytes against the formula of
docs/architecture.md; and the experts' grouped GEMM against the per-expert loop.

- Step time: 4 gloo worker processes, one thread each (ptdp's launcher, :mod:`pipeline_common`),
  on this machine's cores, at dp = 4 (tp = pp = cp = 1), float32. The dense GPT (MLP width ``F_d =
  4h``) is the baseline; the MoE GPT has every layer's MLP replaced by ``E = 8`` experts of width
  ``F_d / 2``, top-2 (:mod:`moe_common`: the same ``2 h F_d`` weights per token), its experts over
  ep = 1 (every rank holds all), 2 or 4 of the dp ranks (parallel folding: ep x edp = dp), run as
  one grouped GEMM per rank (``--moe-grouped-gemm``). The routing is the forced balanced
  assignment (``--moe-router-force-load-balancing``: every expert gets the same load on every run;
  the router's GEMM and softmax still run). All start from ptdp's initialisation (the experts'
  values do not depend on ep: the MoE variants' first-step losses must agree, relative 1e-5, or the
  script exits 1) and train on the same random tokens, each rank its quarter of the global batch.
  Steps rotate (a, b, c, d), (b, c, d, a), ... so machine noise hits all alike; step time = the
  slowest rank's after a barrier; medians after the warm-up; step time and tokens/s as ratios to
  dense.
- ep traffic: the last step of each ep > 1 variant, counted by ``ptdp.engine.comm`` on the ``ep``
  axis per tag on every rank, against docs/architecture.md (Communication of one step): per MoE
  layer and microbatch ``E`` counts (int64, ``moe_counts``), ``A h`` elements to the experts
  (``moe_dispatch``) and ``R h`` back (``moe_combine``), backward the same with the splits swapped
  (``moe_combine_grad`` ``A h``, ``moe_dispatch_grad`` ``R h``); dropless ``A = T k`` for the rank's
  ``T = b s`` tokens, and ``R`` = the assignments of the ep group's ranks to this rank's ``E / ep``
  experts (forced routing: token ``t`` to experts ``(t k + j) mod E``). Any difference exits 1.
- Grouped GEMM vs loop: :func:`moe_common.time_expert_gemms` in this process after the workers
  (one thread, float32) at a few sizes, the first the model's own.

    python benchmarks/bench_moe.py            # 4 layers, h = 256, s = 128, V = 4096, B = 32, b = 2
    python benchmarks/bench_moe.py --quick    # 2 layers, h = 64, s = 64, V = 1024, B = 16: a trial
    python benchmarks/bench_moe.py --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import pipeline_common as pc
import torch
import torch.distributed as dist
from gpu_report import Budget
from moe_common import active_weights, moe_options, time_expert_gemms

from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.layout.grid import ParallelLayout
from ptdp.run.distributed import init_distributed

DP = 4
EP_SIZES = (1, 2, 4)
NUM_EXPERTS, TOPK = 8, 2
LOSS_RTOL = 1e-5
EP_TAGS = ("moe_counts", "moe_dispatch", "moe_combine", "moe_combine_grad", "moe_dispatch_grad")
"""The ep all-to-all of an MoE layer, in the order they run (docs/architecture.md)."""
ORDER = {f"ep/all_to_all/{tag}": i for i, tag in enumerate(EP_TAGS)}
DEFAULT = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 4096}
DEFAULT |= {"micro_batch_size": 2, "global_batch_size": 32, "warmup": 3, "steps": 20, "gemm_reps": 20}
QUICK = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64, "vocab_size": 1024}
QUICK |= {"micro_batch_size": 2, "global_batch_size": 16, "warmup": 1, "steps": 3, "gemm_reps": 5}
GEMM_SIZES = [(8, 512, 1024, 1024), (32, 256, 128, 2048), (64, 256, 64, 2048)]
"""(E, h, F, tokens) timed after the model's own size (default run)."""
QUICK_GEMM_SIZES = [(32, 64, 32, 256)]
VARIANTS: dict[str, int | None] = {"dense": None} | {f"moe ep={ep}": ep for ep in EP_SIZES}
"""Variant name -> ep (None: the dense GPT)."""


def moe(args) -> MoEConfig:
    """The MoE GPT's options: E = 8 experts of width 4h / 2, top-2, grouped GEMM, forced routing."""
    return moe_options(4 * args.hidden_size, num_experts=NUM_EXPERTS, topk=TOPK, forced=True)


def make_config(args, ep: int | None) -> Config:
    """The dense GPT (``ep`` None) or the MoE GPT with its experts over ``ep`` ranks, at dp = 4."""
    par = ParallelConfig(
        data_parallel_size=DP, expert_model_parallel_size=ep or 1, distributed_timeout_minutes=pc.TIMEOUT_MINUTES
    )
    return pc.dp_gpt_config(args, par, DP, moe(args) if ep is not None else None)


def worker(args) -> dict:
    timeout = datetime.timedelta(minutes=pc.TIMEOUT_MINUTES)
    init_distributed(pc.TIMEOUT_MINUTES, threads_per_worker=1)
    groups = {ep: ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=DP), timeout, ep=ep) for ep in EP_SIZES}
    try:
        return _run(args, groups)
    finally:
        dist.destroy_process_group()


def _run(args, groups: dict[int, ParallelGroups]) -> dict:
    stages = {name: build_stage(make_config(args, ep), groups[ep or 1]) for name, ep in VARIANTS.items()}
    world, rank = groups[1].world, groups[1].dp.rank
    names = list(stages)
    first = {name: train_step(stage, pc.rank_batches(args, 0, rank, DP), 0).loss for name, stage in stages.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    last = args.warmup + args.steps
    traffic: dict[str, dict] = {}
    for i in range(1, last + 1):
        mbs = pc.rank_batches(args, i, rank, DP)
        k = i % len(names)
        for name in names[k:] + names[:k]:
            ep = VARIANTS[name]
            stats = groups[ep].stats if ep else None
            if stats is not None and i == last:
                stats.reset()
            elapsed = pc.timed_step(lambda: train_step(stages[name], mbs, i).loss, world)
            if i > args.warmup:
                times[name].append(elapsed)
            if stats is not None and i == last:
                traffic[name] = {key: c for key, c in stats.as_dict().items() if key.startswith("ep/")}
    ep_ranks = {name: groups[ep].ep.rank if ep and groups[ep].ep else 0 for name, ep in VARIANTS.items()}
    return {
        "median_step_s": {name: pc.median(t) for name, t in times.items()},
        "first_step_loss": first,
        "per_rank": pc.all_gather_object({"traffic": traffic, "ep_rank": ep_ranks}, world),
        "params": {name: sum(p.numel() for p in stage.model.parameters()) for name, stage in stages.items()},
    }


def expert_loads(tokens: int, topk: int, num_experts: int) -> list[int]:
    """Assignments per expert of one microbatch under the forced routing: assignment ``a = t k + j``
    of ``[0, T k)`` goes to expert ``a mod E``."""
    n = tokens * topk
    return [(n - e + num_experts - 1) // num_experts for e in range(num_experts)]


def expected_traffic(args, ep: int, ep_rank: int) -> dict[str, dict[str, int]]:
    """Per tag: calls, elements and bytes one rank sends on the ep axis in one step (module docstring)."""
    tokens = args.micro_batch_size * args.seq_length
    microbatches = args.global_batch_size // (args.micro_batch_size * DP)
    calls = microbatches * args.num_layers  # every layer an MoE layer
    h, local = args.hidden_size, NUM_EXPERTS // ep
    loads = expert_loads(tokens, TOPK, NUM_EXPERTS)
    sent = tokens * TOPK  # A: dropless
    received = ep * sum(loads[ep_rank * local : (ep_rank + 1) * local])  # R: the same from every ep peer
    numel = {
        "moe_counts": NUM_EXPERTS,
        "moe_dispatch": sent * h,
        "moe_combine": received * h,
        "moe_combine_grad": sent * h,
        "moe_dispatch_grad": received * h,
    }
    return {
        f"ep/all_to_all/{tag}": {
            "calls": calls,
            "numel": calls * n,
            "bytes": calls * n * (8 if tag == "moe_counts" else 4),
        }
        for tag, n in numel.items()
    }


def check_traffic(args, res: dict) -> tuple[list[dict], dict[str, dict]]:
    """One row per ep > 1 and all-to-all tag: rank 0's measured bytes, the formula's, and whether
    every rank's counts (calls, elements, bytes) equal the formula's; and per ep > 1 variant rank
    0's other ep-axis counts, which the formula leaves out."""
    rows, others = [], {}
    for name, ep in VARIANTS.items():
        if not ep or ep == 1:
            continue
        measured = [r["traffic"][name] for r in res["per_rank"]]
        expected = [expected_traffic(args, ep, r["ep_rank"][name]) for r in res["per_rank"]]
        others[name] = {k: v for k, v in measured[0].items() if "/all_to_all/" not in k}
        tags = set(expected[0]) | {k for k in measured[0] if "/all_to_all/" in k}
        for tag in sorted(tags, key=lambda t: (ORDER.get(t, len(ORDER)), t)):
            rows.append(
                {
                    "ep": ep,
                    "tag": tag.removeprefix("ep/all_to_all/"),
                    "measured_bytes": measured[0].get(tag, {}).get("bytes", 0),
                    "formula_bytes": expected[0].get(tag, {}).get("bytes", 0),
                    "agree_on_every_rank": all(m.get(tag) == e.get(tag) for m, e in zip(measured, expected)),
                }
            )
    return rows, others


def gemm_rows(args) -> list[dict]:
    tokens = args.micro_batch_size * args.seq_length
    sizes = [(NUM_EXPERTS, args.hidden_size, 4 * args.hidden_size // TOPK, tokens)]
    sizes += QUICK_GEMM_SIZES if args.quick else GEMM_SIZES
    torch.set_num_threads(1)
    budget = Budget(float("inf"))
    return [
        time_expert_gemms(
            num_experts=e,
            hidden=h,
            ffn=f,
            tokens=t,
            topk=TOPK,
            dtype=torch.float32,
            device=torch.device("cpu"),
            reps=args.gemm_reps,
            budget=budget,
        )
        for e, h, f, t in sizes
    ]


def report(args, res: dict) -> str:
    med, eps = res["median_step_s"], VARIANTS
    tokens = args.global_batch_size * args.seq_length
    rows = [
        [
            name,
            ep or "-",
            f"{res['params'][name]:,}",
            f"{med[name]:.4f}",
            f"{med[name] / med['dense']:.3f}",
            f"{tokens / med[name]:,.0f}",
            f"{med['dense'] / med[name]:.3f}",
            f"{res['first_step_loss'][name]:.6f}",
        ]
        for name, ep in eps.items()
    ]
    head = (
        f"dp = {DP} gloo workers, 1 thread each, on {pc.machine()['cores']} cores; {args.num_layers} layers, "
        f"h = {args.hidden_size}, s = {args.seq_length}, V = {args.vocab_size}, B = {args.global_batch_size}, "
        f"b = {args.micro_batch_size} ({tokens:,} tokens per step), float32; MoE: E = {NUM_EXPERTS}, top-{TOPK}, "
        f"F = {4 * args.hidden_size // TOPK} in every layer, grouped GEMM, forced balanced routing; "
        f"median of {args.steps} steps after {args.warmup} warm-up\n" + res["active_weights"]["text"]
    )
    out = [
        head,
        "",
        pc.table(
            [
                "variant",
                "ep",
                "parameters per rank",
                "step s",
                "step / dense",
                "tokens/s",
                "tokens/s / dense",
                "first-step loss",
            ],
            rows,
        ),
        "",
        "ep all-to-all bytes per rank in one step (rank 0 shown; docs/architecture.md, Communication of one step):",
        "",
        pc.table(
            ["ep", "tag", "measured bytes", "formula bytes", "equal on every rank"],
            [
                [r["ep"], r["tag"], f"{r['measured_bytes']:,}", f"{r['formula_bytes']:,}", r["agree_on_every_rank"]]
                for r in res["traffic"]
            ],
        ),
        "",
        "other ep-axis traffic of rank 0 in that step, outside the all-to-all formula: "
        + "; ".join(
            f"{name}: {k} {v['bytes']:,} B" for name, ops in res["other_ep_traffic"].items() for k, v in ops.items()
        ),
        "",
        "experts forward + backward, one process, 1 thread, float32 (first row: the model's experts):",
        "",
        pc.table(
            ["E", "h", "F", "tokens", "rows T k", "grouped ms", "loop ms", "grouped / loop", "grouped GEMM ran"],
            [
                [
                    r["num_experts"],
                    r["hidden"],
                    r["ffn"],
                    r["tokens"],
                    r["rows"],
                    f"{1e3 * r['grouped_s']:.2f}",
                    f"{1e3 * r['loop_s']:.2f}",
                    f"{r['grouped_over_loop']:.3f}",
                    r["grouped_gemm_used"],
                ]
                for r in res["gemm"]
            ],
        ),
    ]
    return "\n".join(out)


def failures(res: dict) -> list[str]:
    out = []
    losses = {n: v for n, v in res["first_step_loss"].items() if n != "dense"}
    ref = next(iter(losses.values()))
    if any(abs(v - ref) > LOSS_RTOL * abs(ref) for v in losses.values()):
        out.append(f"the MoE variants' first-step losses differ: {losses}")
    for r in res["traffic"]:
        if not r["agree_on_every_rank"]:
            out.append(f"ep={r['ep']} {r['tag']}: measured traffic differs from the formula on some rank")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a trial: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    for key, value in DEFAULT.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default {value} (--quick: {QUICK[key]})")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else DEFAULT).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for ep in (None, *EP_SIZES):  # validate before starting workers
        make_config(args, ep)
    start = time.perf_counter()
    res = pc.launch(worker, DP, args)
    res["active_weights"] = active_weights(args.hidden_size, 4 * args.hidden_size, moe(args))
    res["traffic"], res["other_ep_traffic"] = check_traffic(args, res)
    del res["per_rank"]
    res["gemm"] = gemm_rows(args)
    res["machine"] = pc.machine()
    res["wall_s"] = time.perf_counter() - start
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(report(args, res))
        print(f"\nmachine: {res['machine']}; took {res['wall_s']:.0f} s")
    problems = failures(res)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
