"""Activation recomputation and sequence parallelism: peak saved activations and step time.

At one layout (default tp = 2, pp = 2, dp = 1, 1F1B) every worker builds six stages of ptdp's GPT
from the same seed, one per mode: recompute none / selective / full (uniform, one layer per
group), each without and with ``sequence_parallel``. For each mode:

- memory: one ``ptdp.engine.step.train_step`` under :class:`ptdp.engine.activation_meter.SavedActivationMeter`
  (parameters excluded), beside the planner's ``stage_activation_bytes`` for
  ``spec_from_model_config`` with a ``Candidate`` carrying ``recompute`` and ``sequence_parallel``.
  Recomputed regions run in ``torch.utils.checkpoint`` (non-reentrant), whose own saved-tensor
  hooks hide the region from the meter. Two additions make it visible, for the metered step
  only: the tensor inputs of each recomputed region (which the checkpoint keeps until backward)
  pass through an identity autograd function that saves them, so the meter counts their
  storages; and the tensors the checkpoint rebuilds in backward are counted from the moment the
  recompute stores them until backward has used them (a wrapper of the checkpoint's recompute
  pack hook). The timed steps run ptdp unchanged.
- time: after one warm-up step per mode, ``--steps`` steps per mode, interleaved mode by mode
  (step i of every mode, then step i + 1), each step's time the largest over the ranks; the
  median per mode, as a ratio to the same sequence-parallel setting without recompute.

    python benchmarks/bench_recompute_memory.py
    python benchmarks/bench_recompute_memory.py --steps 8 --microbatches 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
import weakref

import pipeline_common as pc
import torch
import torch.utils.checkpoint as tcheckpoint

import ptdp.engine.model.recompute as recompute_mod
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.activation_meter import SavedActivationMeter, parameter_storages
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.layout.grid import ParallelLayout
from ptdp.planner.candidate import Candidate
from ptdp.planner.memory.activations import stage_activation_bytes
from ptdp.run.distributed import init_distributed

MODES = [(r, sp) for sp in (False, True) for r in ("none", "selective", "full")]


def mode_name(mode) -> str:
    r, sp = mode
    return r + (" + SP" if sp else "")


def _config(args, mode) -> Config:
    r, sp = mode
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        recompute_granularity=None if r == "none" else r,
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        pipeline_schedule="1f1b",
        sequence_parallel=sp,
    )
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.micro_batch_size * args.microbatches,
        lr_warmup_iters=0,
    )
    return resolve(Config(model=model, parallel=parallel, train=train), args.tp * args.pp)


def predicted_bytes(config: Config, mode, pp_rank: int) -> float:
    m, p, t = config.model, config.parallel, config.train
    layout = Candidate.of(
        p.tp,
        p.pp,
        p.dp,
        t.micro_batch_size,
        t.global_batch_size,
        recompute=mode[0],
        sequence_parallel=mode[1],
        precision="fp32",
    )
    return stage_activation_bytes(
        m,
        layout,
        pp_rank,
        m.num_layers // p.pp,
        schedule="1f1b",
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
    )


class _Keep(torch.autograd.Function):
    """Identity that saves its input for backward (so the meter sees a region input the checkpoint keeps)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _noop(*_):
    pass


class metered_recompute:
    """Context: region inputs and recomputed tensors of ``torch.utils.checkpoint`` counted by ``meter``."""

    def __init__(self, meter: SavedActivationMeter) -> None:
        self.meter = meter

    def __enter__(self):
        meter = self.meter
        self._ckpt, self._hook = recompute_mod.checkpoint, tcheckpoint._recomputation_hook
        real_ckpt, real_hook = self._ckpt, self._hook

        def checkpoint(fn, *args, **kwargs):
            args = [_Keep.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
            return real_ckpt(fn, *args, **kwargs)

        class hook(real_hook):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                inner = self.pack_hook

                def pack_hook(x):
                    xd = x.detach() if x.requires_grad else x
                    box = meter._pack(xd)  # counted until the recompute's copy is dropped
                    if box is not xd:  # excluded storages come back as the tensor itself
                        box.tensor = None  # the box must not keep xd alive
                        weakref.finalize(xd, _noop, box)
                    return inner(xd)

                self.pack_hook = pack_hook

        recompute_mod.checkpoint, tcheckpoint._recomputation_hook = checkpoint, hook
        return self

    def __exit__(self, *exc):
        recompute_mod.checkpoint, tcheckpoint._recomputation_hook = self._ckpt, self._hook


def worker(args: argparse.Namespace) -> dict:
    init_distributed(pc.TIMEOUT_MINUTES, threads_per_worker=1)
    groups = ParallelGroups.build(
        ParallelLayout(tp=args.tp, pp=args.pp, dp=1), datetime.timedelta(minutes=pc.TIMEOUT_MINUTES)
    )
    coords = (groups.coords.tp_rank, groups.coords.pp_rank)
    try:
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(
            0, args.vocab_size, (args.microbatches, args.micro_batch_size, args.seq_length + 1), generator=gen
        )
        mbs = [(d[:, :-1].clone(), d[:, 1:].clone()) for d in data]
        stages = [build_stage(_config(args, mode), groups) for mode in MODES]
        memory, losses = [], []
        for stage in stages:  # metered step, also the first warm-up
            meter = SavedActivationMeter(parameter_storages(stage.model))
            with metered_recompute(meter), meter.hooks():
                result = train_step(stage, mbs, 0)
            memory.append(meter.peak)
            losses.append(result.loss)
        for stage in stages:  # second warm-up, unmetered
            train_step(stage, mbs, 1)
        times = [[] for _ in MODES]
        for i in range(args.steps):
            for k, stage in enumerate(stages):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                train_step(stage, mbs, 2 + i)
                times[k].append(time.perf_counter() - t0)
        per_rank = pc.all_gather_object(
            {"coords": coords, "memory": memory, "times": times, "loss": losses}, groups.world
        )
    finally:
        torch.distributed.destroy_process_group()
    return {"per_rank": per_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    pc.add_gpt_shape_arguments(ap)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode (after two warm-up steps)")
    args = ap.parse_args()
    configs = [_config(args, mode) for mode in MODES]  # validate before starting workers

    start = time.perf_counter()
    per_rank = pc.launch(worker, args.tp * args.pp, args)["per_rank"]
    pp_ranks = sorted({r["coords"][1] for r in per_rank})
    step_max = [[max(r["times"][k][i] for r in per_rank) for i in range(args.steps)] for k in range(len(MODES))]
    median = [pc.median(s) for s in step_max]
    rows = []
    for k, mode in enumerate(MODES):
        base = MODES.index(("none", mode[1]))
        measured = {p: max(r["memory"][k] for r in per_rank if r["coords"][1] == p) for p in pp_ranks}
        predicted = {p: predicted_bytes(configs[k], mode, p) for p in pp_ranks}
        rows.append(
            {
                "mode": mode_name(mode),
                "measured_bytes": measured,
                "predicted_bytes": predicted,
                "error": {p: measured[p] / predicted[p] - 1 for p in pp_ranks},
                "memory_by_rank": {str(r["coords"]): r["memory"][k] for r in per_rank},
                "loss": per_rank[-1]["loss"][k],
                "median_step_s": median[k],
                "step_s": step_max[k],
                "step_time_ratio": median[k] / median[base],
            }
        )
    report = {
        "benchmark": "recompute_memory",
        "machine": pc.machine(),
        "tp": args.tp,
        "pp": args.pp,
        "microbatches": args.microbatches,
        "steps": args.steps,
        "model": {
            "layers": args.num_layers,
            "hidden": args.hidden_size,
            "heads": args.num_attention_heads,
            "seq": args.seq_length,
            "vocab": args.vocab_size,
            "micro_batch": args.micro_batch_size,
        },
        "rows": rows,
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2))
    mib = 2**20
    print()
    print(
        pc.table(
            [
                "mode",
                "measured MiB (pp " + " / ".join(map(str, pp_ranks)) + ")",
                "predicted MiB",
                "error",
                "median step s",
                "step time / no recompute",
            ],
            [
                [
                    r["mode"],
                    " / ".join(f"{r['measured_bytes'][p] / mib:.2f}" for p in pp_ranks),
                    " / ".join(f"{r['predicted_bytes'][p] / mib:.2f}" for p in pp_ranks),
                    " / ".join(f"{100 * r['error'][p]:+.1f}%" for p in pp_ranks),
                    f"{r['median_step_s']:.3f}",
                    f"{r['step_time_ratio']:.3f}",
                ]
                for r in rows
            ],
        )
    )


if __name__ == "__main__":
    main()
