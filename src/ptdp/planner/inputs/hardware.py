"""GPU and cluster catalog for the planner: peak FLOP/s, memory, and link bandwidths.

All bandwidths are bytes per second *per GPU and per direction*; capacities are bytes; peaks are
dense (no sparsity) FLOP/s. Each figure cites its datasheet. Users add or override GPUs with a
TOML or JSON file (:func:`load_catalog`) whose tables have the fields of :class:`GPUType`.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli (a dependency there)
    import tomli as tomllib

GiB = 1024**3
GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class GPUType:
    """One GPU model as deployed in a typical node.

    Attributes:
        name: catalog key, e.g. ``a100-80gb``.
        peak_flops: dense peak FLOP/s per precision ("bf16", "fp16", "fp8", "tf32", "fp32").
        memory_bytes: HBM capacity usable by a process (bytes).
        memory_bandwidth: HBM bandwidth (bytes/s).
        nvlink_bandwidth: NVLink bandwidth per GPU per direction (bytes/s); 0 for PCIe-only.
        network_bandwidth: inter-node bandwidth per GPU per direction (bytes/s), e.g. one HDR
            200 Gb/s InfiniBand port per GPU = 25e9.
        gpus_per_node: GPUs in one node (one NVLink domain).
        gpus_per_host: GPUs of one host (its board, CPUs and NICs) where a host is less than the
            NVLink domain: 4 in a GB200 / GB300 NVL72 compute tray, whose NVLink spans the rack's 72
            GPUs; 0: a host is the whole domain (HGX and DGX nodes). A cluster is whole hosts, so its
            last NVLink domain may be part of one (256 GPUs: 3 racks and 40 GPUs of a fourth).
        source: where the figures come from.
        shared_cores: 0 for real accelerators (one device per worker). For a CPU "device"
            (``ptdp plan --calibrate``): the number of CPU cores the node's workers share; the
            rates above are then those of one worker running alone on a core.
        arch: GPU architecture ("ampere", "hopper", ...): selects the time model's fitted
            efficiencies for that generation (:meth:`ptdp.planner.time.constants.PerfConstants.for_gpu`);
            "" (and any architecture without its own fit) uses the constants as given.
        power_limit: board power limit the GPU runs at (W; ``nvidia-smi -pl``); 0: the rating of its
            datasheet peaks (the last of ``power_peaks``).
        power_peaks: ``(watts, fraction of the datasheet tensor-core peaks)`` ratings of the same chip
            at other power limits, ascending in watts, the last at 1.0; the peaks sustained at
            ``power_limit`` are interpolated linearly in power between them (:meth:`power_fraction`).
            Empty: no other rating known, and no other power limit can be planned.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float
    gpus_per_node: int = 8
    source: str = ""
    gpus_per_host: int = 0
    shared_cores: int = 0
    arch: str = ""
    power_limit: float = 0.0
    power_peaks: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:  # a catalog file holds lists
        rule = (
            f"power_peaks={self.power_peaks!r} must be [watts, fraction] pairs of numbers, ascending in "
            "watts > 0, fractions in (0, 1], the last 1.0 (the datasheet's rating)"
        )

        def number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        pairs = [p for p in self.power_peaks if isinstance(p, (list, tuple)) and len(p) == 2]
        if len(pairs) != len(self.power_peaks) or not all(number(w) and number(f) for w, f in pairs):
            raise ValueError(rule)
        points = tuple((float(w), float(f)) for w, f in pairs)
        watts = [w for w, _ in points]
        if points and (
            watts != sorted(set(watts))
            or watts[0] <= 0
            or points[-1][1] != 1.0
            or any(not 0 < f <= 1 for _, f in points)
        ):
            raise ValueError(rule)
        object.__setattr__(self, "power_peaks", points)
        if not number(self.power_limit) or self.power_limit < 0:
            raise ValueError(f"power_limit={self.power_limit!r} must be a number of watts (0: the datasheet's rating)")
        if self.power_limit:
            self.power_fraction()  # checks the limit against the ratings

    def power_fraction(self) -> float:
        """Fraction of the datasheet tensor-core peaks sustained at :attr:`power_limit`: 1 at the
        datasheet's rating, else interpolated linearly in watts between the two :attr:`power_peaks`
        around it. ValueError for a limit outside them or a GPU without them."""
        if not self.power_limit:
            return 1.0
        points, watts = self.power_peaks, self.power_limit
        if not points:
            raise ValueError(
                f"{self.name}: no power ratings in the catalog to plan a {watts:g} W limit from (add power_peaks "
                "with --gpu-catalog FILE)"
            )
        low, high = points[0][0], points[-1][0]
        if not low <= watts <= high:
            raise ValueError(
                f"{self.name}: a power limit of {watts:.10g} W is outside its ratings, {low:g}-{high:g} W "
                f"(rule: {low:g} <= power limit <= {high:g})"
            )
        for (w0, f0), (w1, f1) in zip(points, points[1:]):
            if w0 <= watts <= w1:
                return f0 + (f1 - f0) * (watts - w0) / (w1 - w0)
        return points[-1][1]  # one rating: the limit is it

    def sustained_peak(self, precision: str) -> float:
        """:meth:`peak` at :attr:`power_limit` (:meth:`power_fraction`): what the time model runs at."""
        return self.peak(precision) * self.power_fraction()

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ValueError(
                f"{self.name} has no peak for precision {precision!r}; known: {', '.join(sorted(self.peak_flops))}"
            )
        return self.peak_flops[precision]


# NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS BF16/FP16 dense, 156 TF32, 19.5 FP32;
# 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s (SXM); NVLink 3 600 GB/s bidirectional.
# DGX A100 user guide: 8 GPUs, 8 x 200 Gb/s HDR InfiniBand compute ports (one per GPU).
_A100_PEAK = {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS}
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989.5 TFLOPS BF16/FP16 dense (1,979 with sparsity),
# FP8 1,979 dense, 494.7 TF32, 66.9 FP32; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s bidirectional.
# DGX H100: 8 x 400 Gb/s NDR InfiniBand (ConnectX-7), one per GPU. Restated by
# glennklockwood.com/garden/processors/h100 and the Llama 3 paper (arXiv:2407.21783, §3.3.1).
# NVLink 4 as reached: NVIDIA/nccl issue 1264, p2pBandwidthLatencyTest 380 of 450 GB/s per direction.
_H100_PEAK = {
    "bf16": 989.5 * TFLOPS,
    "fp16": 989.5 * TFLOPS,
    "fp8": 1979 * TFLOPS,
    "tf32": 494.7 * TFLOPS,
    "fp32": 66.9 * TFLOPS,
}
# The same GH100 chip rated at two power limits: H100 NVL, 835 TFLOPS BF16 dense at up to 400 W
# (NVIDIA H100 datasheet, NVL column; torchtitan's get_peak_flops uses the same 835e12), and the
# SXM5 part, 989.5 at 700 W. A part limited between them (Meta's 500 W H100s: "between SXM and
# NVL", pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md) is interpolated in watts.
_H100_POWER = ((400.0, 835.0 / 989.5), (700.0, 1.0))

# Blackwell. Tensor-core peaks are dense: NVIDIA's datasheets give them with 2:4 sparsity, "one-half
# lower without sparsity". FP4 is left out (the planner plans no FP4 GEMMs), and TF32/FP32 too (the
# sources differ on them). Memory: what nvidia-smi reports (memory.total), collected from public
# nvidia-smi logs. NVLink 5: 1.8 TB/s per GPU, 900 GB/s per direction.
# HGX / DGX B200 datasheet (8 GPUs, 1,000 W each): FP16/BF16 36 PFLOPS and FP8 72 PFLOPS with
# sparsity, 1.4 TB HBM3e (180 GB per GPU) at 64 TB/s; DGX B200: 8 x 400 Gb/s ConnectX-7, one per GPU
# (also mlcommons/inference_results_v6.0 Nebius B200-SXM-180GB: "8x ConnectX-7 IB NDR 400Gb/s").
# Per GPU restated by glennklockwood.com/garden/processors/B200 (HGX B200 at 1,000 W: 2,250 BF16,
# 4,500 FP8 dense). nvidia-smi: "NVIDIA B200, 183359 MiB". The bus width CUDA reports gives 7.68 TB/s
# (pytorch/ao PR 4002); the datasheet's 8 TB/s is kept, hbm_efficiency being fitted.
_B200_PEAK = {"bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS, "fp8": 4500 * TFLOPS}
# GB200 NVL72 datasheet (72 GPUs, 1,200 W each): FP16/BF16 360 PFLOPS and FP8 720 PFLOPS with
# sparsity, 576 TB/s HBM3e, one 130 TB/s NVLink domain over the rack; 18 compute trays of 4 GPUs.
# glennklockwood.com (GB200's B200 at 1,200 W: 2,500 BF16, 5,000 FP8 dense). Network: one
# ConnectX-7 400 Gb/s per GPU (mlcommons/inference_results_v6.1 Crusoe GB200-NVL72: "4x ... ConnectX-7"
# per 4-GPU node). nvidia-smi: "NVIDIA GB200 ... 189471MiB ... 1200W".
_GB200_PEAK = {"bf16": 2500 * TFLOPS, "fp16": 2500 * TFLOPS, "fp8": 5000 * TFLOPS}
# HGX / DGX B300 datasheet (Blackwell Ultra, 8 GPUs): FP16/BF16 36 PFLOPS and FP8 72 PFLOPS with
# sparsity (B200's), 2.3 TB HBM3e (288 GB per GPU), 8 TB/s per GPU, NVLink 1.8 TB/s per GPU,
# networking 1.6 TB/s (8 x 800 Gb/s ConnectX-8). Per GPU: glennklockwood.com/garden/processors/B300
# (2,250 BF16, 4,500 FP8 dense; only FP4 grew). nvidia-smi: "NVIDIA B300 SXM6 AC ... 275040MiB ... 1100W".
_B300_PEAK = _B200_PEAK
# GB300 NVL72 datasheet (72 Blackwell Ultra GPUs, 1,400 W each): FP16/BF16 360 PFLOPS and FP8 720
# PFLOPS with sparsity (GB200's), up to 20 TB HBM3e (288 GB per GPU) at 576 TB/s, 130 TB/s NVLink over
# the rack, 72 ConnectX-8 SuperNICs at 800 Gb/s; compute trays of 4 GPUs (glennklockwood.com B300
# page). nvidia-smi: "NVIDIA GB300 ... 284208MiB ... 1400W".
_GB300_PEAK = _GB200_PEAK

CATALOG: dict[str, GPUType] = {
    "a100-40gb": GPUType(
        "a100-40gb",
        _A100_PEAK,
        40 * GiB,
        1555 * GB,
        300 * GB,
        25 * GB,
        8,
        "NVIDIA A100 datasheet (SXM4 40GB); DGX A100 HDR 200 Gb/s per GPU",
        arch="ampere",
    ),
    "a100-80gb": GPUType(
        "a100-80gb",
        _A100_PEAK,
        80 * GiB,
        2039 * GB,
        300 * GB,
        25 * GB,
        8,
        "NVIDIA A100 datasheet (SXM4 80GB); DGX A100 HDR 200 Gb/s per GPU",
        arch="ampere",
    ),
    # nvidia-smi reports 81,559 MiB for "NVIDIA H100 80GB HBM3" (e.g. NVIDIA/nccl and
    # pytorch/pytorch issue logs); the A100 80GB reports 81,920 MiB, 80 GiB exactly.
    "h100-sxm": GPUType(
        "h100-sxm",
        _H100_PEAK,
        81559 * 2**20,
        3350 * GB,
        450 * GB,
        50 * GB,
        8,
        "NVIDIA H100 datasheet (SXM5 80GB); DGX H100 NDR 400 Gb/s per GPU",
        arch="hopper",
        power_peaks=_H100_POWER,
    ),
    # The H100 of Meta's Grand Teton hosts that torchtitan's benchmark files ran on
    # (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s,
    # 500 W ("the default 500W power limit"), 8 per host on NVLink, 400 Gb/s RDMA per GPU. The SXM
    # H100's peaks at that limit (_H100_POWER); 96 GB read as 96e9 bytes, the lower reading.
    "h100-96gb": GPUType(
        "h100-96gb",
        _H100_PEAK,
        96 * GB,
        2400 * GB,
        450 * GB,
        50 * GB,
        8,
        "torchtitan benchmarks: Grand Teton H100 96 GB HBM2e, 500 W; 400 Gb/s per GPU",
        arch="hopper",
        power_limit=500.0,
        power_peaks=_H100_POWER,
    ),
    # NVIDIA H200 datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; nvidia-smi
    # reports 143,771 MiB. Also NVIDIA's MLPerf Inference v4.1 system description H200-SXM-141GBx8
    # (mlcommons/inference_results_v4.1, closed/NVIDIA/systems).
    "h200": GPUType(
        "h200",
        _H100_PEAK,
        143771 * 2**20,
        4800 * GB,
        450 * GB,
        50 * GB,
        8,
        "NVIDIA H200 datasheet (SXM 141GB); NDR 400 Gb/s per GPU",
        arch="hopper",
    ),
    # H800 SXM5, the export H100 that trained DeepSeek-V3: H100's compute and 80 GB HBM3 with NVLink
    # at 400 GB/s bidirectional (NVIDIA H800 product brief); DeepSeek-V3 report (arXiv:2412.19437,
    # §3.1-3.2.2): 8 GPUs per node, 400 Gb/s InfiniBand per GPU ("IB (50 GB/s)").
    "h800": GPUType(
        "h800",
        _H100_PEAK,
        81559 * 2**20,
        3350 * GB,
        200 * GB,
        50 * GB,
        8,
        "NVIDIA H800 SXM5 (H100 compute, NVLink 400 GB/s); DeepSeek-V3 report: IB 50 GB/s per GPU",
        arch="hopper",
    ),
    # NVIDIA V100 datasheet (SXM2 32GB): 125 TFLOPS FP16 tensor, 15.7 FP32; HBM2 900 GB/s;
    # NVLink 2 300 GB/s bidirectional. DGX-1V: 4 x 100 Gb/s EDR InfiniBand for 8 GPUs.
    "v100-32gb": GPUType(
        "v100-32gb",
        {"fp16": 125 * TFLOPS, "fp32": 15.7 * TFLOPS},
        32 * GiB,
        900 * GB,
        150 * GB,
        6.25 * GB,
        8,
        "NVIDIA V100 datasheet (SXM2 32GB); DGX-1V 4 x EDR 100 Gb/s",
        arch="volta",
    ),
    "b200": GPUType(
        "b200",
        _B200_PEAK,
        183359 * 2**20,
        8000 * GB,
        900 * GB,
        50 * GB,
        8,
        "NVIDIA HGX/DGX B200 datasheet (1,000 W); 400 Gb/s ConnectX-7 per GPU",
        arch="blackwell",
    ),
    "gb200": GPUType(
        "gb200",
        _GB200_PEAK,
        189471 * 2**20,
        8000 * GB,
        900 * GB,
        50 * GB,
        72,
        "NVIDIA GB200 NVL72 datasheet (1,200 W); 400 Gb/s ConnectX-7 per GPU",
        gpus_per_host=4,
        arch="blackwell",
    ),
    "b300": GPUType(
        "b300",
        _B300_PEAK,
        275040 * 2**20,
        8000 * GB,
        900 * GB,
        100 * GB,
        8,
        "NVIDIA HGX/DGX B300 datasheet (Blackwell Ultra); 800 Gb/s ConnectX-8 per GPU",
        arch="blackwell",
    ),
    "gb300": GPUType(
        "gb300",
        _GB300_PEAK,
        284208 * 2**20,
        8000 * GB,
        900 * GB,
        100 * GB,
        72,
        "NVIDIA GB300 NVL72 datasheet (1,400 W); 800 Gb/s ConnectX-8 per GPU",
        gpus_per_host=4,
        arch="blackwell",
    ),
}
CATALOG["h100"] = CATALOG["h100-sxm"]
CATALOG["v100"] = CATALOG["v100-32gb"]


def runs_flash_attention(gpu: GPUType) -> bool:
    """Plans on ``gpu`` default to a flash attention kernel: GPUs with FP8 tensor cores (H100,
    H200 and later), where Megatron-Core with Transformer Engine, torchtitan and NeMo run fused
    attention. Older GPUs keep the model's own kernel."""
    return "fp8" in gpu.peak_flops


class UnknownGPUError(ValueError):
    """A GPU name that is not in the catalog; the message lists the known names."""


def get_gpu(name: str, catalog: dict[str, GPUType] | None = None) -> GPUType:
    catalog = catalog if catalog is not None else CATALOG
    key = name.lower()
    if key not in catalog:
        raise UnknownGPUError(
            f"unknown GPU {name!r}; known: {', '.join(sorted(catalog))} (add one with --gpu-catalog FILE)"
        )
    return catalog[key]


def load_catalog(path: str | Path) -> dict[str, GPUType]:
    """The built-in catalog plus the GPUs of a TOML or JSON file.

    File format: one table per GPU, keyed by name, with the :class:`GPUType` fields, e.g. (TOML)::

        [my-gpu]
        peak_flops = { bf16 = 400e12, fp32 = 50e12 }
        memory_bytes = 48e9
        memory_bandwidth = 1.0e12
        nvlink_bandwidth = 0
        network_bandwidth = 12.5e9
        gpus_per_node = 4
        gpus_per_host = 0  # optional: GPUs of a host where the NVLink domain spans hosts (NVL72: 4)
        source = "vendor sheet"
        arch = "hopper"    # optional: plan with that generation's fitted efficiencies
        power_peaks = [[300, 0.8], [400, 1.0]]   # optional: ratings at other power limits
        power_limit = 350                        # optional: the limit it runs at

    Raises ValueError naming the file and the missing or unknown field.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a table of GPUs keyed by name")
    known = {f.name for f in fields(GPUType)}
    optional = {
        "name",
        "gpus_per_node",
        "gpus_per_host",
        "source",
        "shared_cores",
        "arch",
        "power_limit",
        "power_peaks",
    }
    required = known - optional
    out = dict(CATALOG)
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: GPU {name!r}: expected a table of fields, got {type(table).__name__}")
        missing = required - set(table)
        unknown = set(table) - known
        if missing or unknown:
            raise ValueError(
                f"{path}: GPU {name!r}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}"
            )
        _check_numbers(path, name, table)
        if not isinstance(table.get("arch", ""), str):
            raise ValueError(f'{path}: GPU {name!r}: arch={table["arch"]!r} must be a string such as "hopper"')
        try:
            out[name.lower()] = GPUType(name=name.lower(), **{k: v for k, v in table.items() if k != "name"})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: GPU {name!r}: {e}") from None
    return out


def _check_numbers(path: Path, name: str, table: dict) -> None:
    peaks = table["peak_flops"]
    numbers = {f"peak_flops.{k}": v for k, v in peaks.items()} if isinstance(peaks, dict) else {"peak_flops": peaks}
    numbers.update({k: table[k] for k in ("memory_bytes", "memory_bandwidth", "nvlink_bandwidth", "network_bandwidth")})
    numbers["gpus_per_node"] = table.get("gpus_per_node", 8)
    numbers["gpus_per_host"] = table.get("gpus_per_host", 0)
    for key, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{path}: GPU {name!r}: {key}={value!r} must be a non-negative number")
    if not numbers["gpus_per_node"] >= 1 or not isinstance(peaks, dict) or not peaks:
        raise ValueError(f"{path}: GPU {name!r}: needs gpus_per_node >= 1 and a peak_flops table")
    if numbers["gpus_per_host"] != int(numbers["gpus_per_host"]):
        raise ValueError(f"{path}: GPU {name!r}: gpus_per_host={numbers['gpus_per_host']!r} must be a whole number")


@dataclass(frozen=True)
class Cluster:
    """``num_gpus`` GPUs of one kind in nodes of ``gpus_per_node``."""

    gpu: GPUType
    num_gpus: int
    gpus_per_node: int = field(default=0)

    def __post_init__(self) -> None:
        if self.gpus_per_node == 0:
            object.__setattr__(self, "gpus_per_node", self.gpu.gpus_per_node)
        small = [f"{k}={v}" for k, v in (("num_gpus", self.num_gpus), ("gpus_per_node", self.gpus_per_node)) if v < 1]
        if small:
            raise ValueError(f"{' and '.join(small)} must be >= 1")
        host = self.gpu.gpus_per_host
        if host and host < self.gpus_per_node:  # hosts fill the NVLink domains; the last may be partial
            if self.num_gpus % host:
                raise ValueError(
                    f"num_gpus={self.num_gpus} is not a multiple of the {host} GPUs of a {self.gpu.name} host "
                    f"(gpus_per_host={host})"
                )
        elif self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of gpus_per_node={self.gpus_per_node}")
