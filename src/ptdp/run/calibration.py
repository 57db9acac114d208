"""``ptdp plan --calibrate``: measure this machine and save a hardware profile for the planner
(a :class:`~ptdp.planner.inputs.hardware.GPUType` "local" plus its
:class:`~ptdp.planner.time.constants.PerfConstants`, in JSON; format :mod:`ptdp.planner.time.profile`).

Runs with the run's own worker count and layout; each primitive is timed by the workers that need
it while the others wait: GEMM FLOP/s at the model's exact shapes (fitted to peak and half-dim),
elementwise bandwidth, and tp-group all-reduce times (fitted to the ring model's latency and
bandwidth; fits in :mod:`ptdp.planner.time.profile_fit`). One real transformer layer and output
layer + loss are timed too; their excess over the primitives' prediction is the per-layer host
overhead (``layer_overhead``, ``head_overhead``). For mixture-of-experts layers: all-to-alls over
every worker as the dispatcher sends its rows (``moe_exchange_efficiency``: the fitted links'
share they reach) and a rank's experts' forward GEMMs as :mod:`ptdp.engine.moe.experts` runs them,
one ``torch._grouped_mm`` per linear layer where supported, else the loop
(``moe_grouped_gemm_efficiency``: the fitted GEMM roofline's share; one GEMM of the same work is
recorded beside it). On CPU the profile records how many cores the
workers share (:func:`ptdp.planner.time.step_time.core_shared_step`). On GPU each worker measures
on its own device with CUDA events, NCCL collectives and GPU-sized tensors (all-reduces up to
256 MiB), with a gloo group for barriers and results.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ptdp.config.model import ModelConfig
from ptdp.engine import comm
from ptdp.engine.moe.expert_linear import expert_linear, grouped_supported
from ptdp.planner.time.flops import layer_gemms
from ptdp.planner.time.profile import save_profile
from ptdp.planner.time.profile_fit import build_profile

__all__ = [
    "PRECISION_DTYPES",
    "calibrate_worker",
    "expert_gemm_shapes",
    "measure_all_reduce",
    "measure_all_to_all",
    "measure_bandwidth",
    "measure_gemms",
    "measure_grouped_gemm",
    "measure_head",
    "measure_layer",
    "measure_optimizer",
    "measure_p2p",
]

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _timed(fn, reps: int, device: torch.device | None = None) -> float:
    """Seconds per call of ``fn`` after one warm-up call: CUDA events recorded on the current
    stream around the ``reps`` calls on a CUDA ``device`` (one host synchronisation, at the end),
    the host clock otherwise."""
    fn()
    if device is not None and device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps  # elapsed_time is in milliseconds
    start_s = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start_s) / reps


def _on_gpu(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"


#: FLOPs of the repetitions of one GEMM shape: a fraction of a second on a CPU core or a GPU
_GEMM_FLOP_BUDGET = {"cpu": 2e9, "cuda": 2e12}
_CPU_SIZES = (1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22)
_GPU_SIZES = (1 << 16, 1 << 20, 1 << 23, 1 << 26, 1 << 28)


def measure_gemms(
    model: ModelConfig, tp: int, micro_batch_size: int, vocab_local: int, dtype, device: torch.device | None = None
) -> list[dict]:
    """FLOP/s of each forward GEMM shape of a layer and of the output layer, on this process's device."""
    shapes = list(layer_gemms(model, tp, micro_batch_size))
    shapes.append((micro_batch_size * model.seq_length, vocab_local, model.hidden_size, 1))
    budget = _GEMM_FLOP_BUDGET["cuda" if _on_gpu(device) else "cpu"]
    out = []
    for m, n, k, batch in shapes:
        a = torch.randn(batch, m, k, dtype=dtype, device=device)
        b = torch.randn(batch, k, n, dtype=dtype, device=device)
        flops = 2.0 * m * n * k * batch
        reps = max(3, min(2000, int(budget / flops)))
        seconds = _timed(lambda: torch.bmm(a, b), reps, device)
        out.append({"m": m, "n": n, "k": k, "batch": batch, "flops_per_s": flops / seconds})
    return out


def measure_bandwidth(numel: int | None = None, device: torch.device | None = None) -> float:
    """Bytes/s of an in-place add of two float32 tensors (read 2, write 1); ``numel`` defaults to
    4 Mi elements on a CPU and 128 Mi (512 MiB per tensor, beyond any L2 cache) on a GPU."""
    numel = numel or (1 << 27 if _on_gpu(device) else 1 << 22)
    x, y = torch.ones(numel, device=device), torch.ones(numel, device=device)
    return 12.0 * numel / _timed(lambda: x.add_(y), 40, device)


def measure_all_reduce(axis, sizes=None, device: torch.device | None = None) -> list[tuple[int, float]]:
    """(bytes, seconds) of float32 all-reduces on ``axis`` (all its groups run concurrently), of
    tensors on ``device`` (NCCL on GPUs); ``sizes`` default to 4 KiB-4 MiB on CPUs, 64 KiB-256 MiB
    on GPUs."""
    out = []
    for nbytes in sizes or (_GPU_SIZES if _on_gpu(device) else _CPU_SIZES):
        t = torch.ones(nbytes // 4, device=device)
        out.append((nbytes, _timed(lambda: comm.all_reduce(t, axis, tag="calibrate"), 10, device)))
    return out


def measure_all_to_all(axis, sizes=None, device: torch.device | None = None) -> list[tuple[int, float]]:
    """(bytes, seconds) of float32 all-to-alls over ``axis`` by :func:`ptdp.engine.comm.all_to_all`,
    the MoE dispatcher's exchange: each rank sends ``bytes``, an equal share to every rank of
    ``axis`` (its own included). Sizes as :func:`measure_all_reduce`."""
    out, g = [], axis.size
    for nbytes in sizes or (_GPU_SIZES if _on_gpu(device) else _CPU_SIZES):
        rows = max(1, nbytes // 4 // g)
        t, splits = torch.ones(g * rows, device=device), [rows] * g
        seconds = _timed(
            lambda: comm.all_to_all(t, axis, in_splits=splits, out_splits=splits, tag="calibrate"), 10, device
        )
        out.append((4 * g * rows, seconds))
    return out


#: experts per rank at which the grouped GEMM is measured (:func:`expert_gemm_shapes`)
_EXPERTS = (2, 8, 32)


def expert_gemm_shapes(model: ModelConfig, micro_batch_size: int) -> list[tuple[int, int, int, int]]:
    """``(experts, rows per expert, h, F)`` of the grouped-GEMM measurements: :data:`_EXPERTS`
    experts of the model's widths sharing the ``2 b s`` rows of top-2 routing (16 at least each)."""
    rows = 2 * micro_batch_size * model.seq_length
    return [(e, max(16, rows // e), model.hidden_size, model.ffn) for e in _EXPERTS]


def measure_grouped_gemm(
    shapes: list[tuple[int, int, int, int]], dtype, device: torch.device | None = None
) -> list[dict]:
    """Per ``(E, rows, h, F)`` shape, seconds of a rank's experts' forward GEMMs as
    :class:`ptdp.engine.moe.experts.Experts` runs them: ``[E rows, h]`` sorted by expert times fc1
    ``[E, F, h]``, then ``[E rows, F]`` times fc2 ``[E, h, F]`` (:func:`expert_linear`: one
    ``torch._grouped_mm`` each where it takes the operands and runs on this device, ``grouped``;
    else the loop), and ``one_gemm_s``: the same work as one ``[E rows, h] x [h, F]`` and one
    ``[E rows, F] x [F, h]`` GEMM."""
    budget = _GEMM_FLOP_BUDGET["cuda" if _on_gpu(device) else "cpu"]
    out = []
    for e, rows, h, f in shapes:
        x = torch.randn(e * rows, h, dtype=dtype, device=device)
        fc1 = torch.randn(e, f, h, dtype=dtype, device=device)
        fc2 = torch.randn(e, h, f, dtype=dtype, device=device)
        w1, w2 = fc1[0].contiguous(), fc2[0].contiguous()
        counts, splits = torch.full((e,), rows, dtype=torch.int64, device=device), [rows] * e

        def experts(grouped: bool) -> torch.Tensor:
            y = expert_linear(x, fc1, counts, splits, grouped)
            return expert_linear(y, fc2, counts, splits, grouped)

        grouped = grouped_supported(x, fc1) and grouped_supported(x.new_empty(1, f), fc2)
        reps = max(3, min(200, int(budget / (4.0 * e * rows * h * f))))
        with torch.no_grad():
            if grouped:
                try:  # a GPU without the kernel (its architecture or dtype) runs the loop
                    experts(True)
                except RuntimeError:
                    grouped = False
            grouped_s = _timed(lambda: experts(grouped), reps, device)
            one_s = _timed(lambda: (x @ w1.t()) @ w2.t(), reps, device)
        out.append(
            {
                "experts": e,
                "rows": rows,
                "hidden": h,
                "ffn": f,
                "seconds": grouped_s,
                "one_gemm_s": one_s,
                "grouped": grouped,
            }
        )
    return out


def measure_p2p(pp_axis, sizes=None, device: torch.device | None = None) -> list[tuple[int, float]]:
    """(bytes, seconds) of one float32 transfer between pipeline ranks 0 and 1 of ``pp_axis``
    (half a ping-pong round trip); only those two ranks call it. Sizes as :func:`measure_all_reduce`."""
    out, peer = [], 1 - pp_axis.rank
    for nbytes in sizes or (_GPU_SIZES if _on_gpu(device) else _CPU_SIZES):
        t = torch.ones(nbytes // 4, device=device)

        def round_trip() -> None:
            for kind in ("send", "recv") if pp_axis.rank == 0 else ("recv", "send"):
                for work in comm.post([comm.P2P(kind, t, peer)], pp_axis, tag="calibrate") or []:
                    work.wait()

        out.append((nbytes, _timed(round_trip, 10, device) / 2.0))
    return out


def measure_optimizer(config, tp_axis, dtype, device: torch.device | None = None) -> tuple[int, float]:
    """(parameters, seconds) of one optimizer step of the first pipeline stage on this rank, as
    ``ptdp train`` does it: the gradient norm (``torch._foreach_norm``), AdamW, zeroing the grads."""
    from ptdp.engine.model.gpt import GPTModel

    m, p, t = config.model, config.parallel, config.train
    stage = GPTModel(m, tp_axis, layer_ids=range(m.num_layers // p.pp), pre_process=True, post_process=p.pp == 1).to(
        device
    )
    params = list(stage.parameters())
    for q in params:
        q.grad = torch.randn_like(q)
    groups = [
        {"params": [q for q in params if q.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4)
    grads = [q.grad for q in params if q.grad is not None]  # every one, set above

    def step() -> None:
        torch.stack(torch._foreach_norm(grads)).square().sum()
        optimizer.step()
        torch._foreach_zero_(grads)

    return sum(q.numel() for q in params), _timed(step, 10, device)


def _init_normal(module, std: float) -> None:
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)


def measure_layer(config, tp_axis, dtype, device: torch.device | None = None) -> float:
    """Seconds of forward + backward of one real ptdp transformer layer (its TP communication
    included) for one microbatch."""
    from ptdp.engine.model.layer import TransformerLayer

    m, t = config.model, config.train
    layer = TransformerLayer(m, tp_axis, dtype).to(device)
    _init_normal(layer, m.init_method_std)
    x = torch.randn(m.seq_length, t.micro_batch_size, m.hidden_size, dtype=dtype, device=device, requires_grad=True)
    return _timed(lambda: layer(x).sum().backward(), 20, device)


def measure_head(config, tp_axis, dtype, device: torch.device | None = None) -> float:
    """Seconds of forward + backward of the real last-stage head (final LayerNorm, output layer,
    vocab-parallel cross entropy, its TP communication included) for one microbatch."""
    from ptdp.engine.model.gpt import GPTModel

    m, t = config.model, config.train
    head = GPTModel(m, tp_axis, layer_ids=range(0), pre_process=False, post_process=True).to(device)
    _init_normal(head, m.init_method_std)
    x = torch.randn(m.seq_length, t.micro_batch_size, m.hidden_size, dtype=dtype, device=device, requires_grad=True)
    labels = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length), device=device)
    return _timed(lambda: head(x, labels).backward(), 20, device)


def _measure(groups, host, config, precision: str, device: torch.device | None = None) -> dict:
    """This rank's measurements on ``device``; each phase is taken by the ranks that need it while
    the others wait on a barrier of the gloo group ``host``: rank 0 alone (GEMMs, bandwidth,
    optimizer, experts' GEMMs), tensor-parallel group 0 (all-reduce, layer, head), data-parallel
    group 0 (all-reduce), pipeline ranks 0 and 1 of pipeline group 0 (ping-pong), every rank
    (all-to-all over the world)."""
    from ptdp.layout.vocab import padded_vocab_size

    p, m, dtype = config.parallel, config.model, PRECISION_DTYPES[precision]
    rank = groups.global_rank
    mine: dict[str, Any] = {}

    def barrier() -> None:
        comm.barrier(host)

    if rank == 0:
        vocab_local = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp) // p.tp
        mine["gemms"] = measure_gemms(m, p.tp, config.train.micro_batch_size, vocab_local, dtype, device)
        mine["bandwidth"] = measure_bandwidth(device=device)
        mine["optimizer"] = measure_optimizer(config, groups.tp, dtype, device)
        mine["grouped_gemm"] = measure_grouped_gemm(expert_gemm_shapes(m, config.train.micro_batch_size), dtype, device)
    barrier()
    if rank < p.tp:  # tensor-parallel group 0
        mine.update(
            tp_all_reduce=measure_all_reduce(groups.tp, device=device) if p.tp > 1 else [],
            layer_s=measure_layer(config, groups.tp, dtype, device),
            head_s=measure_head(config, groups.tp, dtype, device),
        )
    barrier()
    if p.dp > 1 and rank % p.tp == 0 and rank < p.tp * p.dp:  # data-parallel group 0
        mine["dp_all_reduce"] = measure_all_reduce(groups.dp, device=device)
    barrier()
    if p.pp > 1 and rank in (0, p.tp * p.dp):  # pipeline ranks 0 and 1 of pipeline group 0
        mine["p2p"] = measure_p2p(groups.pp, device=device)
    barrier()
    if groups.world.size > 1:
        mine["all_to_all"] = measure_all_to_all(groups.world, device=device)
    barrier()
    return mine


def _combine(per_rank: list[dict], config, cores: int) -> dict:
    """Rank 0's view of everything measured. Times of a group larger than the cores are scaled by
    cores / group size: while it measured, its workers shared the cores, and the planner wants the
    CPU time of one worker. ``cores`` 0: GPUs, nothing shared, nothing scaled."""
    p = config.parallel
    out = dict(per_rank[0])
    group_ranks = {"tp_all_reduce": list(range(p.tp)), "dp_all_reduce": [d * p.tp for d in range(p.dp)]}
    sizes = {"tp_all_reduce": p.tp, "dp_all_reduce": p.dp}
    out["all_reduce"] = []
    for key, ranks in group_ranks.items():
        if not per_rank[0].get(key):
            continue
        share = min(1.0, cores / sizes[key]) if cores else 1.0
        for i, (n, _) in enumerate(per_rank[0][key]):
            out["all_reduce"].append((sizes[key], n, share * statistics.median(per_rank[r][key][i][1] for r in ranks)))
    share = min(1.0, cores / p.tp) if cores else 1.0
    for key in ("layer_s", "head_s"):
        out[key] = share * statistics.median(per_rank[r][key] for r in range(p.tp))
    if p.pp > 1:
        out["p2p"] = per_rank[p.tp * p.dp]["p2p"]
    if per_rank[0].get("all_to_all"):  # the world's: (group, bytes, seconds)
        world = len(per_rank)
        share = min(1.0, cores / world) if cores else 1.0
        out["all_to_all"] = [
            (world, n, share * statistics.median(r["all_to_all"][i][1] for r in per_rank))
            for i, (n, _) in enumerate(per_rank[0]["all_to_all"])
        ]
    return out


def calibrate_worker(config_json: str, precision: str, out_path: str) -> dict:
    """One worker of ``ptdp plan --calibrate`` (started by the elastic launcher); rank 0 writes the
    profile to ``out_path`` and returns its GPU spec and constants (the others return {})."""
    import torch.distributed as dist

    from ptdp.config.resolve import resolve
    from ptdp.config.schema import Config
    from ptdp.engine.groups import ParallelGroups, host_group
    from ptdp.layout.grid import ParallelLayout
    from ptdp.run.distributed import init_distributed

    config = resolve(Config.from_dict(json.loads(config_json)), int(os.environ.get("WORLD_SIZE", "1")))
    p = config.parallel
    device = init_distributed(p.distributed_timeout_minutes)
    try:
        timeout = datetime.timedelta(minutes=p.distributed_timeout_minutes)
        groups = ParallelGroups.build(ParallelLayout(p.tp, p.pp, p.dp), timeout)
        host = host_group(timeout)  # gloo: barriers and the results stay on the CPU
        per_rank = comm.all_gather_object(_measure(groups, host, config, precision, device), host)
        if groups.global_rank != 0:
            return {}
        gpu_info = None
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            gpu_info = {"name": props.name, "memory_bytes": props.total_memory}
        cores = 0 if gpu_info else len(os.sched_getaffinity(0))
        gpu, constants, measured = build_profile(_combine(per_rank, config, cores), config, precision, cores, gpu_info)
        save_profile(Path(out_path), gpu, constants, measured)
        return {"gpu": dataclasses.asdict(gpu), "constants": dataclasses.asdict(constants)}
    finally:
        dist.destroy_process_group()
