"""Time one training step of ptdp's GPT at tp=pp=dp=1 against a plain PyTorch GPT of the same shape.

Both models start from the same weights, see the same microbatches, accumulate gradients over them,
clip the global norm and take one ``torch.optim.AdamW`` step. Steps alternate between the two
(ptdp, plain, ptdp, plain, ...) so machine noise hits both alike; the report gives the median step
time of each and the ratio ptdp / plain (target <= 1.03, eager and compiled alike). It also checks that both compute the
same first-step loss. The plain GPT is ``plain_gpt.py``'s (shared with ``gpu_check.py``).

With ``--compile`` both are compiled: ptdp through its own ``--compile`` option, the plain model by
``torch.compile``; the untimed warm-up steps include the compilation.

    python benchmarks/bench_step.py                   # default ptdp train model shape
    python benchmarks/bench_step.py --hidden-size 256 --num-layers 8
    python benchmarks/bench_step.py --compile
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from plain_gpt import copy_weights, plain_like, plain_optimizer, plain_step, with_compile

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="ptdp's --compile against torch.compile of the plain model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_cfg = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
    )
    train_cfg = TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        train_iters=10_000,
        lr_warmup_iters=0,
        lr=1e-4,
        min_lr=1e-4,
    )
    config = resolve(Config(model=model_cfg, parallel=ParallelConfig(), train=train_cfg), 1)
    if args.compile:
        config = with_compile(config)
        if config is None:
            ap.exit(2, "bench_step.py: error: --compile: this ptdp has no --compile option\n")
    stage = build_stage(config, ParallelGroups.single_process())
    plain = plain_like(config)
    copy_weights(stage.model, plain, args.vocab_size)
    plain_opt = plain_optimizer(plain, train_cfg, torch.device("cpu"))
    runner = torch.compile(plain) if args.compile else plain

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab_size, (args.global_batch_size, args.seq_length + 1), generator=gen)
    b = args.micro_batch_size
    mbs = [(data[i : i + b, :-1], data[i : i + b, 1:]) for i in range(0, args.global_batch_size, b)]

    ptdp_loss = float(train_step(stage, mbs, 0).loss)
    plain_loss = float(plain_step(runner, plain_opt, mbs, train_cfg.clip_grad))
    if abs(ptdp_loss - plain_loss) > 1e-4 * abs(plain_loss):
        raise SystemExit(f"models differ: ptdp loss {ptdp_loss} vs plain {plain_loss}")

    times = {"ptdp": [], "plain": []}
    for i in range(args.warmup + args.steps):
        for name in ("ptdp", "plain"):
            start = time.perf_counter()
            if name == "ptdp":
                train_step(stage, mbs, i + 1)
            else:
                plain_step(runner, plain_opt, mbs, train_cfg.clip_grad)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "model": {
            "layers": args.num_layers,
            "hidden": args.hidden_size,
            "heads": args.num_attention_heads,
            "seq": args.seq_length,
            "vocab": args.vocab_size,
        },
        "batch": {"micro": b, "global": args.global_batch_size, "microbatches": len(mbs)},
        "threads": args.threads,
        "steps": args.steps,
        "compile": args.compile,
        "median_step_s": med,
        "ratio_ptdp_over_plain": med["ptdp"] / med["plain"],
        "first_step_loss": {"ptdp": ptdp_loss, "plain": plain_loss},
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
