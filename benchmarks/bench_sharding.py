"""ptdp's data-parallel sharding strategies at dp = 4 (tp = pp = 1) side by side with PyTorch's
FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same model, in the same run.

Four gloo worker processes on CPU (one thread each), started by ptdp's launcher
(:mod:`pipeline_common`). Every variant starts from the same weights (ptdp's initialisation, copied
into ``plain_gpt.PlainGPT`` for FSDP2) and trains on the same random token batches: global batch
``B``, this rank's contiguous quarter, ``m = B / (b * dp)`` microbatches accumulated per step,
global-norm clipping, AdamW, float32.

- ptdp ``no_shard``, ``optim`` (ZeRO-1), ``optim_grads`` (ZeRO-2) and ``optim_grads_params``
  (ZeRO-3: each unit, a transformer layer, the embeddings or the head, all-gathered before its
  forward and again before its backward; ``optim_grads_params_kept`` with
  ``--no-reshard-after-forward``), buckets of ``--bucket-size`` elements reduced during backward
  (``--overlap-grad-reduce``);
- FSDP2: ``fully_shard`` on every transformer block and on the whole model (its default
  ``reshard_after_forward=True``, so parameters are sharded too: ZeRO-3), reduce-scatter in
  every microbatch's backward, ``clip_grad_norm_`` over its DTensor gradients, ``torch.optim.AdamW``.

The first step of every variant must give the same loss (relative 1e-4; the script exits non-zero
otherwise). Then steps rotate (a, b, c, d), (b, c, d, a), ... so machine noise hits all alike; step
time = slowest rank's after a barrier. Reported: median step time and its ratio to ``no_shard``,
and the bytes each rank keeps between steps: parameters, gradients, optimizer state (ptdp:
:func:`ptdp.run.planner_report.measure_stage`; FSDP2: the local tensors of its DTensor parameters,
gradients and AdamW state), ptdp's gradient transient under ``optim_grads`` and
``optim_grads_params`` (the most bucket bytes allocated at once during a backward) and its
parameter transient under ``optim_grads_params`` (the most gathered unit bytes at once). The processes' peak RSS is not reported: all variants
share each process, so it cannot be told apart per variant.

    python benchmarks/bench_sharding.py            # 4 layers, h = 256, s = 128, B = 16, b = 2
    python benchmarks/bench_sharding.py --json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys

import pipeline_common as pc
import torch
import torch.distributed as dist
from plain_gpt import PlainGPT, copy_weights, plain_optimizer, plain_step

from ptdp.config.parallel import ParallelConfig
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.layout.grid import ParallelLayout
from ptdp.run.distributed import init_distributed
from ptdp.run.planner_report import measure_stage

#: ptdp's variants: name -> (sharding strategy, reshard after forward)
VARIANTS = {
    "no_shard": ("no_shard", True),
    "optim": ("optim", True),
    "optim_grads": ("optim_grads", True),
    "optim_grads_params": ("optim_grads_params", True),
    "optim_grads_params_kept": ("optim_grads_params", False),
}
STRATEGIES = tuple(VARIANTS)
LOSS_RTOL = 1e-4
DP = 4


def make_config(args, variant: str) -> Config:
    strategy, reshard = VARIANTS[variant]
    par = ParallelConfig(
        data_parallel_size=DP,
        ddp_bucket_size=args.bucket_size,
        overlap_grad_reduce=True,
        data_parallel_sharding_strategy=strategy,
        reshard_after_forward=reshard,
        distributed_timeout_minutes=pc.TIMEOUT_MINUTES,
    )
    return pc.dp_gpt_config(args, par, DP)


def build_fsdp(config: Config, stage):
    """PlainGPT with ``stage``'s initial weights, ``fully_shard`` per block and on the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = config.model
    plain = PlainGPT(m.vocab_size, m.seq_length, m.hidden_size, m.num_attention_heads, m.ffn, m.num_layers)
    copy_weights(stage.model, plain, m.vocab_size)
    mesh = init_device_mesh("cpu", (DP,))
    for block in plain.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    return plain, plain_optimizer(plain, config.train, torch.device("cpu"))


def fsdp_step(model, optimizer, mbs, clip: float) -> float:
    """One FSDP2 step; the global mean loss (this rank's mean, averaged over dp)."""
    loss = plain_step(model, optimizer, mbs, clip).detach()
    dist.all_reduce(loss)
    return loss.item() / DP


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def fsdp_bytes(model, optimizer) -> dict:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v)]
    return {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _local_bytes(state),
    }


def worker(args) -> dict:
    timeout = datetime.timedelta(minutes=pc.TIMEOUT_MINUTES)
    init_distributed(pc.TIMEOUT_MINUTES, threads_per_worker=1)
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=DP), timeout)
    try:
        return _run(args, groups)
    finally:
        dist.destroy_process_group()


def _run(args, groups: ParallelGroups) -> dict:
    configs = {s: make_config(args, s) for s in STRATEGIES}
    stages = {s: build_stage(c, groups) for s, c in configs.items()}
    fsdp, fsdp_opt = build_fsdp(configs["no_shard"], stages["no_shard"])
    rank = groups.dp.rank
    steps = {s: (lambda mbs, it, s=s: train_step(stages[s], mbs, it).loss) for s in STRATEGIES}
    steps["fsdp2"] = lambda mbs, _it: fsdp_step(fsdp, fsdp_opt, mbs, configs["no_shard"].train.clip_grad)
    names = list(steps)
    first = {name: fn(pc.rank_batches(args, 0, rank, DP), 0) for name, fn in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(1, args.warmup + args.steps + 1):
        mbs = pc.rank_batches(args, i, rank, DP)
        k = i % len(names)
        for name in names[k:] + names[:k]:
            elapsed = pc.timed_step(functools.partial(steps[name], mbs, i), groups.world)
            if i > args.warmup:
                times[name].append(elapsed)
    med = {name: pc.median(t) for name, t in times.items()}
    memory = {
        s: {
            k: v
            for k, v in measure_stage(stages[s]).items()
            if k in ("params", "grads", "optimizer", "grads_transient", "params_transient")
        }
        for s in STRATEGIES
    }
    memory["fsdp2"] = fsdp_bytes(fsdp, fsdp_opt)
    return {
        "median_step_s": med,
        "ratio_to_no_shard": {n: med[n] / med["no_shard"] for n in names},
        "bytes_per_rank": pc.all_gather_object(memory, groups.world),
        "first_step_loss": first,
        "same_first_loss": all(
            abs(v - first["no_shard"]) <= LOSS_RTOL * abs(first["no_shard"]) for v in first.values()
        ),
        "params": sum(p.numel() for p in stages["no_shard"].model.parameters()),
        "buckets": len(stages["optim_grads"].grads.buckets),
    }


def report(args, res: dict) -> str:
    rows = []
    mem = res["bytes_per_rank"][0]
    for name in (*STRATEGIES, "fsdp2"):
        m = mem[name]
        transient = f"{m['grads_transient'] / 2**20:.2f}" if m.get("grads_transient") else "-"
        gathered = f"{m['params_transient'] / 2**20:.2f}" if m.get("params_transient") else "-"
        rows.append(
            [
                name,
                f"{res['median_step_s'][name]:.3f}",
                f"{res['ratio_to_no_shard'][name]:.2f}",
                f"{m['params'] / 2**20:.2f}",
                gathered,
                f"{m['grads'] / 2**20:.2f}",
                transient,
                f"{m['optimizer'] / 2**20:.2f}",
            ]
        )
    head = (
        f"dp = {DP}, {args.num_layers} layers, h = {args.hidden_size}, s = {args.seq_length}, "
        f"V = {args.vocab_size}, B = {args.global_batch_size}, b = {args.micro_batch_size}, "
        f"{res['params']:,} parameters, optim_grads buckets: {res['buckets']}; median of {args.steps} steps; "
        f"same first-step loss: {res['same_first_loss']}"
    )
    return (
        head
        + "\n\n"
        + pc.table(
            [
                "variant",
                "step s",
                "/ no_shard",
                "params MiB (kept)",
                "params MiB (gathered)",
                "grads MiB (kept)",
                "grads MiB (transient)",
                "optimizer MiB",
            ],
            rows,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--bucket-size", type=int, default=300_000, help="elements per gradient bucket")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = pc.launch(worker, DP, args)
    res["machine"] = pc.machine()
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(report(args, res))
        print(f"\nmachine: {res['machine']}")
    if not res["same_first_loss"]:
        print(f"first-step losses differ: {res['first_step_loss']}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
