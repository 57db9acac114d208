"""The GPU check's models: the timed shapes, their ptdp configs and data, and stages built on the device.

Both models of a speed row are built with their weights on the device. ptdp draws its initial
values on the CPU (the same values on every device and layout), which for 1.3B parameters takes
tens of seconds; a speed row needs the same weights in both models, not ptdp's values, so
:func:`device_stage` draws them on the device instead, from the same distributions. The loss
check keeps ptdp's own initialisation (it compares devices).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from unittest import mock

import torch
from gpu_report import Budget, StageReport, train_steps

import ptdp.engine.stage as ptdp_stage
from ptdp.config.fp8 import FP8Config
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import Stage, build_stage
from ptdp.engine.step import train_step
from ptdp.engine.tensor_parallel.sharding import global_param

FULL = {
    "num_layers": 24,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "seq_length": 2048,
    "vocab_size": 50257,
    "micro_batch_size": 2,
    "num_microbatches": 4,
    "steps": 10,
    "warmup": 3,
}
QUICK = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "vocab_size": 500,
    "micro_batch_size": 2,
    "num_microbatches": 2,
    "steps": 3,
    "warmup": 1,
}
"""The ``--quick`` shape (both models pad its vocabulary to 512 rows)."""


def flop_params(config: Config) -> int:
    """N of ``6 N + 12 l h s``: every parameter of the model but the position table, with the tied
    word embedding counted once (for the logits GEMM) on the real vocabulary: per layer
    ``4 h^2 + 2 h f`` weights and ``9 h + f`` biases and norm parameters, the final norm ``2 h``."""
    m = config.model
    h, f = m.hidden_size, m.ffn
    return m.num_layers * (4 * h * h + 2 * h * f + 9 * h + f) + 2 * h + m.vocab_size * h


def flops_per_token(config: Config) -> int:
    """Model FLOPs per token, ``6 N + 12 l h s`` (PaLM App. B)."""
    m = config.model
    return 6 * flop_params(config) + 12 * m.num_layers * m.hidden_size * m.seq_length


def speed_config(shape: dict, dtype: str, moe: MoEConfig | None = None, fp8: FP8Config | None = None) -> Config:
    """The resolved single-process config of the timed model (GPT defaults, no dropout; ``moe``: its
    mixture-of-experts options, default dense; ``fp8``: its FP8 options, default none)."""
    model = ModelConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        seq_length=shape["seq_length"],
        vocab_size=shape["vocab_size"],
        params_dtype=dtype,
    )
    b, m = shape["micro_batch_size"], shape["num_microbatches"]
    train = TrainConfig(
        micro_batch_size=b,
        global_batch_size=b * m,
        train_iters=10_000,
        lr_warmup_iters=0,
        lr=1e-4,
        min_lr=1e-4,
        eval_iters=0,
    )
    config = Config(model=model, moe=moe or MoEConfig(), fp8=fp8 or FP8Config(), parallel=ParallelConfig(), train=train)
    return resolve(config, 1)


def random_microbatches(config: Config, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``m`` CPU microbatches ``(tokens [b, s], labels [b, s])`` of random tokens."""
    t, s = config.train, config.model.seq_length
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.model.vocab_size, (t.global_batch_size, s + 1), generator=gen)
    b = t.micro_batch_size
    return [(data[i : i + b, :-1], data[i : i + b, 1:]) for i in range(0, t.global_batch_size, b)]


@contextlib.contextmanager
def _initial_values_on(device: torch.device):
    """ptdp's ``build_stage`` with each parameter's initial value drawn on ``device`` (one generator
    seeded by ``config.train.seed``) instead of on the CPU: N(0, std^2) weights (``std /
    sqrt(2 l)`` for the scaled ones), ones and zeros as ptdp, padded vocabulary rows zero. tp = 1."""

    def draw(module, *, seed: int, std: float, num_layers: int, tp_rank: int, tp_size: int) -> None:
        if tp_size != 1:
            raise ValueError(f"weights drawn on the device at tp = 1 only (tp = {tp_size})")
        gen = torch.Generator(device=device).manual_seed(seed)
        for param in module.parameters():
            spec = global_param(param)
            value = torch.empty(param.shape, dtype=torch.float32, device=device)
            if spec.init in ("zeros", "ones"):
                value.fill_(1.0 if spec.init == "ones" else 0.0)
            else:
                scale = math.sqrt(2.0 * num_layers) if spec.init == "scaled_normal" else 1.0
                value.normal_(0.0, std / scale, generator=gen)
            if spec.real_rows is not None:
                value[spec.real_rows :] = 0.0
            param.data = value.to(param.dtype)

    with mock.patch.object(ptdp_stage, "initialize_parameters", draw):
        yield


def device_stage(config: Config, device: torch.device) -> Stage:
    """ptdp's single-process stage of ``config`` with its weights drawn on ``device``."""
    with _initial_values_on(device):
        return build_stage(config, ParallelGroups.single_process(), device)


def free_memory(device: torch.device) -> None:
    """Return a finished run's memory to ``device`` before the next run builds its stage."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def train_one_batch(
    stage: Stage, shape: dict, run: dict, *, budget: Budget, report: StageReport, what: str, reserve_s: float
) -> None:
    """``shape["warmup"] + shape["steps"]`` steps of ``stage`` on one fixed batch into ``run``
    (:func:`gpu_report.train_steps`), with ``first_step_s`` (the first step's seconds) and on CUDA
    ``peak_memory_bytes`` (since the caller's last reset of the peak)."""
    config, device = stage.config, stage.device
    mbs = [(x.to(device), y.to(device)) for x, y in random_microbatches(config, seed=0)]

    def step(i: int):
        t = time.perf_counter()
        result = train_step(stage, mbs, i).result()
        if i == 0:
            run["first_step_s"] = time.perf_counter() - t
        return result

    tokens = config.train.global_batch_size * config.model.seq_length
    kw = {"warmup": shape["warmup"], "steps": shape["steps"], "tokens": tokens}
    train_steps(step, run, **kw, budget=budget, report=report, what=what, reserve_s=reserve_s)
    if device.type == "cuda":
        run["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
