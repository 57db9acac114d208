"""ptdp's data-parallel engine at dp=2 (tp = pp = 1): speed against PyTorch DDP, exposed
communication with and without overlap, bytes and loss per gradient codec. One run reports all.

Two gloo worker processes on CPU (one thread each, every process group with a timeout), started
by ptdp's launcher like the other benchmarks (:mod:`pipeline_common`). Data: ptdp's own pipeline
on its default corpus (the Python standard library's ``.py`` files, byte-level BPE, cached under
``$PTDP_CACHE_DIR`` or ``~/.cache/ptdp``; prepared once before the workers start), sampled as
``ptdp train`` does: global batch t, this rank's contiguous half, ``m = B / (b * dp)``
microbatches.

1. **ptdp vs DDP.** ptdp's ``build_stage`` / ``train_step`` (overlapped bucketed reduction,
   ``--bucket-size`` elements per bucket) against ``bench_step.PlainGPT`` (same shape, weights
   copied from ptdp's) in ``torch.nn.parallel.DistributedDataParallel`` (``bucket_cap_mb`` = the
   same bucket in bytes, ``gradient_as_bucket_view=True``): ``no_sync()`` for all but the last
   microbatch, global-norm clipping, ``torch.optim.AdamW``, the global mean loss all-reduced
   (as ptdp does). Both take the same first step on the same batch and must give the same loss
   (relative 1e-4; the script exits non-zero otherwise). Then steps rotate (ptdp, ptdp without
   overlap, DDP), (ptdp without overlap, DDP, ptdp), ... so machine noise hits all alike; step
   time = slowest rank's, after a barrier. Reported: medians and ptdp / DDP (target <= 1.0).
2. **Overlap on vs off** (same rotation): ptdp's step time with ``overlap_grad_reduce`` on and
   off, and the ``"grad sync + clip"`` span of ptdp's tracer (after the schedule: wait for every
   bucket's reduction, global loss, norm and clip), median per rank, slowest rank reported. The
   difference between off and on is the communication that overlap hides.
3. **Bytes per step** for the codecs none / fp16 / bf16 / 1bit: everything counted on the dp axis
   by :mod:`ptdp.engine.comm` in the last step on each rank (1bit reduces exactly during its warmup) (input of all-reduce / reduce-scatter, own part of an
   all-gather), and the ratio to ``none``. The distributed optimizer's line counts 1.5x ``none``
   at dp=2: the reduce-scatter's whole input plus this rank's half in the parameter all-gather.
4. **Loss after ``--iters`` steps** per codec (overlap on), same weights and data (lr warmup over
   the first 10 %, cosine decay), the final training loss and the mean of the last 10 %. Sanity
   line: the distributed optimizer (ZeRO-1, codec none) for ``--distopt-iters`` steps should give
   the same losses as plain none (the largest difference is reported, not enforced).

At the defaults about 900 steps of ~0.35-0.65 s: 6 to 9 minutes on 2 cores.

    python benchmarks/bench_data_parallel.py                     # 4 layers, h=128, s=128, B=32
    python benchmarks/bench_data_parallel.py --iters 300 --json  # longer loss runs, JSON only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import statistics
import sys
import time

import pipeline_common as pc
import torch
import torch.distributed as dist
from bench_step import PlainGPT, copy_weights
from torch.nn.parallel import DistributedDataParallel

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.data.dataset import GlobalBatchSampler, TokenWindows, dp_shard, microbatches
from ptdp.data.prepared_data import PreparedData
from ptdp.engine.comm import AxisGroup, all_reduce
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.layout.grid import ParallelLayout
from ptdp.run.rundir import prepare
from ptdp.run.trace import Tracer

CODECS = ("none", "fp16", "bf16", "1bit")
TIMED = ("ptdp", "ptdp_no_overlap", "ddp")
CONSTANT_LR = {"lr": 1e-4, "min_lr": 1e-4, "lr_warmup_iters": 0, "train_iters": 10_000}
LOSS_RTOL = 1e-4


def make_config(args, vocab: int, train: dict, **parallel) -> Config:
    """The resolved config of one variant (``parallel``: ParallelConfig fields beyond the bucket)."""
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=vocab,
    )
    schedule = {
        "train_iters": args.iters,
        "lr": args.lr,
        "min_lr": args.lr / 10,
        "lr_warmup_iters": max(1, args.iters // 10),
    } | train
    train_cfg = TrainConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size, seed=args.seed, **schedule
    )
    par = ParallelConfig(ddp_bucket_size=args.bucket_size, distributed_timeout_minutes=pc.TIMEOUT_MINUTES, **parallel)
    return resolve(Config(model=model, parallel=par, train=train_cfg), args.dp)


def init_dp(dp_size: int) -> ParallelGroups:
    """Inside a worker: the default gloo group (1 thread) and ptdp's groups for tp = pp = 1."""
    timeout = datetime.timedelta(minutes=pc.TIMEOUT_MINUTES)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timeout)
    return ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=dp_size), timeout)


class Batches:
    """This rank's microbatches of global batch ``t``, as ``ptdp train`` samples them."""

    def __init__(self, data_dir: str, args, groups: ParallelGroups) -> None:
        self.windows = TokenWindows(PreparedData.load(data_dir).train_tokens(), args.seq_length)
        self.sampler = GlobalBatchSampler(len(self.windows), args.global_batch_size, args.seed)
        self.b, self.big_b, self.dp = args.micro_batch_size, args.global_batch_size, groups.dp

    def __call__(self, t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mine = dp_shard(self.sampler.global_batch(t * self.big_b), self.dp.rank, self.dp.size)
        return microbatches(self.windows, mine, self.b)


def worker(args, data_dir: str, vocab: int) -> dict:
    groups = init_dp(args.dp)
    try:
        batches = Batches(data_dir, args, groups)
        return {"speed": _speed(args, groups, batches, vocab), "codecs": _codecs(args, groups, batches, vocab)}
    finally:
        dist.destroy_process_group()


def _build_ddp(args, groups: ParallelGroups, config: Config, stage):
    """PlainGPT with ptdp's initial weights in DDP, and its AdamW (decay on >= 2-dim tensors)."""
    m, t = config.model, config.train
    plain = PlainGPT(m.vocab_size, m.seq_length, m.hidden_size, m.num_attention_heads, m.ffn, m.num_layers)
    copy_weights(stage.model, plain, m.vocab_size)
    ddp = DistributedDataParallel(
        plain, process_group=groups.dp.group, bucket_cap_mb=args.bucket_size * 4 / 2**20, gradient_as_bucket_view=True
    )
    decay = [p for p in ddp.parameters() if p.ndim >= 2]
    rest = [p for p in ddp.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
    )
    return ddp, optimizer


def ddp_step(model: DistributedDataParallel, optimizer, mbs, clip: float, world: AxisGroup) -> float:
    """One DDP step: accumulate under ``no_sync`` but the last microbatch, clip, AdamW; returns
    the global mean loss (one float64 all-reduce, as ptdp's ``train_step``)."""
    optimizer.zero_grad(set_to_none=False)
    total = torch.zeros((), dtype=torch.float64)
    for i, (tokens, labels) in enumerate(mbs):
        sync = i == len(mbs) - 1
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = model(tokens, labels) / len(mbs)
            loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    all_reduce(total, world, tag="metrics")
    return total.item() / world.size


def _ptdp_step(stage, tracer: Tracer, mbs, iteration: int) -> float:
    tracer.events.clear()
    return train_step(stage, mbs, iteration, tracer).loss


def _span_seconds(tracer: Tracer, cat: str) -> float:
    return sum(e["dur"] for e in tracer.events if e["cat"] == cat) / 1e6


def _speed(args, groups: ParallelGroups, batches: Batches, vocab: int) -> dict:
    """Sections 1 and 2: rotating timed steps of ptdp (overlap on, off) and DDP."""
    configs = {name: make_config(args, vocab, CONSTANT_LR, overlap_grad_reduce=name == "ptdp") for name in TIMED[:2]}
    stages = {name: build_stage(cfg, groups) for name, cfg in configs.items()}
    tracers = {name: Tracer(groups.global_rank, groups.pp.rank) for name in stages}
    for tracer in tracers.values():
        tracer.active = True
    ddp, ddp_opt = _build_ddp(args, groups, configs["ptdp"], stages["ptdp"])
    steps = {name: functools.partial(_ptdp_step, stages[name], tracers[name]) for name in stages}
    steps["ddp"] = lambda mbs, _it: ddp_step(ddp, ddp_opt, mbs, configs["ptdp"].train.clip_grad, groups.world)

    data = [batches(t) for t in range(args.warmup + args.steps + 1)]
    first = {name: fn(data[0], 0) for name, fn in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in TIMED}
    sync: dict[str, list[float]] = {name: [] for name in stages}
    for i in range(1, args.warmup + args.steps + 1):
        k = i % len(TIMED)
        for name in TIMED[k:] + TIMED[:k]:
            elapsed = pc.timed_step(functools.partial(steps[name], data[i], i), groups.world)
            if i > args.warmup:
                times[name].append(elapsed)
                if name in tracers:
                    sync[name].append(_span_seconds(tracers[name], "grad_sync"))
    med = {name: pc.median(t) for name, t in times.items()}
    sync_by_rank = {name: pc.gather_floats(pc.median(s), groups.world) for name, s in sync.items()}
    return {
        "median_step_s": med,
        "steps_s": times,
        "ratio_ptdp_over_ddp": med["ptdp"] / med["ddp"],
        "ratio_ptdp_no_overlap_over_ddp": med["ptdp_no_overlap"] / med["ddp"],
        "grad_sync_s": {name: max(v) for name, v in sync_by_rank.items()},
        "grad_sync_s_by_rank": sync_by_rank,
        "first_step_loss": first,
        "same_first_loss": all(abs(v - first["ddp"]) <= LOSS_RTOL * abs(first["ddp"]) for v in first.values()),
        "buckets": len(stages["ptdp"].grads.buckets),
        "grad_numel": stages["ptdp"].grads.data.numel(),
    }


def _train(config: Config, groups: ParallelGroups, batches: Batches, iters: int) -> dict:
    """``iters`` ptdp steps from the initial weights; losses, dp bytes and step times."""
    stage = build_stage(config, groups)
    losses, dp_bytes, times = [], [], []
    for it in range(iters):
        mbs = batches(it)
        groups.stats.reset()
        start = time.perf_counter()
        losses.append(train_step(stage, mbs, it).loss)
        times.append(time.perf_counter() - start)
        dp_bytes.append(groups.stats.total(axis="dp").bytes)
    tail = max(1, iters // 10)
    return {
        "iters": iters,
        "final_loss": losses[-1],
        "tail_mean_loss": statistics.fmean(losses[-tail:]),
        "tail_iters": tail,
        "losses": losses,
        "dp_bytes_per_step": dp_bytes[-1],  # the last step: after any exact compression warmup
        "dp_bytes_last_step_by_op": {k: c["bytes"] for k, c in groups.stats.as_dict().items() if k.startswith("dp/")},
        "median_step_s": pc.median(times),
    }


def _codecs(args, groups: ParallelGroups, batches: Batches, vocab: int) -> dict:
    """Sections 3 and 4: one training run per codec, plus the distributed-optimizer sanity run."""
    runs = {
        codec: _train(
            make_config(args, vocab, {}, overlap_grad_reduce=True, grad_compression=codec), groups, batches, args.iters
        )
        for codec in CODECS
    }
    k = min(args.distopt_iters, args.iters)
    if k > 0:
        cfg = make_config(args, vocab, {}, overlap_grad_reduce=True, use_distributed_optimizer=True)
        run = _train(cfg, groups, batches, k)
        run["max_abs_loss_diff_vs_none"] = max(abs(a - b) for a, b in zip(run["losses"], runs["none"]["losses"]))
        runs["none+distopt"] = run
    base = runs["none"]["dp_bytes_per_step"]
    for run in runs.values():
        run["bytes_ratio_vs_none"] = run["dp_bytes_per_step"] / base
    return runs


def print_tables(report: dict) -> None:
    s, runs = report["speed"], report["codecs"]
    med, sync, first = s["median_step_s"], s["grad_sync_s"], s["first_step_loss"]
    names = {"ptdp": "ptdp, overlap on", "ptdp_no_overlap": "ptdp, overlap off", "ddp": "torch DDP"}
    ratio = {n: f"{med[n] / med['ddp']:.3f}" for n in TIMED}
    ratio["ptdp"] = f"**{ratio['ptdp']}**"
    rows = [
        [names[n], f"{med[n]:.4f}", ratio[n], f"{sync[n]:.4f}" if n in sync else "-", f"{first[n]:.6f}"] for n in TIMED
    ]
    print(
        f"dp={report['dp']}, {s['buckets']} ptdp buckets over {s['grad_numel']:,} gradient elements "
        f"(--bucket-size {report['bucket_size']:,}), {report['steps']} timed steps after {report['warmup']} warmup"
    )
    print(pc.table(["variant", "median s/step", "/ DDP", "grad sync + clip s", "first-step loss"], rows))
    print(
        f"\nsame first-step loss: {s['same_first_loss']}; overlap hides "
        f"{sync['ptdp_no_overlap'] - sync['ptdp']:.4f} s of grad sync per step "
        f"(step time off - on: {med['ptdp_no_overlap'] - med['ptdp']:+.4f} s)\n"
    )
    rows = []
    for name, r in runs.items():
        diff = r.get("max_abs_loss_diff_vs_none")
        note = f"max abs loss diff vs none: {diff:.2e}" if diff is not None else ""
        rows.append(
            [
                name,
                f"{r['dp_bytes_per_step']:,.0f}",
                f"{r['bytes_ratio_vs_none']:.4f}",
                r["iters"],
                f"{r['final_loss']:.4f}",
                f"{r['tail_mean_loss']:.4f}",
                f"{r['median_step_s']:.4f}",
                note,
            ]
        )
    print(
        pc.table(
            [
                "codec",
                "dp bytes/rank/step",
                "/ none",
                "iters",
                "final loss",
                "mean loss, last 10 %",
                "median s/step (not alternated)",
                "note",
            ],
            rows,
        )
    )
    print(f"\nwall time {report['wall_s']:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2, help="data-parallel processes")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096, help="tokenizer size (a new size trains a new one)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=32)
    ap.add_argument("--bucket-size", type=int, default=250_000, help="gradient elements per bucket (ptdp and DDP)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each variant in sections 1-2")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200, help="training steps per codec in section 4")
    ap.add_argument("--distopt-iters", type=int, default=20, help="steps of the distributed-optimizer check; 0: skip")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the codec runs")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", action="store_true", help="print only the JSON report")
    args = ap.parse_args()

    start = time.perf_counter()
    data = prepare(make_config(args, args.vocab_size, {}), log=lambda msg: print(msg, file=sys.stderr))
    out = pc.launch(worker, args.dp, args, str(data.cache_dir), data.vocab_size)
    report = {
        "benchmark": "data_parallel",
        "machine": pc.machine(),
        "dp": args.dp,
        "model": {
            "layers": args.num_layers,
            "hidden": args.hidden_size,
            "heads": args.num_attention_heads,
            "seq": args.seq_length,
            "vocab": data.vocab_size,
        },
        "batch": {
            "micro": args.micro_batch_size,
            "global": args.global_batch_size,
            "microbatches_per_rank": args.global_batch_size // (args.micro_batch_size * args.dp),
        },
        "bucket_size": args.bucket_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "speed": out["speed"],
        "codecs": out["codecs"],
        "wall_s": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_tables(report)
    if not out["speed"]["same_first_loss"]:
        raise SystemExit(f"first-step losses differ: {out['speed']['first_step_loss']}")


if __name__ == "__main__":
    main()
