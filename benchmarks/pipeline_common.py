"""Plumbing shared by the multi-process benchmarks (``bench_schedule_bubble.py``,
``bench_vs_torch_pipelining.py``, ``bench_sharding.py`` and others).

Workers are started by ptdp's own launcher (:func:`ptdp.run.launch.launch_workers`, PyTorch's elastic
launcher underneath) on a gloo world of ``pp`` processes with one CPU thread each; rank 0's return
value comes back to the launching process. Step times are measured the same way everywhere: every
rank waits at a barrier, runs the step, and the step time is the slowest rank's (an all-reduce max).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine import comm
from ptdp.engine.comm import AxisGroup, all_reduce
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout
from ptdp.run.distributed import init_distributed
from ptdp.run.launch import launch_workers

TIMEOUT_MINUTES = 5.0


def add_gpt_shape_arguments(ap) -> None:
    """The GPT shape and micro batch flags shared by the activation-memory benchmarks (8 layers,
    h = 256, 8 heads, s = 256, V = 4096, b = 4 by default)."""
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=4)


def rank_batches(args, step: int, rank: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Data-parallel rank ``rank``'s microbatches of global batch ``step``: ``args.global_batch_size``
    sequences of random tokens (seeded by the step), the rank's contiguous ``1 / dp`` of them in
    microbatches of ``args.micro_batch_size``."""
    gen = torch.Generator().manual_seed(step)
    data = torch.randint(0, args.vocab_size, (args.global_batch_size, args.seq_length + 1), generator=gen)
    per = args.global_batch_size // dp
    mine = data[rank * per : (rank + 1) * per]
    b = args.micro_batch_size
    return [(mine[i : i + b, :-1], mine[i : i + b, 1:]) for i in range(0, per, b)]


def dp_gpt_config(args, parallel: ParallelConfig, world: int, moe: MoEConfig | None = None) -> Config:
    """The resolved config of a step-time benchmark over ``world`` ranks: ``args``' GPT (the flags of
    :func:`add_gpt_shape_arguments`, no vocabulary padding, float32; ``moe``: its MoE options, default
    dense), ``args.global_batch_size`` sequences per step, a constant learning rate, clipping at 1."""
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=1,
        params_dtype="float32",
    )
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        train_iters=10_000,
        lr=1e-4,
        min_lr=1e-4,
        lr_warmup_iters=0,
        clip_grad=1.0,
    )
    return resolve(Config(model=model, moe=moe or MoEConfig(), parallel=parallel, train=train), world)


def launch(entrypoint, nproc: int, *args):
    """Run ``entrypoint(*args)`` in ``nproc`` gloo workers (1 thread each); rank 0's result."""
    os.environ["OMP_NUM_THREADS"] = "1"
    return launch_workers(entrypoint, nproc, *args)


def init_pipeline(pp_size: int) -> ParallelGroups:
    """Inside a worker: the default gloo group and ptdp's groups for tp = dp = 1, pp = ``pp_size``."""
    init_distributed(TIMEOUT_MINUTES, threads_per_worker=1)
    return ParallelGroups.build(ParallelLayout(tp=1, pp=pp_size, dp=1), datetime.timedelta(minutes=TIMEOUT_MINUTES))


def timed_step(fn, world: AxisGroup) -> float:
    """Seconds of ``fn()`` on the slowest rank, every rank starting after a common barrier."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    return all_reduce(elapsed, world, op="max", tag="bench").item()


def gather_floats(value: float, world: AxisGroup) -> list[float]:
    """``value`` of every rank, in rank order."""
    return [float(x) for x in comm.all_gather_object(float(value), world)]


def all_gather_object(obj, world: AxisGroup) -> list:
    """Every rank's ``obj`` (picklable), in rank order."""
    return comm.all_gather_object(obj, world)


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> dict:
    """What the numbers were measured on."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table (floats as given: format them before)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
