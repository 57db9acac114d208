"""Context parallelism: saved activations per rank at cp = 1, 2, 4 against the planner, and the
step time of the two key/value exchanges (``--cp-comm-type p2p`` against ``all_gather``).

One world per cp size (tp = pp = dp = 1, world = cp, gloo). Each rank builds its stage with
``ptdp.engine.stage.build_stage`` and runs ``ptdp.engine.step.train_step`` on the same microbatches
(full sequences: the model keeps its two chunks):

* memory: one step under :class:`ptdp.engine.activation_meter.SavedActivationMeter` (every storage
  autograd saves for backward, once; parameters excluded), per comm type; its peak on the most
  loaded rank beside the planner's :func:`ptdp.planner.memory.activations.rank_activation_bytes` for the same
  layout (float32). The planner's figure adds the key/value exchange buffers of the running layer
  (:func:`ptdp.planner.memory.cp_local.kv_buffer_bytes`), which autograd does not save; both are shown.
  Expected: the layers' activations fall as 1/cp (each rank keeps s/cp tokens of every tensor).
* time: the p2p and all_gather stages alternate step by step in the same world (same weights,
  same data), ``--steps`` timed steps each after one warm-up; medians of the slowest rank's time
  and their ratio p2p / all_gather.

    python benchmarks/bench_context_parallel.py
    python benchmarks/bench_context_parallel.py --seq-length 2048 --steps 6
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import pipeline_common as pc
import torch

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
from ptdp.planner.memory.activations import rank_activation_bytes
from ptdp.planner.memory.cp_local import kv_buffer_bytes
from ptdp.run.distributed import init_distributed

COMM_TYPES = ("p2p", "all_gather")


def _config(args, cp: int, comm_type: str) -> Config:
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        params_dtype="float32",
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp, cp_comm_type=comm_type
    )
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.micro_batch_size * args.microbatches,
        lr_warmup_iters=0,
    )
    return resolve(Config(model=model, parallel=parallel, train=train), cp)


def predicted(args, cp: int, comm_type: str) -> tuple[float, float]:
    """(the planner's activation peak of a cp rank, its key/value exchange buffers), float32."""
    config = _config(args, cp, comm_type)
    spec = config.model
    layout = Candidate.of(
        1,
        1,
        1,
        args.micro_batch_size,
        args.micro_batch_size * args.microbatches,
        precision="fp32",
        cp=cp,
        cp_comm_type=comm_type,
    )
    total = rank_activation_bytes(
        spec, layout, 0, args.num_layers, make_vocab_size_divisible_by=config.model.make_vocab_size_divisible_by
    )
    return total, kv_buffer_bytes(spec, 1, cp, args.micro_batch_size, comm_type, 4.0)


def worker(args: argparse.Namespace, cp: int) -> dict:
    init_distributed(pc.TIMEOUT_MINUTES, threads_per_worker=1)
    groups = ParallelGroups.build(ParallelLayout(1, 1, 1, cp=cp), datetime.timedelta(minutes=pc.TIMEOUT_MINUTES))
    try:
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(
            0, args.vocab_size, (args.microbatches, args.micro_batch_size, args.seq_length + 1), generator=gen
        )
        mbs = [(d[:, :-1].clone(), d[:, 1:].clone()) for d in data]
        comm_types = COMM_TYPES if cp > 1 else ("p2p",)
        stages = {c: build_stage(_config(args, cp, c), groups) for c in comm_types}
        peaks, losses = {}, {}
        for c, stage in stages.items():
            meter = SavedActivationMeter(parameter_storages(stage.model))
            with meter.hooks():
                losses[c] = train_step(stage, mbs, 0).result().loss
            peaks[c] = meter.peak
        times: dict[str, list[float]] = {c: [] for c in comm_types}
        for i in range(1, args.steps + 1):
            for c, stage in stages.items():
                times[c].append(pc.timed_step(lambda: train_step(stage, mbs, i).result(), groups.world))
        rows = pc.all_gather_object({"peaks": peaks, "losses": losses, "times": times}, groups.world)
    finally:
        torch.distributed.destroy_process_group()
    return {"per_rank": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per comm type (after one measured step)")
    pc.add_gpt_shape_arguments(ap)
    ap.set_defaults(seq_length=1024, hidden_size=64, num_layers=2, num_attention_heads=4, micro_batch_size=1)
    args = ap.parse_args()
    for cp in args.cp:  # validate before starting workers
        _config(args, cp, "p2p")
    start = time.perf_counter()
    results = []
    for cp in args.cp:
        out = pc.launch(worker, cp, args, cp)
        per_rank = out["per_rank"]
        for c in per_rank[0]["peaks"]:
            measured = max(r["peaks"][c] for r in per_rank)
            total, buffers = predicted(args, cp, c)
            slowest = [max(r["times"][c][i] for r in per_rank) for i in range(args.steps)]
            results.append(
                {
                    "cp": cp,
                    "comm_type": c,
                    "measured_peak_bytes": measured,
                    "planner_bytes": total,
                    "planner_kv_buffer_bytes": buffers,
                    "planner_error_without_buffers": measured / (total - buffers) - 1,
                    "loss": per_rank[0]["losses"][c],
                    "median_step_s": pc.median(slowest),
                }
            )
    base = next(r["measured_peak_bytes"] for r in results if r["cp"] == min(args.cp))
    for r in results:
        r["measured_vs_smallest_cp"] = r["measured_peak_bytes"] / base
    report = {
        "benchmark": "context_parallel",
        "machine": pc.machine(),
        "steps": args.steps,
        "model": {
            "layers": args.num_layers,
            "hidden": args.hidden_size,
            "heads": args.num_attention_heads,
            "seq": args.seq_length,
            "vocab": args.vocab_size,
            "micro_batch": args.micro_batch_size,
            "microbatches": args.microbatches,
            "dtype": "float32",
        },
        "rows": results,
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2))
    mib = 2**20
    print()
    print(
        pc.table(
            [
                "cp",
                "comm type",
                "measured peak MiB",
                "x cp=1",
                "planner MiB (without kv buffers)",
                "planner error",
                "median step s",
            ],
            [
                [
                    r["cp"],
                    r["comm_type"],
                    f"{r['measured_peak_bytes'] / mib:.2f}",
                    f"{r['measured_vs_smallest_cp']:.3f}",
                    f"{r['planner_bytes'] / mib:.2f} ({(r['planner_bytes'] - r['planner_kv_buffer_bytes']) / mib:.2f})",
                    f"{100 * r['planner_error_without_buffers']:+.1f}%",
                    f"{r['median_step_s']:.3f}",
                ]
                for r in results
            ],
        )
    )
    by = {(r["cp"], r["comm_type"]): r["median_step_s"] for r in results}
    ratios = [
        [cp, f"{by[(cp, 'p2p')] / by[(cp, 'all_gather')]:.3f}"]
        for cp in args.cp
        if (cp, "p2p") in by and (cp, "all_gather") in by
    ]
    if ratios:
        print()
        print(pc.table(["cp", "step time p2p / all_gather"], ratios))


if __name__ == "__main__":
    main()
