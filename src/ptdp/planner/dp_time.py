"""Data-parallel and optimizer time of one step: the end-of-step terms of the step-time model.

The data-parallel communication of a stage's parameters under its sharding strategy
(:mod:`ptdp.planner.sharding`), the part of it hidden behind backward, the tied embedding's
gradient all-reduce between the first and the last stage, and the optimizer update, which is
bound by memory bandwidth. How these add up to a step is :func:`ptdp.planner.perf.evaluate_performance`.
"""

from __future__ import annotations

from ptdp.layout.buckets import chunk_by_chunk
from ptdp.planner.comm import Links, embedding_sync_time
from ptdp.planner.models import ModelSpec
from ptdp.planner.param_memory import layer_param_count
from ptdp.planner.perf_constants import PerfConstants
from ptdp.planner.plan import Layout
from ptdp.planner.sharding import optimizer_bytes_per_param, sharded_dp_times

#: Bytes per parameter the optimizer step reads and writes (mixed precision, fp32 main weights):
#: on every parameter: write the 16-bit weight (2), read the gradient for the global norm (4),
#: zero the gradient buffer (4); on the parameters this rank updates (1/dp of them with the
#: distributed optimizer): read the gradient (4), read and write the main weight, m and v (24).
OPT_BYTES_FULL = {"bf16": 10.0, "fp16": 10.0, "fp32": 8.0, "fp8": 10.0}
OPT_BYTES_SHARDED = {"bf16": 28.0, "fp16": 28.0, "fp32": 28.0, "fp8": 28.0}


def dp_comm_time(
    model: ModelSpec,
    layout: Layout,
    n_params: int,
    busiest: tuple[float, ...],
    stage_layers: int,
    elem: float,
    links: Links,
    c: PerfConstants,
    layer: tuple[float, ...],
    *,
    first_stage: bool = False,
) -> float:
    """Exposed seconds of the data-parallel communication of the stage's ``n_params`` parameters
    over ``dp * cp`` ranks under the layout's sharding strategy
    (:func:`ptdp.planner.sharding.sharded_dp_times`): float32 gradients, ``elem``-byte weights,
    units of one layer (plus the embedding / output unit; ``first_stage``: the stage looks up,
    and unless it also projects with the same tied table, pp = 1, backward does not gather its
    embeddings' unit again), hidden behind one microbatch's
    backward (the busiest stage's compute without its forward third) and one layer's compute;
    chunk by chunk (:func:`~ptdp.layout.buckets.chunk_by_chunk`) each chunk's behind the next
    chunk's backward round.
    With ``c.overlap_window`` the end-of-step part left by ``c.dp_overlap`` is hidden up to one
    microbatch's compute on the busiest stage (``busiest[0]``)."""
    per_layer = layer_param_count(model, layout.tp)
    unit = max(per_layer, n_params - stage_layers * per_layer)
    lookup_only = first_stage and not (layout.pp == 1 and model.tied)  # its embeddings' unit
    microbatch_backward = busiest[0] * 2.0 / 3.0
    v = layout.virtual_stages
    chunks = (
        v if chunk_by_chunk(layout.sharding_strategy, layout.shard_size, v, layout.num_microbatches, layout.pp) else 1
    )

    def exposed(end_overlap: float) -> float:
        return sharded_dp_times(
            layout.sharding_strategy,
            grad_bytes=4.0 * n_params,
            param_bytes=elem * n_params,
            unit_param_bytes=elem * unit,
            tp=layout.tp,
            shard=layout.shard_size,
            num_microbatches=layout.num_microbatches,
            units=stage_layers + 1,
            layer_forward=layer[0],
            layer_backward=layer[1],
            microbatch_backward=microbatch_backward,
            links=links,
            end_overlap=end_overlap,
            chunks=chunks,
            # kept gathered: once per stretch of microbatches in flight, m on the last stage (and
            # at pp = 1), the most any stage gathers
            kept_gathers=None if layout.reshard_after_forward else layout.num_microbatches,
            backward_units=stage_layers + 1 - int(lookup_only),
        )

    if not c.overlap_window:
        return exposed(c.dp_overlap)
    without_end = exposed(1.0)
    return without_end + max(0.0, exposed(c.dp_overlap) - without_end - busiest[0])


def embedding_sync_dp_time(model: ModelSpec, layout: Layout, v_pad: int, links: Links, c: PerfConstants) -> float:
    """Exposed seconds of the all-reduce of the tied word embedding's float32 gradient
    (``V_pad / tp x h`` on one tp rank) between the first and the last pipeline stage
    (:func:`ptdp.planner.comm.embedding_sync_time`), the part ``c.dp_overlap`` does not hide; 0
    for an untied model or pp = 1 (one stage holds the only copy)."""
    if not (model.tied and layout.pp > 1):
        return 0.0
    nbytes = 4.0 * v_pad // layout.tp * model.hidden_size
    return (1.0 - c.dp_overlap) * embedding_sync_time(nbytes, layout.pp, layout.tp, layout.shard_size, links)


def optimizer_time(n_params: int, layout: Layout, elem: float, bandwidth: float, c: PerfConstants) -> float:
    """Seconds of the optimizer step of a rank holding a stage of ``n_params`` parameters: the bytes
    per parameter it reads and writes under the layout's sharding strategy
    (:func:`ptdp.planner.sharding.optimizer_bytes_per_param` of :data:`OPT_BYTES_FULL` /
    :data:`OPT_BYTES_SHARDED`, ``elem``-byte weights) over ``bandwidth`` (achieved HBM bytes/s)
    times ``c.optimizer_efficiency``."""
    prec = layout.precision
    per_param = optimizer_bytes_per_param(
        OPT_BYTES_FULL[prec], OPT_BYTES_SHARDED[prec], layout.sharding_strategy, layout.shard_size, weight_bytes=elem
    )
    return n_params * per_param / (bandwidth * c.optimizer_efficiency)
