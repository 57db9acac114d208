"""Data-parallel and optimizer time of one step: the end-of-step terms of the step-time model.

Per step over ``d`` ranks (:func:`ptdp.planner.time.collectives.hierarchical_all_reduce_time`):
``no_shard`` one all-reduce of the fp32 gradients; ``optim`` a reduce-scatter of them and an
all-gather of the 16-bit weights [N21 §3.2]; ``optim_grads`` one reduce-scatter per microbatch, each
behind the next backward, the last exposed (per model chunk in one interleaved round, Dubey et al.
2024, §3.3.2); ``optim_grads_params`` also two all-gathers of each unit per microbatch. Plus the tied
embedding's all-reduce and the memory-bound optimizer update.
"""

from __future__ import annotations

from ptdp.config.model import ModelConfig
from ptdp.layout.buckets import chunk_by_chunk, chunk_rounds
from ptdp.layout.pipeline.placement import placement_of
from ptdp.planner.candidate import Candidate
from ptdp.planner.memory.fp8 import layer_fp8_weights
from ptdp.planner.memory.params import layer_param_count
from ptdp.planner.memory.strategies import check_strategy
from ptdp.planner.time.collectives import Links, dp_group_per_node, embedding_sync_time, hierarchical_all_reduce_time
from ptdp.planner.time.constants import PerfConstants

#: Bytes per parameter the optimizer step reads and writes (mixed precision, fp32 main weights):
#: on every parameter: write the 16-bit weight (2), read the gradient for the global norm (4),
#: zero the gradient buffer (4); on the parameters this rank updates (1/dp of them with the
#: distributed optimizer): read the gradient (4), read and write the main weight, m and v (24).
OPT_BYTES_FULL = {"bf16": 10.0, "fp16": 10.0, "fp32": 8.0, "fp8": 10.0}
OPT_BYTES_SHARDED = {"bf16": 28.0, "fp16": 28.0, "fp32": 28.0, "fp8": 28.0}


def dp_comm_time(
    model: ModelConfig,
    layout: Candidate,
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
    """Exposed seconds of the data-parallel communication of the stage's ``n_params`` parameters over
    ``dp * cp`` ranks under the layout's sharding strategy (:func:`sharded_dp_times`): fp32 (or bf16) gradients,
    ``elem``-byte weights, units of one layer, hidden behind one microbatch's backward and one layer's
    compute. ``first_stage``: backward skips the embeddings' unit unless tied at pp = 1. With
    ``c.overlap_window`` the end-of-step part is hidden up to one microbatch's compute (``busiest[0]``).
    """
    per_layer = layer_param_count(model, layout.tp)
    unit = max(per_layer, n_params - stage_layers * per_layer)
    lookup_only = first_stage and not (layout.pp == 1 and model.tied)  # its embeddings' unit
    microbatch_backward = busiest[0] * 2.0 / 3.0
    v = layout.virtual_stages
    chunks = (
        v if chunk_by_chunk(layout.sharding_strategy, layout.shard_size, v, layout.num_microbatches, layout.pp) else 1
    )

    # --fp8-param-gather: the FP8 GEMMs' weights are all-gathered in 1 byte
    fp8_saved = (elem - 1.0) if layout.fp8_param_gather and layout.precision == "fp8" else 0.0
    fp8_layer = fp8_saved * layer_fp8_weights(model, layout.tp)

    def exposed(end_overlap: float) -> float:
        return sharded_dp_times(
            layout.sharding_strategy,
            grad_bytes=layout.grad_bytes * n_params,
            param_bytes=elem * n_params - stage_layers * fp8_layer,
            unit_param_bytes=elem * unit - (fp8_layer if unit == per_layer else 0.0),
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
            rounds=chunk_rounds(layout.num_microbatches, layout.pp) if chunks > 1 else 1,
            # kept gathered: once per stretch of microbatches in flight, m on the last stage (and
            # at pp = 1), the most any stage gathers
            kept_gathers=None if layout.parallel.reshard_after_forward else layout.num_microbatches,
            backward_units=stage_layers + 1 - int(lookup_only),
        )

    if not c.overlap_window:
        return exposed(c.dp_overlap)
    without_end = exposed(1.0)
    return without_end + max(0.0, exposed(c.dp_overlap) - without_end - busiest[0])


def embedding_sync_dp_time(model: ModelConfig, layout: Candidate, v_pad: int, links: Links, c: PerfConstants) -> float:
    """Exposed seconds of the all-reduce of the tied word embedding's float32 gradient
    (``V_pad / tp x h`` on one tp rank) between the first and the last pipeline stage
    (:func:`ptdp.planner.time.collectives.embedding_sync_time`), the part ``c.dp_overlap`` does not hide; 0
    for an untied model, pp = 1 or the V placement (one rank holds the only copy)."""
    if not (model.tied and layout.pp > 1) or placement_of(layout.parallel.schedule) == "v":
        return 0.0
    nbytes = layout.grad_bytes * v_pad // layout.tp * model.hidden_size
    return (1.0 - c.dp_overlap) * embedding_sync_time(nbytes, layout.pp, layout.tp, layout.shard_size, links)


def optimizer_time(n_params: int, layout: Candidate, elem: float, bandwidth: float, c: PerfConstants) -> float:
    """Seconds of the optimizer step of a rank holding a stage of ``n_params`` parameters: the bytes
    per parameter it reads and writes under the layout's sharding strategy
    (:func:`optimizer_bytes_per_param` of :data:`OPT_BYTES_FULL` /
    :data:`OPT_BYTES_SHARDED`, ``elem``-byte weights) over ``bandwidth`` (achieved HBM bytes/s)
    times ``c.optimizer_efficiency``."""
    prec = layout.precision
    per_param = optimizer_bytes_per_param(
        OPT_BYTES_FULL[prec], OPT_BYTES_SHARDED[prec], layout.sharding_strategy, layout.shard_size, weight_bytes=elem
    )
    return n_params * per_param / (bandwidth * c.optimizer_efficiency)


def expert_optimizer_time(n_experts: int, layout: Candidate, elem: float, bandwidth: float, c: PerfConstants) -> float:
    """Seconds of the optimizer step over a rank's ``n_experts`` routed-expert parameters in their own
    buffer (ep or etp > 1): their state sharded over the edp ranks with any sharding strategy (ZeRO-1),
    as :func:`optimizer_time`."""
    if not n_experts:
        return 0.0
    prec = layout.precision
    strategy = "optim" if layout.sharding_strategy != "no_shard" else "no_shard"
    per_param = optimizer_bytes_per_param(
        OPT_BYTES_FULL[prec], OPT_BYTES_SHARDED[prec], strategy, layout.edp, weight_bytes=elem
    )
    return n_experts * per_param / (bandwidth * c.optimizer_efficiency)


def edp_comm_time(layout: Candidate, n_experts: int, links: Links, c: PerfConstants, microbatch: float) -> float:
    """Exposed seconds of the expert-data-parallel reduction of a rank's ``n_experts`` routed-expert
    gradients over the ``edp`` ranks holding the same experts (every ``ep etp``-th rank of the
    stage, ``gpus_per_node / (ep etp)`` of them in a node): an all-reduce, or with any sharding
    strategy a reduce-scatter and the all-gather of the updated weights (ZeRO-1); at the end of the
    step, hidden up to one micro-batch's compute (``microbatch``) with ``c.overlap_window``."""
    edp = layout.edp
    if not n_experts or edp <= 1:
        return 0.0
    per_node = max(1, links.gpus_per_node // (layout.ep * layout.etp))
    grads = layout.grad_bytes * n_experts
    if layout.sharding_strategy == "no_shard":
        full = hierarchical_all_reduce_time(grads, edp, per_node, links)
    else:
        weights = (1.0 if layout.precision == "fp8" and layout.fp8_param_gather else 2.0) * n_experts
        full = 0.5 * hierarchical_all_reduce_time(grads, edp, per_node, links)
        full += 0.5 * hierarchical_all_reduce_time(weights, edp, per_node, links)
    exposed = (1.0 - c.dp_overlap) * full
    return max(0.0, exposed - microbatch) if c.overlap_window else exposed


def optimizer_bytes_per_param(
    full: float, sharded: float, strategy: str, shard: int, *, grad_bytes: float = 8.0, weight_bytes: float = 2.0
) -> float:
    """Memory traffic of the optimizer step per parameter of the stage.

    ``full`` bytes touch every parameter and ``sharded`` only the rank's ``1/shard``: ``optim`` shards the
    update; ``optim_grads`` also the gradient's norm read and zeroing (``grad_bytes``);
    ``optim_grads_params`` also the 16-bit weight write (``weight_bytes``).
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
    rounds: int = 1,
    kept_gathers: int | None = None,
    backward_units: int | None = None,
) -> float:
    """Exposed seconds per step of the data-parallel communication of ``strategy`` over ``shard`` ranks
    (the module docstring's model). Bytes are one rank's: ``grad_bytes`` fp32 gradients, ``param_bytes``
    16-bit weights, ``unit_param_bytes`` one unit's; ``layer_forward`` / ``layer_backward`` hide the
    next gather, ``microbatch_backward`` the reduce-scatter; ``end_overlap``: the hidden fraction at the
    end; ``chunks`` > 1: reduced chunk by chunk, once in each of ``rounds``; ``kept_gathers``: forward-only gathers per step with
    ``--no-reshard-after-forward``; ``backward_units``: units gathered again per backward (None: ``units``).
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
    if chunks > 1:  # one reduce-scatter per chunk and round, after the chunk's m / rounds backwards there
        last_rs = 0.5 * hierarchical_all_reduce_time(grad_bytes / chunks, shard, per_node, links)
        hidden_rs = (rounds * chunks - 1) * max(0.0, last_rs - m / rounds * microbatch_backward / chunks)
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
