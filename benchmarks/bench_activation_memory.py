"""Peak activation memory per pipeline rank: GPipe against 1F1B, with ptdp's real GPT.

Each rank builds its stage with ``ptdp.engine.stage.build_stage`` (same seed, so both schedules start
from the same weights) and runs one ``ptdp.engine.step.train_step`` over m microbatches under
:class:`ptdp.engine.activation_meter.SavedActivationMeter`: every tensor autograd saves for backward
is counted by its storage, once (storages shared by several saved tensors, e.g. q, k, v views of
one QKV output, are counted once, with a reference count) until the graph frees its last
reference. Storages of parameters are not counted (weights saved by linear layers are not
activations). The peak of the live total is the stage's peak saved-activation bytes.

Expected (Narayanan et al. SC21, arXiv:2104.04473, §2.2): GPipe keeps all m microbatches in flight
on every stage, 1F1B at most min(p - r, m) on rank r, so the GPipe / 1F1B ratio of the peaks is
m / min(p - r, m): m / p on the first stage, m on the last.

A second count adds the storages of the tensors the stage sent (activations forward, gradients
backward) while they are still alive, whoever holds them: the graph, the runtime, or a send's work
handle (gloo's work keeps its tensor until the handle is dropped; ptdp's runtime keeps the handles
of sends). It is recorded by wrapping ``post`` as the runtime sees it
(``ptdp.engine.comm.post``) inside the worker; ptdp's files are unchanged.

With ``--planner`` the planner's prediction for every rank and schedule
(:func:`ptdp.planner.memory.activations.stage_activation_bytes` for ``spec_from_model_config``; float64:
twice the fp32 figure) is printed beside the measurement. ``--tp`` adds tensor parallelism
(tp x pp workers), ``--interleaved`` the interleaved 1F1B schedule with v = 2.

    python benchmarks/bench_activation_memory.py
    python benchmarks/bench_activation_memory.py --microbatches 16 --seq-length 128
    python benchmarks/bench_activation_memory.py --planner --tp 2 --pp 2 --interleaved
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import pipeline_common as pc
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import ptdp.engine.pipeline.runtime as runtime
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

SCHEDULES = ("gpipe", "1f1b")


class SendTrackingMeter(SavedActivationMeter):
    """:class:`ptdp.engine.activation_meter.SavedActivationMeter` plus a second count: the saved storages
    together with the storages of tensors the pipeline sent that are still alive (held by the
    graph, by the runtime, or by a pending send's work handle)."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__(exclude)
        self._sent: list = []
        self.peak_with_sends = self.peak_sent_only = 0

    def on_pack(self) -> None:
        self._update_with_sends()

    def wrap_post(self, post):
        """``post`` (``ptdp.engine.comm.post``) that also records the storage of every send."""

        def recording_post(transfers, axis, **kwargs):
            for t in transfers:
                if t.kind == "send":
                    storage = t.tensor.untyped_storage()
                    self._sent.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
            self._update_with_sends()
            return post(transfers, axis, **kwargs)

        return recording_post

    def _update_with_sends(self) -> None:
        self._sent = [s for s in self._sent if not s[0].expired()]
        alive = {ptr: size for _, ptr, size in self._sent}
        extra = sum(size for ptr, size in alive.items() if not self.holds(ptr))
        self.peak_with_sends = max(self.peak_with_sends, self.live + extra)
        self.peak_sent_only = max(self.peak_sent_only, sum(alive.values()))


def _schedules(args) -> tuple[str, ...]:
    return SCHEDULES + (("interleaved-1f1b",) if args.interleaved else ())


def _config(args, schedule: str) -> Config:
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        params_dtype=args.dtype,
    )
    per_chunk = args.num_layers // (2 * args.pp) if schedule == "interleaved-1f1b" else None
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        pipeline_schedule=schedule,
        num_layers_per_virtual_pipeline_stage=per_chunk,
    )
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.micro_batch_size * args.microbatches,
        lr_warmup_iters=0,
    )
    return resolve(Config(model=model, parallel=parallel, train=train), args.tp * args.pp)


def predicted_bytes(config: Config, pp_rank: int) -> float:
    """The planner's activation peak of ``pp_rank`` (its fp32 figure; twice that for float64)."""
    m, p, t = config.model, config.parallel, config.train
    layout = Candidate.of(
        p.tp,
        p.pp,
        p.dp,
        t.micro_batch_size,
        t.global_batch_size,
        virtual_stages=config.pipeline.virtual_stages,
        precision="fp32",
    )
    fp32 = stage_activation_bytes(
        m,
        layout,
        pp_rank,
        m.num_layers // p.pp,
        schedule="gpipe" if p.schedule == "gpipe" else "1f1b",
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
    )
    return 2 * fp32 if m.params_dtype == "float64" else fp32


def worker(args: argparse.Namespace) -> dict:
    init_distributed(pc.TIMEOUT_MINUTES, threads_per_worker=1)
    groups = ParallelGroups.build(
        ParallelLayout(tp=args.tp, pp=args.pp, dp=1), datetime.timedelta(minutes=pc.TIMEOUT_MINUTES)
    )
    coords = (groups.coords.tp_rank, groups.coords.pp_rank)
    rows = []
    try:
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(
            0, args.vocab_size, (args.microbatches, args.micro_batch_size, args.seq_length + 1), generator=gen
        )
        # each microbatch its own storage, so a saved token tensor never pins the whole batch
        mbs = [(d[:, :-1].clone(), d[:, 1:].clone()) for d in data]
        for schedule in _schedules(args):
            stage = build_stage(_config(args, schedule), groups)
            meter = SendTrackingMeter(parameter_storages(stage.model))
            original, runtime.post = runtime.post, meter.wrap_post(runtime.post)
            try:
                with meter.hooks():
                    result = train_step(stage, mbs, 0)
            finally:
                runtime.post = original
            rows.append(
                {
                    "schedule": schedule,
                    "coords": coords,
                    "peak_bytes": meter.peak,
                    "live_after_bytes": meter.live,
                    "saved_tensors": meter.packed,
                    "loss": result.loss,
                    "peak_with_sent_bytes": meter.peak_with_sends,
                    "peak_sent_alive_bytes": meter.peak_sent_only,
                }
            )
        per_rank = pc.all_gather_object(rows, groups.world)
    finally:
        torch.distributed.destroy_process_group()
    return {"per_rank": per_rank}


def _summary(per_rank: list[list[dict]], p: int, m: int) -> list[dict]:
    """GPipe against 1F1B on tp rank 0 of each pipeline rank."""
    out = []
    for rows in per_rank:
        r = rows[0]["coords"][1]
        if rows[0]["coords"][0] != 0:
            continue
        by = {row["schedule"]: row for row in rows}
        gpipe, f1b = by["gpipe"]["peak_bytes"], by["1f1b"]["peak_bytes"]
        per_mb = gpipe / m  # GPipe holds all m microbatches at its peak
        out.append(
            {
                "pp_rank": r,
                "gpipe_peak_bytes": gpipe,
                "1f1b_peak_bytes": f1b,
                "ratio_measured": gpipe / f1b,
                "ratio_expected": m / min(p - r, m),
                "1f1b_peak_in_microbatches": f1b / per_mb,
                "expected_in_flight_1f1b": min(p - r, m),
                "live_after_step_bytes": {k: by[k]["live_after_bytes"] for k in SCHEDULES},
                "loss": {k: by[k]["loss"] for k in SCHEDULES},
                "peak_with_sent_bytes": {k: by[k]["peak_with_sent_bytes"] for k in SCHEDULES},
                "peak_sent_alive_bytes": {k: by[k]["peak_sent_alive_bytes"] for k in SCHEDULES},
                "saved_bytes_per_microbatch": per_mb,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    pc.add_gpt_shape_arguments(ap)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (tp x pp workers)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--interleaved", action="store_true", help="also run interleaved 1F1B with v = 2")
    ap.add_argument("--planner", action="store_true", help="print the planner's prediction beside the measurement")
    args = ap.parse_args()
    for schedule in _schedules(args):  # validate before starting workers
        _config(args, schedule)

    start = time.perf_counter()
    out = pc.launch(worker, args.tp * args.pp, args)
    summary = _summary(out["per_rank"], args.pp, args.microbatches)
    planner = _planner_rows(args, out["per_rank"]) if args.planner else None
    report = {
        "benchmark": "activation_memory",
        "machine": pc.machine(),
        "tp": args.tp,
        "pp": args.pp,
        "dtype": args.dtype,
        "microbatches": args.microbatches,
        "model": {
            "layers": args.num_layers,
            "hidden": args.hidden_size,
            "heads": args.num_attention_heads,
            "seq": args.seq_length,
            "vocab": args.vocab_size,
            "micro_batch": args.micro_batch_size,
        },
        "per_rank": summary,
        "planner": planner,
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2))
    mib = 2**20
    rows = [
        [
            s["pp_rank"],
            f"{s['gpipe_peak_bytes'] / mib:.1f}",
            f"{s['1f1b_peak_bytes'] / mib:.1f}",
            f"**{s['ratio_measured']:.3f}**",
            f"{s['ratio_expected']:.3f}",
            f"{s['1f1b_peak_in_microbatches']:.3f}",
            s["expected_in_flight_1f1b"],
        ]
        for s in summary
    ]
    print()
    print(
        pc.table(
            [
                "pp rank",
                "GPipe peak MiB",
                "1F1B peak MiB",
                "GPipe / 1F1B",
                "expected m / min(p - r, m)",
                "1F1B peak in microbatches",
                "expected in flight",
            ],
            rows,
        )
    )
    rows = [
        [s["pp_rank"], f"{s['saved_bytes_per_microbatch'] / mib:.2f}"]
        + [f"{s[key][k] / mib:.1f}" for k in SCHEDULES for key in ("peak_sent_alive_bytes", "peak_with_sent_bytes")]
        + [f"{s['peak_with_sent_bytes']['gpipe'] / s['peak_with_sent_bytes']['1f1b']:.3f}"]
        for s in summary
    ]
    print()
    print(
        pc.table(
            [
                "pp rank",
                "saved MiB per microbatch",
                "GPipe sent alive MiB",
                "GPipe saved + sent MiB",
                "1F1B sent alive MiB",
                "1F1B saved + sent MiB",
                "GPipe / 1F1B (saved + sent)",
            ],
            rows,
        )
    )

    if planner is not None:
        print()
        print(
            pc.table(
                ["schedule", "tp rank", "pp rank", "measured peak bytes", "planner bytes", "planner error"],
                [
                    [
                        r["schedule"],
                        r["tp_rank"],
                        r["pp_rank"],
                        f"{r['measured_bytes']:,}",
                        f"{r['predicted_bytes']:,.0f}",
                        f"{100 * r['error']:+.2f}%",
                    ]
                    for r in planner
                ],
            )
        )


def _planner_rows(args, per_rank: list[list[dict]]) -> list[dict]:
    """Measured peak and planner prediction for every rank and schedule."""
    out = []
    for schedule in _schedules(args):
        config = _config(args, schedule)
        for rows in per_rank:
            row = next(r for r in rows if r["schedule"] == schedule)
            predicted = predicted_bytes(config, row["coords"][1])
            out.append(
                {
                    "schedule": schedule,
                    "tp_rank": row["coords"][0],
                    "pp_rank": row["coords"][1],
                    "measured_bytes": row["peak_bytes"],
                    "predicted_bytes": predicted,
                    "error": row["peak_bytes"] / predicted - 1,
                }
            )
    return out


if __name__ == "__main__":
    main()
