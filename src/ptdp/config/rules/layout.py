"""Rules of the tp x pp x dp layout, the batch and the pipeline schedule (Narayanan et al. SC21,
arXiv:2104.04473, §2.2)."""

from __future__ import annotations

from ptdp.config.fields import SCHEDULES, SCHEDULES_NOT_TRAINED
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.rules.shape import model_violations
from ptdp.errors import V, Violation
from ptdp.layout.pipeline.placement import V_SCHEDULES, placement_of


def layout_violations(
    m: ModelConfig,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch_size: int,
    global_batch_size: int,
    split: tuple[int, ...] | None = None,
    first: int | None = None,
    last: int | None = None,
    embedding: bool = False,
    loss: bool = False,
) -> list[Violation]:
    """The rules tying a model and batch to a tp x pp x dp layout (shared with the planner)."""
    out = model_violations(m, tp, pp, split, first=first, last=last, embedding=embedding, loss=loss)
    b, big_b = micro_batch_size, global_batch_size
    if big_b % (b * dp) != 0:
        out.append(
            V(
                "B % (b * dp)",
                f"global_batch_size={big_b} is not divisible by micro_batch_size*dp = {b}*{dp} = "
                f"{b * dp} (rule: B % (b * dp) == 0)",
                global_batch_size=big_b,
                micro_batch_size=b,
                dp=dp,
            )
        )
    return out


def schedule_violations(p: ParallelConfig, num_layers: int, num_microbatches: int) -> list[Violation]:
    """Rules of the pipeline schedule and its model chunks (Narayanan et al. SC21, §2.2); zb-v and
    dualpipev run two chunks per rank in a V (Qi et al., arXiv:2405.15362), dualpipev with
    num_microbatches >= 2 pp (:func:`ptdp.layout.pipeline.schedule.check_schedule_args`)."""
    kind, per_chunk, v, pp, m = (
        p.schedule,
        p.num_layers_per_virtual_pipeline_stage,
        p.virtual_pipeline_model_parallel_size,
        p.pp,
        num_microbatches,
    )
    if kind not in SCHEDULES:
        return [V("option", f"pipeline_schedule={kind!r} must be one of {SCHEDULES}")]
    for name, value in (
        ("num_layers_per_virtual_pipeline_stage", per_chunk),
        ("virtual_pipeline_model_parallel_size", v),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return [V("option", f"{name}={value!r} must be a positive integer")]
    out = []
    units = num_layers + p.accounted_units
    counted = f" + {p.accounted_units} (embedding/loss counted as layers) = {units}" if p.accounted_units else ""
    if per_chunk is not None:
        if units % (pp * per_chunk):
            out.append(
                V(
                    "interleaving",
                    f"num_layers={num_layers}{counted} is not divisible by pp * "
                    f"num_layers_per_virtual_pipeline_stage = {pp}*{per_chunk} = {pp * per_chunk} (rule: layers "
                    f"split evenly over pp * v model chunks)",
                )
            )
        elif v is not None and units // (pp * per_chunk) != v:
            out.append(
                V(
                    "interleaving",
                    f"virtual_pipeline_model_parallel_size={v} contradicts num_layers_per_virtual_pipeline_stage="
                    f"{per_chunk}, which gives (num_layers{counted}) / (pp * {per_chunk}) = "
                    f"{units // (pp * per_chunk)} model chunks per rank (give one of them)",
                )
            )
    elif v is not None and v > 1 and units % (pp * v):
        out.append(
            V("interleaving", f"num_layers={num_layers}{counted} is not divisible by pp*v = {pp}*{v} = {pp * v}")
        )
    if kind in V_SCHEDULES:
        out += _v_shape_violations(kind, per_chunk, v, pp, m, units, f"num_layers={num_layers}{counted}")
    chunked = p.interleaved or kind in V_SCHEDULES
    if chunked:
        name = (
            "num_layers_per_virtual_pipeline_stage"
            if per_chunk is not None
            else f"virtual_pipeline_model_parallel_size={v}"
        )
        if kind not in ("interleaved-1f1b", *V_SCHEDULES):
            out.append(V("interleaving", f"{name} needs the interleaved-1f1b schedule, not {kind}"))
        if p.pipeline_layer_split is not None:
            out.append(V("interleaving", "pipeline_layer_split cannot be combined with virtual pipeline stages"))
        if p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None:
            out.append(
                V(
                    "interleaving",
                    f"decoder_first_pipeline_num_layers={p.decoder_first_pipeline_num_layers} / "
                    f"decoder_last_pipeline_num_layers={p.decoder_last_pipeline_num_layers} cannot be combined "
                    f"with virtual pipeline stages (ptdp's interleaved schedule gives every model chunk "
                    f"num_layers / (pp * v) layers)",
                )
            )
    if kind == "interleaved-1f1b":
        if per_chunk is None and v is None:
            out.append(
                V(
                    "interleaving",
                    "the interleaved-1f1b schedule needs num_layers_per_virtual_pipeline_stage (or "
                    "virtual_pipeline_model_parallel_size)",
                )
            )
        if pp < 2:
            out.append(
                V("interleaving", f"the interleaved-1f1b schedule needs pipeline_model_parallel_size >= 2, got {pp}")
            )
        elif m % pp:
            out.append(
                V(
                    "interleaving",
                    f"the interleaved-1f1b schedule needs num_microbatches % pp == 0: "
                    f"num_microbatches={m} (= global_batch_size / (micro_batch_size * dp)), pp={pp}",
                    num_microbatches=m,
                    pp=pp,
                )
            )
    return out


def _v_shape_violations(
    kind: str, per_chunk: int | None, v: int | None, pp: int, m: int, units: int, layers: str
) -> list[Violation]:
    """A V schedule's rules: two chunks per rank, the layers split over 2 pp chunks; dualpipev
    also m >= 2 pp."""
    out = []
    chunks = v if v is not None else units // (pp * per_chunk) if per_chunk is not None else 2
    if chunks != 2:
        out.append(
            V(
                "interleaving",
                f"the {kind} schedule runs two model chunks per rank in a V: virtual_pipeline_model_parallel_size "
                f"must be 2, got {chunks}",
            )
        )
    elif v is None and per_chunk is None and units % (2 * pp):
        out.append(
            V(
                "interleaving",
                f"{layers} is not divisible by 2 * pp = {2 * pp} (the {kind} schedule's two model chunks per rank)",
            )
        )
    if kind == "dualpipev" and m < 2 * pp:
        out.append(
            V(
                "interleaving",
                f"the dualpipev schedule needs num_microbatches >= 2 * pp: num_microbatches={m} "
                f"(= global_batch_size / (micro_batch_size * dp)), pp={pp}",
                num_microbatches=m,
                pp=pp,
            )
        )
    return out


def untrained_schedule_violations(p: ParallelConfig, tied: bool) -> list[Violation]:
    """The pipeline schedules ``ptdp train`` does not run yet (``auto``), and the V placement's
    tied embedding (one parameter used by two chunks of rank 0) with parameters sharded (``tied``:
    the model ties its embedding and output weights)."""
    if placement_of(p.schedule) == "v" and p.sharding_strategy == "optim_grads_params" and tied:
        return [
            V(
                "option",
                f"--pipeline-schedule {p.schedule} with --data-parallel-sharding-strategy optim_grads_params "
                f"and tied embeddings: ptdp train does not run it yet (add --untie-embeddings-and-output-weights, "
                f"or shard with optim_grads)",
            )
        ]
    if p.schedule not in SCHEDULES_NOT_TRAINED:
        return []
    return [
        V(
            "option",
            f"--pipeline-schedule {p.schedule}: ptdp train does not run it yet (ptdp schedule shows its "
            f"program and bubble; train with one of "
            f"{', '.join(k for k in SCHEDULES if k not in SCHEDULES_NOT_TRAINED)})",
        )
    ]
