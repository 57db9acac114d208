"""``ptdp plan --calibrate``: measure this machine and save a hardware profile for the planner.

Measured with the run's own worker count and layout, all workers busy at once (so shared cores
and memory bandwidth are accounted for): GEMM FLOP/s at the exact shapes of the model's layers and
output layer (fitted to the planner's GEMM-efficiency curve: peak and half-dim), the bandwidth of
an elementwise kernel, and the all-reduce time on the tensor-parallel groups (fitted to the ring
model's latency and bandwidth). The step time is then the planner's prediction from these
primitives. The time of one real transformer layer's forward + backward is recorded alongside, as
a reference. Known limit: with more workers than cores, a worker that waits (bubble, transfers)
gives its core to the others, which the planner's one-device-per-worker model does not capture. The profile is a :class:`~ptdp.planner.hardware.GPUSpec` ("local") plus the
:class:`~ptdp.planner.perf.PerfConstants` that go with it, in JSON.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from ptdp import comm
from ptdp.planner.flops import gemm_efficiency, layer_gemms
from ptdp.planner.hardware import GPUSpec
from ptdp.planner.models import ModelSpec
from ptdp.planner.perf import DEFAULT_CONSTANTS, PerfConstants

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def default_profile_path() -> Path:
    """``$PTDP_CACHE_DIR/hardware-profile.json`` (default ``~/.cache/ptdp``)."""
    return Path(os.environ.get("PTDP_CACHE_DIR", "~/.cache/ptdp")).expanduser() / "hardware-profile.json"


def save_profile(path: Path, gpu: GPUSpec, constants: PerfConstants, measurements: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"gpu": dataclasses.asdict(gpu), "constants": dataclasses.asdict(constants), "measurements": measurements}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def load_profile(path: str | Path) -> tuple[GPUSpec, PerfConstants]:
    """The GPU spec and constants saved by ``--calibrate``; ValueError if the file is not one."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        return GPUSpec(**record["gpu"]), PerfConstants(**record["constants"])
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a hardware profile written by `ptdp plan --calibrate` ({e})") from None


def _timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def measure_gemms(model: ModelSpec, tp: int, micro_batch_size: int, vocab_local: int, dtype, sync) -> list[dict]:
    """FLOP/s of each forward GEMM shape of a layer and of the output layer, on this process;
    ``sync()`` lines all workers up before each shape so they all compute at once."""
    shapes = list(layer_gemms(model, tp, micro_batch_size))
    shapes.append((micro_batch_size * model.seq_length, vocab_local, model.hidden_size, 1))
    out = []
    for m, n, k, batch in shapes:
        a, b = torch.randn(batch, m, k, dtype=dtype), torch.randn(batch, k, n, dtype=dtype)
        flops = 2.0 * m * n * k * batch
        reps = max(3, min(2000, int(2e9 / flops)))
        sync()
        seconds = _timed(lambda: torch.bmm(a, b), reps)
        out.append({"m": m, "n": n, "k": k, "batch": batch, "flops_per_s": flops / seconds})
    return out


def measure_bandwidth(sync, numel: int = 1 << 22) -> float:
    """Bytes/s of an in-place add of two float32 tensors (read 2, write 1), all workers at once."""
    x, y = torch.ones(numel), torch.ones(numel)
    sync()
    return 12.0 * numel / _timed(lambda: x.add_(y), 40)


def measure_all_reduce(axis, sizes=(1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22)) -> list[tuple[int, float]]:
    """(bytes, seconds) of float32 all-reduces on ``axis`` (all its groups run concurrently)."""
    out = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        out.append((nbytes, _timed(lambda: comm.all_reduce(t, axis, tag="calibrate"), 10)))
    return out


def measure_layer(config, tp_axis, dtype, sync) -> float:
    """Seconds of forward + backward of one real ptdp transformer layer (its TP communication
    included) for one microbatch, all workers at once."""
    from ptdp.model.gpt import TransformerLayer

    m, t = config.model, config.train
    layer = TransformerLayer(m, tp_axis, dtype)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=m.init_method_std)
    x = torch.randn(t.micro_batch_size, m.seq_length, m.hidden_size, dtype=dtype, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()

    sync()
    return _timed(step, 20)


def fit_gemm_curve(samples: list[dict]) -> tuple[float, float]:
    """(peak FLOP/s, half_dim) so that peak * prod(x/(x+half_dim)) best fits the samples (log LSQ)."""
    best = None
    for half_dim in [0.0] + [2.0 ** (i / 4) for i in range(0, 36)]:
        logs = [math.log(s["flops_per_s"]) - math.log(gemm_efficiency(s["m"], s["n"], s["k"], peak_fraction=1.0,
                                                                      half_dim=half_dim)) for s in samples]
        log_peak = sum(logs) / len(logs)
        err = sum((x - log_peak) ** 2 for x in logs)
        if best is None or err < best[0]:
            best = (err, math.exp(log_peak), half_dim)
    return best[1], best[2]


def fit_ring(samples: list[tuple[int, float]], group_size: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s per ring step) of ``t = 2(g-1) lat + 2(g-1)/g * bytes / bw``."""
    xs, ys = [float(n) for n, _ in samples], [t for _, t in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(my - slope * mx, 0.0)
    steps = 2.0 * (group_size - 1)
    return steps / group_size / max(slope, 1e-30), intercept / steps


def build_profile(per_rank: list[dict], nproc: int, tp: int, precision: str) -> tuple[GPUSpec, PerfConstants, dict]:
    """Combine every rank's measurements (medians) into the profile. ``layer_s`` (one real layer's
    forward + backward with its TP communication) is kept as a reference measurement."""
    gemms = [dict(g, flops_per_s=statistics.median(r["gemms"][i]["flops_per_s"] for r in per_rank))
             for i, g in enumerate(per_rank[0]["gemms"])]
    peak, half_dim = fit_gemm_curve(gemms)
    bandwidth = statistics.median(r["bandwidth"] for r in per_rank)
    reduce = [(n, statistics.median(r["all_reduce"][i][1] for r in per_rank)) for i, (n, _) in
              enumerate(per_rank[0]["all_reduce"])]
    link_bw, latency = fit_ring(reduce, tp) if tp > 1 else (bandwidth, 0.0)
    layer_s = statistics.median(r["layer_s"] for r in per_rank)
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = GPUSpec(
        name="local", peak_flops={precision: peak}, memory_bytes=total_memory / nproc, memory_bandwidth=bandwidth,
        nvlink_bandwidth=link_bw, network_bandwidth=link_bw, gpus_per_node=nproc,
        source=f"ptdp plan --calibrate on {platform.node()} ({platform.processor() or platform.machine()}, "
               f"{len(os.sched_getaffinity(0))} cores, {nproc} workers) {datetime.date.today().isoformat()}",
    )
    constants = dataclasses.replace(
        DEFAULT_CONSTANTS, gemm_peak_fraction=1.0, gemm_half_dim=half_dim, hbm_efficiency=1.0,
        nvlink_efficiency=1.0, network_efficiency=1.0, nvlink_latency=latency, network_latency=latency,
        pp_scatter_gather=False,
    )
    measured = {"gemms": gemms, "add_bandwidth": bandwidth, "all_reduce": reduce, "layer_s": layer_s,
                "fitted": {"peak_flops": peak, "gemm_half_dim": half_dim, "link_bandwidth": link_bw,
                           "link_latency": latency}}
    return gpu, constants, measured


def calibrate_worker(config_json: str, precision: str, out_path: str) -> dict:
    """One worker of ``ptdp plan --calibrate`` (started by the elastic launcher)."""
    import torch.distributed as dist

    from ptdp.config import Config, padded_vocab_size
    from ptdp.distributed import init_distributed
    from ptdp.groups import ParallelGroups
    from ptdp.layout import ParallelLayout
    from ptdp.planner.models import spec_from_model_config

    config = Config.from_dict(json.loads(config_json))
    p, m = config.parallel, config.model
    init_distributed(p.distributed_timeout_minutes)
    try:
        groups = ParallelGroups.build(ParallelLayout(p.tp, p.pp, p.dp),
                                      datetime.timedelta(minutes=p.distributed_timeout_minutes))
        spec = spec_from_model_config(m)
        vocab_local = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp) // p.tp
        flag = torch.zeros(1)

        def sync() -> None:
            comm.all_reduce(flag, groups.world, tag="calibrate")

        mine = {
            "gemms": measure_gemms(spec, p.tp, config.train.micro_batch_size, vocab_local,
                                   PRECISION_DTYPES[precision], sync),
            "bandwidth": measure_bandwidth(sync),
            "all_reduce": measure_all_reduce(groups.tp),
            "layer_s": measure_layer(config, groups.tp, PRECISION_DTYPES[precision], sync),
        }
        per_rank = comm.all_gather_object(mine, groups.world)
        if groups.global_rank == 0:
            gpu, constants, measured = build_profile(per_rank, config.world_size, p.tp, precision)
            save_profile(Path(out_path), gpu, constants, measured)
            return {"gpu": dataclasses.asdict(gpu), "constants": dataclasses.asdict(constants)}
        return {}
    finally:
        dist.destroy_process_group()
