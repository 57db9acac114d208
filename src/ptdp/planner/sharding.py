"""Data-parallel sharding strategies: bytes per rank and the communication they add.

The ``d = dp * cp`` ranks that hold the same parameters (one tp rank of one pipeline stage in
each of ``dp`` replicas and ``cp`` context-parallel ranks) can shard what they hold
(Megatron-Core's ``--data-parallel-sharding-strategy`` names; ZeRO stages 0-3 of Rajbhandari et
al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC20,
arXiv:1910.02054, §5 and Table 1).

Bytes per parameter (mixed precision: 16-bit weights ``w = 2``, float32 main gradients ``g = 4``
as ptdp and Megatron-Core keep them, optimizer state ``k = 12``: float32 main weight, Adam m and
v; ZeRO's Table 1 counts ``2 + 2 + K`` with 16-bit gradients and ``K = 12``; Megatron-Core's
distributed-optimizer documentation counts ``18`` unsharded and ``6 + 12/d`` sharded for bf16
weights with fp32 gradients, ``16`` and ``8 + 8/d`` for fp32,
https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html;
fp32 training: ``w = 4, g = 4, k = 8``)::

    no_shard            w     + g     + k
    optim               w     + g     + k / d     (ZeRO-1, the distributed optimizer)
    optim_grads         w     + g / d + k / d     (ZeRO-2)
    optim_grads_params  w / d + g / d + k / d     (ZeRO-3)

Transients on top (:func:`stage_state_bytes`), per rank, counted exactly as ptdp's engine holds
them at their peaks (:mod:`ptdp.planner.transients`, checked against the engine's own counters by
``tests/dist/test_sharded_grads.py`` and ``test_sharded_params.py``):

* both: the full-size float32 gradient buckets alive during a backward (``g`` bytes per
  element; buckets of ``--ddp-bucket-size`` elements, 40 M by default, padded to a multiple of
  ``d``). A layer's buckets are allocated when backward reaches the layer, the chunk's other
  buckets when its backward starts; with ``--overlap-grad-reduce`` (ptdp's default) a bucket is
  reduce-scattered as soon as it is complete and freed when a third is started (at most two in
  flight), so the peak is about one layer's buckets, the ones straddling it, two in flight and
  those of the non-layer parameters still filling; without it a backward holds every bucket of
  its model chunk at its end (interleaved: on top of those the chunk after it left).
* ``optim_grads_params``: the gathered 16-bit parameters (``w`` bytes per element): ptdp's units
  (a chunk's embeddings, each layer, its head; one unit for embeddings and head where a single
  stage looks up and projects with one tied table, ``engine/data_parallel/units.py``) are
  gathered one ahead (prefetch): the largest sum of two neighbouring units, or the tied unit
  and two layers; with ``--no-reshard-after-forward`` every unit of the stage at once (each chunk
  has a microbatch in flight when the first backward starts). Resharding after forward repeats
  the gathers for every microbatch, in forward and again in backward (not the embeddings' unit,
  which only the lookups read: their gradients need the ids, not the tables).

Communication per step (:func:`sharded_dp_times`; ring collectives over the ``d`` ranks, NVLink
inside the node and the network across, as :func:`ptdp.planner.comm.hierarchical_all_reduce_time`):

* ``no_shard``: one all-reduce of the float32 gradients; ``optim``: reduce-scatter of the
  gradients + all-gather of the updated 16-bit weights (each half an all-reduce) [N21 §3.2].
* ``optim_grads``: one reduce-scatter of the gradients per microbatch (the accumulated gradient
  is never whole), each hidden behind its microbatch's backward up to that backward's length;
  the last one is exposed like the ``optim`` reduction, then the weights' all-gather.
  Except with the interleaved schedule in one round (``v > 1`` model chunks, ``m == pp``
  microbatches: :func:`~ptdp.layout.buckets.chunk_by_chunk`): every rank then runs the backward of all microbatches of
  its last chunk, then all of the chunk before, and so on (the rounds of ``pp`` microbatches of
  [N21] §2.2 with a single round), so each chunk's gradient is accumulated whole in float32 and
  reduce-scattered once, when its last backward is done, behind the next chunk's backward round;
  only the last chunk's is exposed, with the weights' all-gather. This is how the Llama 3 405B
  run reduced its sharded gradients (Dubey et al. 2024, arXiv:2407.21783, §3.3.2: gradients
  sharded, accumulated in FP32 across microbatches and reduce-scattered in FP32, with
  interleaved pipeline stages), and how ptdp's engine reduces then (``GradBuffer.by_chunk``):
  its transient is a chunk's whole gradient beside two buckets of the chunk after it in flight.
* ``optim_grads_params``: the same reduce-scatters, no weight all-gather after the step, and per
  microbatch two all-gathers of every unit (forward, backward; the embeddings' unit of a first
  stage that does not also project with its table once, in forward), each prefetched behind the
  previous unit's compute: the first unit's gather is exposed, every other unit's only by what
  it exceeds one layer's compute. Kept gathered (``--no-reshard-after-forward``) a unit is
  gathered once per stretch of microbatches its chunk has in flight, in forward only: ``m``
  times per step at pp = 1 and on the last stage of 1F1B, the planner's count (an upper bound
  for the stages before it, which gather fewer times). In elements, what ptdp counts on one rank
  per step for a stage of ``N`` gradient elements (padded) and ``m`` microbatches: ``m * N``
  reduce-scattered (``N`` chunk by chunk: one reduce-scatter per bucket per step) and
  ``m * (2 N - E) / d`` all-gathered with ``E`` the embeddings' unit's elements (0 but on the
  first stage; :func:`ptdp.planner.transients.unit_gathers`), kept ``k * N / d`` for ``k``
  stretches (``tests/dist/test_sharded_params.py``; chunk by chunk ``test_sharded_grads.py``).
"""

from __future__ import annotations

from ptdp.planner.comm import Links, dp_group_per_node, hierarchical_all_reduce_time
from ptdp.planner.plan import SHARDING

#: Megatron's default data-parallel bucket: 40 million gradient elements
DEFAULT_BUCKET_ELEMENTS = 40_000_000

#: (weight, gradient, optimizer state) bytes per parameter; fp8 trains bf16 weights with FP8 GEMMs
_BYTES = {"bf16": (2.0, 4.0, 12.0), "fp16": (2.0, 4.0, 12.0), "fp8": (2.0, 4.0, 12.0), "fp32": (4.0, 4.0, 8.0)}


def check_strategy(strategy: str) -> None:
    if strategy not in SHARDING:
        raise ValueError(f"sharding={strategy!r} must be one of {SHARDING}")


def strategy_bytes_per_param(precision: str, strategy: str, shard: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter kept by one rank under ``strategy`` with
    ``shard = dp * cp`` ranks (the module docstring's table, transients excluded)."""
    check_strategy(strategy)
    if precision not in _BYTES:
        raise ValueError(f"precision={precision!r} must be one of {tuple(_BYTES)}")
    w, g, k = _BYTES[precision]
    level = SHARDING.index(strategy)
    return (w / shard if level >= 3 else w, g / shard if level >= 2 else g, k / shard if level >= 1 else k)


def stage_state_bytes(
    n_params: int,
    precision: str,
    strategy: str,
    shard: int,
    *,
    params_transient: int = 0,
    grads_transient: int = 0,
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of one rank holding ``n_params`` parameters (one tp rank of
    one stage): the strategy's shares (:func:`strategy_bytes_per_param`) plus, with
    ``optim_grads`` / ``optim_grads_params`` over ``shard > 1`` ranks, the transients at their
    peaks in elements (:func:`ptdp.planner.transients.rank_transients`): ``grads_transient``
    full-size gradient bucket elements (``g`` bytes each) and ``params_transient`` gathered
    parameter elements (``w`` bytes each, ``optim_grads_params`` only)."""
    pb, gb, ob = strategy_bytes_per_param(precision, strategy, shard)
    w, g, _ = _BYTES[precision]
    params, grads, optimizer = n_params * pb, n_params * gb, n_params * ob
    if shard > 1 and strategy in ("optim_grads", "optim_grads_params"):
        grads += g * grads_transient
        params += w * params_transient if strategy == "optim_grads_params" else 0.0
    return params, grads, optimizer


def optimizer_bytes_per_param(
    full: float, sharded: float, strategy: str, shard: int, *, grad_bytes: float = 8.0, weight_bytes: float = 2.0
) -> float:
    """Memory traffic of the optimizer step per parameter of the stage.

    ``full`` bytes touch every parameter and ``sharded`` only the rank's ``1/shard`` (see
    :data:`ptdp.planner.dp_time.OPT_BYTES_FULL`): unsharded everything is full; ``optim`` shards the
    update; ``optim_grads`` also the gradient's norm read and zeroing (``grad_bytes`` of
    ``full``); ``optim_grads_params`` also the 16-bit weight write (``weight_bytes``).
    """
    check_strategy(strategy)
    if strategy == "no_shard" or shard <= 1:
        return full + sharded
    moved = {"optim": 0.0, "optim_grads": grad_bytes, "optim_grads_params": grad_bytes + weight_bytes}[strategy]
    moved = min(moved, full)
    return (full - moved) + (sharded + moved) / shard


def sharded_dp_times(
    strategy: str,
    *,
    grad_bytes: float,
    param_bytes: float,
    unit_param_bytes: float,
    tp: int,
    shard: int,
    num_microbatches: int,
    units: int,
    layer_forward: float,
    layer_backward: float,
    microbatch_backward: float,
    links: Links,
    end_overlap: float = 0.0,
    chunks: int = 1,
    kept_gathers: int | None = None,
    backward_units: int | None = None,
) -> float:
    """Exposed seconds per step of the data-parallel communication of ``strategy`` over ``shard``
    ranks (the module docstring's model).

    ``grad_bytes`` / ``param_bytes``: the stage's float32 gradients and 16-bit weights on one
    rank; ``unit_param_bytes``: one unit's 16-bit weights; ``units``: units per microbatch pass;
    ``layer_forward`` / ``layer_backward``: seconds of one layer's compute that hides the next
    gather; ``microbatch_backward``: one microbatch's backward on the stage, which hides its
    reduce-scatter; ``end_overlap``: fraction of the end-of-step reduction hidden (the time
    model's ``dp_overlap``); ``chunks`` > 1: the gradient is reduced chunk by chunk
    (:func:`~ptdp.layout.buckets.chunk_by_chunk`), ``1/chunks`` of it after each round of ``num_microbatches`` chunk
    backwards, each hidden behind the next round, the last exposed. ``kept_gathers``
    (``optim_grads_params`` with ``--no-reshard-after-forward``): the units are gathered that
    many times per step, once per stretch of microbatches in flight, in forward only (each gather
    behind the previous unit's forward), instead of twice per microbatch. ``backward_units``:
    the units gathered again in each backward (None: ``units``; one fewer on a stage whose
    embeddings' unit only the lookups read). Group members per node: ``min(shard, gpus_per_node / tp)``.
    """
    check_strategy(strategy)
    if shard <= 1:
        return 0.0
    per_node = dp_group_per_node(tp, shard, links.gpus_per_node)
    reduce_scatter = 0.5 * hierarchical_all_reduce_time(grad_bytes, shard, per_node, links)
    weights_gather = 0.5 * hierarchical_all_reduce_time(param_bytes, shard, per_node, links)
    if strategy == "no_shard":
        return (1.0 - end_overlap) * hierarchical_all_reduce_time(grad_bytes, shard, per_node, links)
    if strategy == "optim":
        return (1.0 - end_overlap) * (reduce_scatter + weights_gather)
    m = num_microbatches
    if chunks > 1:  # one reduce-scatter per chunk, after its round of m chunk backwards
        last_rs = 0.5 * hierarchical_all_reduce_time(grad_bytes / chunks, shard, per_node, links)
        hidden_rs = (chunks - 1) * max(0.0, last_rs - m * microbatch_backward / chunks)
    else:
        last_rs = reduce_scatter
        hidden_rs = (m - 1) * max(0.0, reduce_scatter - microbatch_backward)
    if strategy == "optim_grads":
        return hidden_rs + (1.0 - end_overlap) * (last_rs + weights_gather)
    gather = 0.5 * hierarchical_all_reduce_time(unit_param_bytes, shard, per_node, links)
    rest = max(units - 1, 0)
    forward_pass = gather + rest * max(0.0, gather - layer_forward)
    if kept_gathers is not None:
        return kept_gathers * forward_pass + hidden_rs + (1.0 - end_overlap) * last_rs
    again = units if backward_units is None else backward_units
    backward_pass = (gather + (again - 1) * max(0.0, gather - layer_backward)) if again > 0 else 0.0
    return m * (forward_pass + backward_pass) + hidden_rs + (1.0 - end_overlap) * last_rs
