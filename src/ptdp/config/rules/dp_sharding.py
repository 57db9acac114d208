"""Rules of data-parallel sharding (Rajbhandari et al., arXiv:1910.02054) and the data-parallel
engine's options (gradient compression, parameter all-gather overlap, CPU binding)."""

from __future__ import annotations

from ptdp.config.fields import BIND_POLICIES, GRAD_COMPRESSIONS, SHARDING_STRATEGIES
from ptdp.config.parallel import ParallelConfig
from ptdp.errors import V, Violation


def sharding_violations(p: ParallelConfig) -> list[Violation]:
    """``data_parallel_sharding_strategy`` is a known name and agrees with
    ``use_distributed_optimizer`` (which means ``optim``)."""
    strategy = p.data_parallel_sharding_strategy
    if strategy is None:
        return []
    if strategy not in SHARDING_STRATEGIES:
        return [V("option", f"data_parallel_sharding_strategy={strategy!r} must be one of {SHARDING_STRATEGIES}")]
    if p.use_distributed_optimizer and strategy == "no_shard":
        return [
            V(
                "data parallel",
                "use_distributed_optimizer (data_parallel_sharding_strategy=optim) contradicts "
                "data_parallel_sharding_strategy=no_shard: give one",
            )
        ]
    return []


def sharded_params_violations(p: ParallelConfig) -> list[Violation]:
    """Rules of ``optim_grads_params`` (parameters sharded, gathered unit by unit before each
    forward and backward): ``overlap_param_gather`` (the distributed optimizer's all-gather after
    the step, overlapped with the next forward) does not exist there, and
    ``reshard_after_forward=False`` means nothing without it."""
    out = []
    strategy = p.data_parallel_sharding_strategy
    if strategy == "optim_grads_params" and p.overlap_param_gather:
        out.append(
            V(
                "data parallel",
                "overlap_param_gather does not apply to data_parallel_sharding_strategy=optim_grads_params: "
                "its parameters are all-gathered unit by unit before each forward and backward (the next "
                "unit's gather always overlaps the current one's compute), never after the optimizer step",
            )
        )
    if not p.reshard_after_forward and strategy != "optim_grads_params":
        out.append(
            V(
                "data parallel",
                f"reshard_after_forward=False (--no-reshard-after-forward) needs "
                f"data_parallel_sharding_strategy=optim_grads_params, not {p.sharding_strategy} (only sharded "
                f"parameters are gathered and freed around each forward)",
            )
        )
    return out


def data_parallel_violations(p: ParallelConfig) -> list[Violation]:
    """Rules of the data-parallel engine: codec, distributed optimizer, buckets, CPU binding."""
    out = []
    sharded = p.use_distributed_optimizer or p.data_parallel_sharding_strategy not in (None, "no_shard")
    if p.grad_compression not in GRAD_COMPRESSIONS:
        out.append(V("option", f"grad_compression={p.grad_compression!r} must be one of {GRAD_COMPRESSIONS}"))
    if p.overlap_param_gather and not sharded:
        out.append(
            V(
                "data parallel",
                "overlap_param_gather needs use_distributed_optimizer (only the distributed "
                "optimizer all-gathers parameters)",
            )
        )
    if p.grad_compression == "1bit" and sharded:
        out.append(
            V(
                "data parallel",
                f"grad_compression=1bit cannot be combined with a sharded data-parallel state "
                f"({_sharding_named(p)}; 1-bit gradients are all-gathered, not reduce-scattered into "
                f"shards: use data_parallel_sharding_strategy=no_shard)",
            )
        )
    warmup = p.grad_compression_warmup_iters
    if warmup is not None and (not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0):
        out.append(V("option", f"grad_compression_warmup_iters={warmup!r} must be an integer >= 0"))
    elif warmup is not None and p.grad_compression == "none":
        out.append(
            V("data parallel", f"grad_compression_warmup_iters={warmup} has no effect with grad_compression=none")
        )
    if p.ddp_bucket_size is not None and (not isinstance(p.ddp_bucket_size, int) or p.ddp_bucket_size < 1):
        out.append(V("option", f"ddp_bucket_size={p.ddp_bucket_size!r} must be a positive integer (elements)"))
    if p.bind_cpus not in BIND_POLICIES:
        out.append(V("option", f"bind_cpus={p.bind_cpus!r} must be one of {BIND_POLICIES}"))
    return out


def grad_reduce_violations(p: ParallelConfig, params_dtype: str) -> list[Violation]:
    """``grad_reduce_in_bf16`` needs bfloat16 parameters (float32 gradients of float32 or float16
    parameters stay as they are) and no gradient codec (the reduction is already bf16)."""
    if not p.grad_reduce_in_bf16:
        return []
    out = []
    if params_dtype != "bfloat16":
        out.append(
            V(
                "data parallel",
                f"grad_reduce_in_bf16 (--grad-reduce-in-bf16) needs params_dtype=bfloat16, not {params_dtype} "
                f"(a bf16 gradient buffer holds the gradients of bf16 parameters)",
            )
        )
    if p.grad_compression != "none":
        out.append(
            V(
                "data parallel",
                f"grad_reduce_in_bf16 reduces in bf16 already: grad_compression={p.grad_compression} must be none",
            )
        )
    return out


def _sharding_named(p) -> str:
    """The flag(s) that asked for a sharded data-parallel state, as the user gave them."""
    named = []
    if p.use_distributed_optimizer:
        named.append("use_distributed_optimizer")
    if p.data_parallel_sharding_strategy not in (None, "no_shard"):
        named.append(f"data_parallel_sharding_strategy={p.data_parallel_sharding_strategy}")
    return " and ".join(named)
