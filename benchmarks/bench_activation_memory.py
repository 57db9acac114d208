"""Peak activation memory per pipeline rank: GPipe against 1F1B, with ptdp's real GPT.

Each rank builds its stage with ``ptdp.step.build_stage`` (same seed, so both schedules start
from the same weights) and runs one ``ptdp.step.train_step`` over m microbatches under
``torch.autograd.graph.saved_tensors_hooks``. The pack hook counts every tensor autograd saves
for backward by its storage, once (storages shared by several saved tensors, e.g. q, k, v views
of one QKV output, are counted once, with a reference count); a ``weakref.finalize`` on the packed
object subtracts the storage when the graph frees its last reference. Storages of parameters are
not counted (weights saved by linear layers are not activations). The peak of the live total is
the stage's peak saved-activation bytes.

Expected (Narayanan et al. SC21, arXiv:2104.04473, §2.2): GPipe keeps all m microbatches in flight
on every stage, 1F1B at most min(p - r, m) on rank r, so the GPipe / 1F1B ratio of the peaks is
m / min(p - r, m): m / p on the first stage, m on the last.

A second count adds the storages of the tensors the stage sent (activations forward, gradients
backward) while they are still alive, whoever holds them: the graph, the runtime, or a send's work
handle (gloo's work keeps its tensor until the handle is dropped; ptdp's runtime keeps the handles
of sends). It is recorded by wrapping ``post`` as the runtime sees it
(``ptdp.pipeline.runtime.post``) inside the worker; ptdp's files are unchanged.

    python benchmarks/bench_activation_memory.py
    python benchmarks/bench_activation_memory.py --microbatches 16 --seq-length 128
"""

from __future__ import annotations

import argparse
import json
import time
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import pipeline_common as pc
import ptdp.pipeline.runtime as runtime
from ptdp.config import Config, ModelConfig, ParallelConfig, TrainConfig, resolve
from ptdp.step import build_stage, train_step

SCHEDULES = ("gpipe", "1f1b")


class _Packed:
    """What autograd keeps instead of the tensor; its death means the graph released it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivationMeter:
    """Live and peak bytes of the storages autograd holds for backward (each storage once).

    Use as ``with meter.hooks(): ...``; ``exclude`` are data pointers of storages never counted.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.live = self.peak = 0
        self.packed = 0
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude:
            return tensor
        self.packed += 1
        if self._refs.get(key, 0) == 0:
            self._sizes[key] = storage.nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
        self._update_with_sends()
        self._refs[key] = self._refs.get(key, 0) + 1
        box = _Packed(tensor)
        weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def _unpack(box):
        return box.tensor if isinstance(box, _Packed) else box

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    # Second count: the saved storages together with the storages of tensors the pipeline sent
    # that are still alive (held by the graph, by the runtime, or by a pending send's work handle).

    def wrap_post(self, post):
        """``post`` (``ptdp.comm.post``) that also records the storage of every send."""

        def recording_post(transfers, axis, **kwargs):
            for t in transfers:
                if t.kind == "send":
                    storage = t.tensor.untyped_storage()
                    self._sent.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
            self._update_with_sends()
            return post(transfers, axis, **kwargs)

        self._sent: list = []
        self.peak_with_sends = self.peak_sent_only = 0
        return recording_post

    def _update_with_sends(self) -> None:
        if not hasattr(self, "_sent"):
            return
        self._sent = [s for s in self._sent if not s[0].expired()]
        alive = {ptr: size for _, ptr, size in self._sent}
        extra = sum(size for ptr, size in alive.items() if ptr not in self._refs)
        self.peak_with_sends = max(self.peak_with_sends, self.live + extra)
        self.peak_sent_only = max(self.peak_sent_only, sum(alive.values()))


def _config(args, schedule: str) -> Config:
    model = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                        vocab_size=args.vocab_size)
    parallel = ParallelConfig(pipeline_model_parallel_size=args.pp, pipeline_schedule=schedule)
    train = TrainConfig(micro_batch_size=args.micro_batch_size,
                        global_batch_size=args.micro_batch_size * args.microbatches, lr_warmup_iters=0)
    return resolve(Config(model=model, parallel=parallel, train=train), args.pp)


def worker(args: argparse.Namespace) -> dict:
    groups = pc.init_pipeline(args.pp)
    rows = []
    try:
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(0, args.vocab_size, (args.microbatches, args.micro_batch_size, args.seq_length + 1),
                             generator=gen)
        # each microbatch its own storage, so a saved token tensor never pins the whole batch
        mbs = [(d[:, :-1].clone(), d[:, 1:].clone()) for d in data]
        for schedule in SCHEDULES:
            stage = build_stage(_config(args, schedule), groups)
            exclude = {q.untyped_storage().data_ptr() for q in stage.model.parameters()}
            meter = SavedActivationMeter(exclude)
            original, runtime.post = runtime.post, meter.wrap_post(runtime.post)
            try:
                with meter.hooks():
                    result = train_step(stage, mbs, 0)
            finally:
                runtime.post = original
            rows.append({"schedule": schedule, "peak_bytes": meter.peak, "live_after_bytes": meter.live,
                         "saved_tensors": meter.packed, "loss": result.loss,
                         "peak_with_sent_bytes": meter.peak_with_sends, "peak_sent_alive_bytes": meter.peak_sent_only})
        per_rank = pc.all_gather_object(rows, groups.world)
    finally:
        torch.distributed.destroy_process_group()
    return {"per_rank": per_rank}


def _summary(per_rank: list[list[dict]], p: int, m: int) -> list[dict]:
    out = []
    for r, rows in enumerate(per_rank):
        by = {row["schedule"]: row for row in rows}
        gpipe, f1b = by["gpipe"]["peak_bytes"], by["1f1b"]["peak_bytes"]
        per_mb = gpipe / m  # GPipe holds all m microbatches at its peak
        out.append({
            "pp_rank": r, "gpipe_peak_bytes": gpipe, "1f1b_peak_bytes": f1b,
            "ratio_measured": gpipe / f1b, "ratio_expected": m / min(p - r, m),
            "1f1b_peak_in_microbatches": f1b / per_mb, "expected_in_flight_1f1b": min(p - r, m),
            "live_after_step_bytes": {k: by[k]["live_after_bytes"] for k in SCHEDULES},
            "loss": {k: by[k]["loss"] for k in SCHEDULES},
            "peak_with_sent_bytes": {k: by[k]["peak_with_sent_bytes"] for k in SCHEDULES},
            "peak_sent_alive_bytes": {k: by[k]["peak_sent_alive_bytes"] for k in SCHEDULES},
            "saved_bytes_per_microbatch": per_mb,
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    args = ap.parse_args()
    _config(args, "gpipe")  # validate before starting workers

    start = time.perf_counter()
    out = pc.launch(worker, args.pp, args)
    summary = _summary(out["per_rank"], args.pp, args.microbatches)
    report = {
        "benchmark": "activation_memory", "machine": pc.machine(), "pp": args.pp, "microbatches": args.microbatches,
        "model": {"layers": args.num_layers, "hidden": args.hidden_size, "heads": args.num_attention_heads,
                  "seq": args.seq_length, "vocab": args.vocab_size, "micro_batch": args.micro_batch_size},
        "per_rank": summary, "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2))
    mib = 2**20
    rows = [[s["pp_rank"], f"{s['gpipe_peak_bytes'] / mib:.1f}", f"{s['1f1b_peak_bytes'] / mib:.1f}",
             f"**{s['ratio_measured']:.3f}**", f"{s['ratio_expected']:.3f}",
             f"{s['1f1b_peak_in_microbatches']:.3f}", s["expected_in_flight_1f1b"]] for s in summary]
    print()
    print(pc.table(["pp rank", "GPipe peak MiB", "1F1B peak MiB", "GPipe / 1F1B", "expected m / min(p - r, m)",
                    "1F1B peak in microbatches", "expected in flight"], rows))
    rows = [[s["pp_rank"], f"{s['saved_bytes_per_microbatch'] / mib:.2f}"]
            + [f"{s[key][k] / mib:.1f}" for k in SCHEDULES for key in ("peak_sent_alive_bytes", "peak_with_sent_bytes")]
            + [f"{s['peak_with_sent_bytes']['gpipe'] / s['peak_with_sent_bytes']['1f1b']:.3f}"] for s in summary]
    print()
    print(pc.table(["pp rank", "saved MiB per microbatch", "GPipe sent alive MiB", "GPipe saved + sent MiB",
                    "1F1B sent alive MiB", "1F1B saved + sent MiB", "GPipe / 1F1B (saved + sent)"], rows))


if __name__ == "__main__":
    main()
