"""Before any worker starts: will the run fit in memory? (the planner's memory model)

Each rank's bytes come from :mod:`ptdp.planner.memory.breakdown` (exact parameter, gradient and
optimizer bytes, MoE layers' experts per rank of the expert grid; activations per Korthikanti et
al., arXiv:2205.05198, for the schedule, recompute and sequence parallelism, an MoE layer's as the
dense MLP's) plus a per-process overhead (on GPUs the planner's,
:func:`ptdp.planner.memory.overhead.runtime_overhead_bytes`). On GPUs the most loaded rank must fit
one device; on CPU the local workers' sum must fit ``MemAvailable``. Otherwise ``ptdp train`` exits
2 naming the estimate, the memory available and the flags that would help; ``--force`` starts anyway.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ptdp.config.schema import Config

GiB = 2**30
#: Resident memory of a CPU worker before the model (Python, torch, gloo), with a margin.
CPU_WORKER_OVERHEAD = 0.5 * GiB
_PRECISION = {"float32": ("fp32", 1.0), "float64": ("fp32", 2.0), "bfloat16": ("bf16", 1.0), "float16": ("fp16", 1.0)}


@dataclass(frozen=True)
class RankBytes:
    """Estimated bytes of one rank of pipeline stage ``stage`` (overhead not included)."""

    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def rank_estimates(config: Config) -> list[RankBytes]:
    """Bytes of one tp (and cp) rank of each pipeline stage of the resolved ``config`` (planner model:
    parameters, gradients and optimizer state as the run's sharding strategy keeps them over the
    dp x cp ranks, transients included; float64 counted as twice float32)."""
    from ptdp.planner.candidate import run_candidate
    from ptdp.planner.inputs.moe_model import planned_model
    from ptdp.planner.memory.activations import rank_activation_bytes, stage_activation_bytes
    from ptdp.planner.memory.moe_params import expert_bytes_per_param, layout_stage_counts
    from ptdp.planner.memory.params import rank_state_bytes

    p, m = config.parallel, planned_model(config)
    precision, scale = _PRECISION[m.params_dtype]
    layout = run_candidate(config, precision)
    assert layout is not None
    div = m.make_vocab_size_divisible_by
    counts, own = layout_stage_counts(m, layout, layout.layer_split, div)
    per_expert = expert_bytes_per_param(precision, p)
    activation_bytes = rank_activation_bytes if p.cp > 1 else stage_activation_bytes
    schedule = "gpipe" if p.schedule == "gpipe" else "1f1b"
    out = []
    for stage, (n, n_layers) in enumerate(zip(counts, config.pipeline.stage_layers)):
        act = activation_bytes(m, layout, stage, n_layers, schedule=schedule, make_vocab_size_divisible_by=div)
        experts = tuple(own[stage] * x for x in per_expert)
        # the run's sharding strategy over dp x cp, with its transients (a gradient bucket, gathered units)
        params, grads, optimizer = rank_state_bytes(m, layout, n, n_layers, stage=stage, divisible_by=div)
        params, grads, optimizer = params + experts[0], grads + experts[1], optimizer + experts[2]
        out.append(RankBytes(stage, scale * params, scale * grads, scale * optimizer, scale * act))
    return out


def needed_bytes(config: Config, nproc: int, *, gpu: bool) -> float:
    """What must fit: the most loaded rank plus its overhead (GPU), or the sum over the ``nproc``
    local workers with theirs (CPU; ranks in order, tp fastest, so a node holds whole stages
    when nproc is the world)."""
    ranks = rank_estimates(config)
    if gpu:
        return max(r.total for r in ranks) + gpu_worker_overhead(config, nproc)
    per_stage = config.parallel.tp * config.parallel.cp * config.parallel.dp
    totals = [ranks[min(i // per_stage, len(ranks) - 1)].total for i in range(nproc)]
    return sum(totals) + nproc * CPU_WORKER_OVERHEAD


def gpu_worker_overhead(config: Config, nproc: int) -> float:
    """A GPU rank's memory outside its tensors (CUDA context, cuBLAS workspaces, NCCL buffers): the
    planner's :func:`~ptdp.planner.memory.overhead.runtime_overhead_bytes` with ``nproc`` GPUs per node."""
    from ptdp.planner.candidate import run_candidate
    from ptdp.planner.memory.overhead import runtime_overhead_bytes

    layout = run_candidate(config, _PRECISION[config.model.params_dtype][0])
    assert layout is not None
    return runtime_overhead_bytes(layout, nproc, config.model.tied)


def _alternatives(config: Config) -> list[tuple[str, Config]]:
    """Flags that lower the memory of a run, with the config each gives (only those that apply)."""
    m, p, t = config.model, config.parallel, config.train
    out = []
    if not p.use_distributed_optimizer and p.dp > 1 and p.grad_compression != "1bit":
        out.append(
            (
                "--use-distributed-optimizer",
                dataclasses.replace(config, parallel=dataclasses.replace(p, use_distributed_optimizer=True)),
            )
        )
    if p.sharding_strategy != "optim_grads_params" and p.dp * p.cp > 1 and p.grad_compression != "1bit":
        zero3 = dataclasses.replace(
            p,
            data_parallel_sharding_strategy="optim_grads_params",
            use_distributed_optimizer=True,
            overlap_param_gather=False,
        )
        out.append(
            ("--data-parallel-sharding-strategy optim_grads_params", dataclasses.replace(config, parallel=zero3))
        )
    bucket = _layer_bucket(config)
    if p.sharding_strategy in ("optim_grads", "optim_grads_params") and p.dp * p.cp > 1 and bucket:
        out.append(
            (
                f"--ddp-bucket-size {bucket}",
                dataclasses.replace(config, parallel=dataclasses.replace(p, ddp_bucket_size=bucket)),
            )
        )
    if m.recompute_granularity != "full":
        out.append(
            (
                "--recompute-granularity full",
                dataclasses.replace(
                    config,
                    model=dataclasses.replace(
                        m, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
                    ),
                ),
            )
        )
    if m.params_dtype in ("float32", "float64"):
        out.append(("--bf16", dataclasses.replace(config, model=dataclasses.replace(m, params_dtype="bfloat16"))))
    if t.micro_batch_size > 1:
        out.append(
            ("--micro-batch-size 1", dataclasses.replace(config, train=dataclasses.replace(t, micro_batch_size=1)))
        )
    return out


def _layer_bucket(config: Config) -> int | None:
    """A bucket of an eighth of a layer's parameters on one tp rank, when smaller than the run's:
    a sharded-gradient backward then holds about one layer's buckets instead of several
    buckets larger than a layer (:mod:`ptdp.planner.memory.transients`)."""
    from ptdp.planner.memory.params import layer_param_count
    from ptdp.planner.memory.strategies import DEFAULT_BUCKET_ELEMENTS

    bucket = max(1, layer_param_count(config.model, config.parallel.tp) // 8)
    return bucket if bucket < (config.parallel.ddp_bucket_size or DEFAULT_BUCKET_ELEMENTS) else None


def memory_problem(config: Config, nproc: int, available: float, *, gpu: bool, where: str) -> str | None:
    """Why the resolved ``config`` cannot fit in ``available`` bytes (``where`` says what that is),
    or None. Names the estimate, the memory and the flags that would help with their estimates."""
    need = needed_bytes(config, nproc, gpu=gpu)
    if need <= available:
        return None
    ranks = rank_estimates(config)
    worst = max(ranks, key=lambda r: r.total)
    unit = "the most loaded rank needs" if gpu else f"the {nproc} local workers together need"
    lines = [
        f"the run does not fit in memory: {unit} about {need / GiB:,.1f} GiB and {where} has "
        f"{available / GiB:,.1f} GiB",
        f"  per rank of stage {worst.stage}: parameters {worst.params / GiB:,.2f} GiB, gradients "
        f"{worst.grads / GiB:,.2f}, optimizer state {worst.optimizer / GiB:,.2f}, activations "
        f"{worst.activations / GiB:,.2f} (planner estimate), plus "
        f"{(gpu_worker_overhead(config, nproc) if gpu else CPU_WORKER_OVERHEAD) / GiB:.2f} GiB per process",
    ]
    helps = [
        f"{flag} ({alt_need / GiB:,.1f} GiB)"
        for flag, alt in _alternatives(config)
        if (alt_need := needed_bytes(alt, nproc, gpu=gpu)) < need
    ]
    more = "larger --tp or --pp (each rank then holds a smaller part of the model)"
    lines.append("  would help: " + ", ".join(helps + [more]) + "; or a smaller model")
    lines.append("  --force starts the workers anyway")
    return "\n".join(lines)


def available_memory(nproc: int) -> tuple[float, bool, str]:
    """(bytes, on GPU, what it is): the smallest GPU's memory when CUDA is used, else the
    machine's available memory (``MemAvailable`` of /proc/meminfo, or free pages)."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(min(count, nproc) or 1)]
        return float(min(sizes)), True, "each GPU"
    return float(_cpu_available()), False, "this machine"


def _cpu_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(config: Config, nproc: int) -> None:
    """Raise ConfigError (exit 2) when the run cannot fit in this machine's memory
    (:func:`memory_problem`)."""
    from ptdp.errors import ConfigError

    available, gpu, where = available_memory(nproc)
    problem = memory_problem(config, nproc, available, gpu=gpu, where=where)
    if problem:
        raise ConfigError(problem)
