"""Data-parallel sharding strategies: the bytes one rank keeps (Megatron-Core's
``--data-parallel-sharding-strategy``; ZeRO stages 0-3, Rajbhandari et al., SC20, arXiv:1910.02054,
§5 and Table 1).

Over ``d = dp * cp`` ranks, with 16-bit weights ``w = 2``, fp32 main gradients ``g = 4`` (``g = 2``
with ``--grad-reduce-in-bf16``) and optimizer state ``k = 12`` (fp32 training: ``w = 4, g = 4,
k = 8``), bytes per parameter::

    no_shard            w     + g     + k
    optim               w     + g     + k / d     (ZeRO-1, the distributed optimizer)
    optim_grads         w     + g / d + k / d     (ZeRO-2)
    optim_grads_params  4 / d + g / d + (k - 4) / d   (ZeRO-3)

ZeRO-3's shard of 16-bit parameters is kept in float32 and is the optimizer's main copy (FSDP2 under
a bf16 ``MixedPrecisionPolicy``, torchtitan's default; ``ptdp train`` the same): 16 bytes per
parameter over ``d`` with fp32 gradients, not 18. Plus, for the last two, the peak transients
(:mod:`ptdp.planner.memory.transients`).

Megatron-Core's precision-aware optimizer (``--use-precision-aware-optimizer`` with
``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``; Apex's DistributedFusedAdam
``dtype`` likewise) keeps ``k`` = the main parameter's bytes plus each moment's (``optimizer``).
"""

from __future__ import annotations

from ptdp.config.fields import SHARDING_STRATEGIES

#: Megatron's default data-parallel bucket: 40 million gradient elements
DEFAULT_BUCKET_ELEMENTS = 40_000_000

#: (weight, gradient, optimizer state) bytes per parameter; fp8 trains bf16 weights with FP8 GEMMs
_BYTES = {"bf16": (2.0, 4.0, 12.0), "fp16": (2.0, 4.0, 12.0), "fp8": (2.0, 4.0, 12.0), "fp32": (4.0, 4.0, 8.0)}


def check_strategy(strategy: str) -> None:
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding={strategy!r} must be one of {SHARDING_STRATEGIES}")


def state_bytes(
    precision: str, bf16_grads: bool = False, optimizer: tuple[float, float, float] | None = None
) -> tuple[float, float, float]:
    """(w, g, k) of the module docstring for ``precision`` (ValueError for another), ``g = 2`` with
    ``bf16_grads`` (``--grad-reduce-in-bf16``), ``k`` the sum of ``optimizer`` (main parameter,
    first and second moment bytes) when given."""
    if precision not in _BYTES:
        raise ValueError(f"precision={precision!r} must be one of {tuple(_BYTES)}")
    w, g, k = _BYTES[precision]
    return w, 2.0 if bf16_grads else g, k if optimizer is None else sum(optimizer)


def strategy_bytes_per_param(
    precision: str,
    strategy: str,
    shard: int,
    *,
    bf16_grads: bool = False,
    optimizer: tuple[float, float, float] | None = None,
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter kept by one rank under ``strategy`` with
    ``shard = dp * cp`` ranks (the module docstring's table, transients excluded); ``optimizer``:
    the precision-aware optimizer's (main parameter, moment, moment) bytes."""
    check_strategy(strategy)
    w, g, k = state_bytes(precision, bf16_grads, optimizer)
    level = SHARDING_STRATEGIES.index(strategy)
    if level >= 3 and w < 4:  # the main parameters' shard is the copy kept
        main = 4.0 if optimizer is None else optimizer[0]
        return main / shard, g / shard, (k - main) / shard
    return (w / shard if level >= 3 else w, g / shard if level >= 2 else g, k / shard if level >= 1 else k)


def stage_state_bytes(
    n_params: int,
    precision: str,
    strategy: str,
    shard: int,
    *,
    params_transient: int = 0,
    grads_transient: int = 0,
    bf16_grads: bool = False,
    optimizer: tuple[float, float, float] | None = None,
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of one rank holding ``n_params`` parameters (one tp rank of one
    stage): the strategy's shares (:func:`strategy_bytes_per_param`) plus, with ``optim_grads`` /
    ``optim_grads_params`` over ``shard > 1`` ranks, ``grads_transient`` bucket elements (``g`` bytes
    each) and ``params_transient`` gathered elements (``w`` bytes each, ``optim_grads_params`` only).
    """
    pb, gb, ob = strategy_bytes_per_param(precision, strategy, shard, bf16_grads=bf16_grads, optimizer=optimizer)
    w, g, _ = state_bytes(precision, bf16_grads)
    params, grads, state = n_params * pb, n_params * gb, n_params * ob
    if shard > 1 and strategy in ("optim_grads", "optim_grads_params"):
        grads += g * grads_transient
        params += w * params_transient if strategy == "optim_grads_params" else 0.0
    return params, grads, state
