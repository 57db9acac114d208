"""Throughput of a training run the way the field reports it: tokens/s, model TFLOP/s per GPU, MFU.

``F`` (:func:`step_model_flops`): model FLOPs of one step
(:func:`ptdp.planner.time.flops.model_flops_per_step`, unpadded vocabulary): 3 x the forward GEMMs,
attention counted in full; for GPT ``72 B s l h^2 (1 + s/(6h) + V/(12 h l))`` (Korthikanti et al.,
arXiv:2205.05198, §6); an MoE layer's router, ``k`` routed experts and shared expert per token. Recompute, elementwise work and the optimizer are not counted (as
Megatron-LM's ``--log-throughput``).

Per logged step: ``tokens_per_s = B s / step_time_s``; ``tflops_per_gpu = F / step_time_s / world /
1e12``; ``mfu = tflops_per_gpu * 1e12 / peak``, ``peak`` the dense FLOP/s of one device
(:func:`device_peak`: the catalog GPU on CUDA, the calibrated profile on CPU; else no ``mfu``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptdp.config.schema import Config
from ptdp.planner.candidate import PRECISION_OF_DTYPE
from ptdp.planner.inputs.hardware import CATALOG, GPUType
from ptdp.planner.time.flops import model_flops_per_step
from ptdp.planner.time.profile import load_profile

#: ``params_dtype`` -> the precision key of a :class:`GPUType`'s peaks (float64 has none).

#: (words all in the upper-cased ``torch.cuda.get_device_name``, catalog key), first match wins.
#: H100 PCIe and NVL have lower peaks than the SXM part of the catalog, so only SXM names
#: ("NVIDIA H100 80GB HBM3", "... SXM ...") match it.
DEVICE_NAMES = (
    (("H200",), "h200"),
    (("H100", "HBM3"), "h100-sxm"),
    (("H100", "SXM"), "h100-sxm"),
    (("A100", "80GB"), "a100-80gb"),
    (("A100", "40GB"), "a100-40gb"),
    (("V100", "32GB"), "v100-32gb"),
)


def step_model_flops(config: Config) -> float:
    """Model FLOPs of one optimizer step, all GPUs together (see the module docstring);
    ``config.model.vocab_size`` should be the tokenizer's real size (as in the trainer)."""
    return model_flops_per_step(config.model, config.train.global_batch_size, config.moe)


def catalog_gpu(device_name: str) -> GPUType | None:
    """The catalog GPU that ``device_name`` (``torch.cuda.get_device_name``) is, or None; None for
    a MIG slice (``... MIG 1g.10gb``), which has a fraction of the GPU's peak."""
    name = device_name.upper()
    if "MIG" in name.split():
        return None
    for words, key in DEVICE_NAMES:
        if all(w in name for w in words):
            return CATALOG[key]
    return None


def device_peak(config: Config, device: torch.device | str) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one ``device`` at the run's ``params_dtype`` and where it comes from,
    or ``(None, why not)``. Reads no device value (no synchronisation)."""
    precision = PRECISION_OF_DTYPE.get(config.model.params_dtype)
    if precision is None:
        return None, f"no peak for params_dtype={config.model.params_dtype}"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = catalog_gpu(name)
        if gpu is None:
            return None, f"{name!r} is not a catalog GPU"
        source = f"catalog {gpu.name}"
    else:
        from ptdp.run.planner_report import profile_path

        path = profile_path(config)
        if path is None or not path.is_file():
            return None, "no hardware profile (ptdp plan --calibrate)"
        try:
            gpu, _ = load_profile(path)
        except ValueError as e:
            return None, str(e)
        source = f"profile {path}"
    if precision not in gpu.peak_flops:
        return None, f"{source} has no {precision} peak"
    return float(gpu.peak_flops[precision]), source


@dataclass(frozen=True)
class Throughput:
    """What one step's time is turned into: ``tokens_per_step`` (B s), ``flops_per_step`` (model
    FLOPs, all GPUs), ``world`` (GPUs) and ``peak_flops`` (one device's dense peak; None: unknown)."""

    tokens_per_step: int
    flops_per_step: float
    world: int
    peak_flops: float | None = None

    @classmethod
    def for_run(cls, config: Config, device: torch.device | str) -> Throughput:
        return cls(
            config.train.global_batch_size * config.model.seq_length,
            step_model_flops(config),
            config.world_size,
            device_peak(config, device)[0],
        )

    def of(self, step_time_s: float) -> dict[str, float]:
        """``tokens_per_s``, ``tflops_per_gpu`` and (peak known) ``mfu`` of a ``step_time_s`` step."""
        per_gpu = self.flops_per_step / step_time_s / self.world
        out = {"tokens_per_s": self.tokens_per_step / step_time_s, "tflops_per_gpu": per_gpu / 1e12}
        if self.peak_flops:
            out["mfu"] = per_gpu / self.peak_flops
        return out
