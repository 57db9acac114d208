"""Why the planner picked its layout: a few lines comparing the fastest plan with the runner-up,
and a fixed layout with the best one the search finds when nothing is fixed.

The comparison is term by term over the :class:`~ptdp.planner.candidate.TimeBreakdown` of the two
plans and over the memory of the most loaded GPU. The terms that make up most of the difference in
step time are named (largest first, until they explain at least 80% of what the winner gains), with
those that work the other way; a difference below :data:`NEAR_TIE` of the step is a near tie.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ptdp.errors import Violation
from ptdp.planner.candidate import Candidate, Plan
from ptdp.planner.inputs.hardware import GiB
from ptdp.planner.splits import describe_split, split_flags

NEAR_TIE = 0.02
"""Relative step-time difference under which two layouts are called a near tie."""

_LAYOUT_NAMES = {
    "micro_batch_size": "b",
    "virtual_stages": "v",
    "sequence_parallel": "sp",
    "distributed_optimizer": "dist-opt",
    "layer_split": "layer split",
    "global_batch_size": "B",
}


def _value(value, field: str = "") -> str:
    """A layout field's value in the report's words: on/off, a layer split as ``3,4x30,3`` (None:
    ``even``), other None as ``not set``."""
    if value is None:
        return "even" if field == "layer_split" else "not set"
    if value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):  # a layer split: 3,4x30,3
        return describe_split(value).replace(" x ", "x").replace(", ", ",")
    return str(value)


def layout_differences(a: Plan, b: Plan) -> list[str]:
    """``"name a vs b"`` for every layout field where the two plans differ (Megatron's short names;
    the schedule unless both are the one their v implies, 1f1b or interleaved-1f1b)."""
    left, right = a.layout.fields(), b.layout.fields()
    implied = {left["schedule"], right["schedule"]} <= {"1f1b", "interleaved-1f1b"}
    for side in (left, right):
        side.pop("distributed_optimizer")  # sharding says it
        if implied:  # v says it
            side.pop("schedule")
    return [
        f"{_LAYOUT_NAMES.get(k, k)} {_value(left[k], k)} vs {_value(right[k], k)}"
        for k in left
        if left[k] != right.get(k)
    ]


def layout_flags(layout: Candidate) -> str:
    """The ``ptdp plan`` flags that fix ``layout`` (the request's batch and precision aside), e.g.
    ``--tp 8 --pp 16 --dp 8 --micro-batch-size 1 --virtual-pipeline-stages 2 --recompute-granularity
    none --sequence-parallel --data-parallel-sharding-strategy optim``; flags at ptdp's defaults
    (bucket size, overlap, resharding, the schedule v implies) only when the layout differs from them,
    e.g. ``--pipeline-schedule zb-h1``."""
    v, split = layout.virtual_stages, split_flags(layout.layer_split, layout.virtual_stages)
    words = [f"--tp {layout.tp}"]
    if layout.cp > 1:
        words += [f"--cp {layout.cp}", f"--cp-comm-type {layout.parallel.cp_comm_type}"]
    words += [f"--pp {layout.pp}", f"--dp {layout.dp}", f"--micro-batch-size {layout.micro_batch_size}"]
    if layout.ep * layout.etp > 1:
        words += [f"--ep {layout.ep}", f"--etp {layout.etp}"]
    if layout.parallel.moe_token_dispatcher_type != "alltoall":
        words.append(f"--moe-token-dispatcher-type {layout.parallel.moe_token_dispatcher_type}")
    if layout.parallel.schedule not in ("1f1b", "interleaved-1f1b"):  # the one v implies
        words.append(f"--pipeline-schedule {layout.parallel.schedule}")
    if v > 1 and "--num-layers-per-virtual-pipeline-stage" not in (split or ""):
        words.append(f"--virtual-pipeline-stages {v}")
    words += [split] if split else []
    words += [
        "--recompute-granularity selective --selective-ac-option op"
        if layout.recompute == "op"
        else f"--recompute-granularity {layout.recompute}",
        "--sequence-parallel" if layout.parallel.sequence_parallel else "--no-sequence-parallel",
        f"--data-parallel-sharding-strategy {layout.sharding_strategy}",
    ]
    if layout.parallel.ddp_bucket_size is not None:
        words.append(f"--ddp-bucket-size {layout.parallel.ddp_bucket_size}")
    words += [] if layout.parallel.overlap_grad_reduce else ["--no-overlap-grad-reduce"]
    words += [] if layout.parallel.reshard_after_forward else ["--no-reshard-after-forward"]
    words += ["--grad-reduce-in-bf16"] if layout.bf16_grads else []
    words += ["--fp8-param-gather"] if layout.fp8_param_gather else []
    words += [f"--recompute-modules {' '.join(layout.recompute_modules)}"] if layout.recompute_modules else []
    if layout.optimizer_state is not None:
        words.append("--use-precision-aware-optimizer")
        flags = ("--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")
        words += [f"{flag} {dtype}" for flag, dtype in zip(flags, layout.optimizer_dtypes) if dtype != "fp32"]
    return " ".join(words)


def _time_terms(plan: Plan) -> dict[str, float]:
    time = plan.need_time()
    return {f.name: getattr(time, f.name) for f in dataclasses.fields(time)}


def _seconds(x: float) -> str:
    return f"{x:.3g} s"


def deciding_terms(faster: Plan, slower: Plan, share: float = 0.8) -> tuple[list[str], list[str]]:
    """The step-time terms where ``faster`` gains (largest first, until they make up ``share`` of
    its total gain) and those where it loses, each as ``"term -x s"`` / ``"term +x s"``."""
    a, b = _time_terms(faster), _time_terms(slower)
    deltas = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    gains = [(d, k) for d, k in deltas if d > 0]
    total_gain = sum(d for d, _ in gains)
    picked, acc = [], 0.0
    for d, k in gains:
        picked.append(f"{k} -{_seconds(d)}")
        acc += d
        if acc >= share * total_gain:
            break
    losses = [f"{k} +{_seconds(-d)}" for d, k in sorted(deltas) if d < 0 and -d >= 0.02 * max(total_gain, 1e-30)]
    return picked, losses


def compare(faster: Plan, slower: Plan, *, faster_name: str, slower_name: str) -> list[str]:
    """Lines saying why ``faster`` beats ``slower`` (both fitting plans with times)."""
    step_a, step_b = faster.need_time().step, slower.need_time().step
    rel = (step_b - step_a) / step_b if step_b > 0 else 0.0
    diff = layout_differences(faster, slower)
    lines = [f"{faster_name} vs {slower_name}: {'; '.join(diff) if diff else 'same layout'}"]
    if rel < NEAR_TIE:
        lines.append(
            f"  a near tie: {_seconds(step_a)} vs {_seconds(step_b)} per step ({100 * rel:.1f}% apart, "
            f"within the model's error)"
        )
    else:
        lines.append(f"  {100 * rel:.1f}% faster ({_seconds(step_a)} vs {_seconds(step_b)} per step)")
    gains, losses = deciding_terms(faster, slower)
    if gains:
        text = "  decided by " + ", ".join(gains)
        if losses:
            text += "; against it: " + ", ".join(losses)
        lines.append(text)
    mem_a, mem_b = faster.need_memory().total / GiB, slower.need_memory().total / GiB
    lines.append(f"  memory on the most loaded GPU: {mem_a:.1f} vs {mem_b:.1f} GiB")
    return lines


def explain_pick(plans: Sequence[Plan]) -> list[str]:
    """Why the first of the ranked fitting ``plans`` beats the second (empty with fewer than two)."""
    if len(plans) < 2:
        return []
    return ["why #1:", *compare(plans[0], plans[1], faster_name="#1", slower_name="#2")]


def distance_from_best(chosen: Plan | None, best: Plan | None) -> list[str]:
    """How far the best layout under the user's fixed choices (``chosen``) is from the best one
    the search finds with nothing fixed (``best``)."""
    if best is None:
        return []
    if chosen is None:
        return [f"with nothing fixed the search finds a fitting layout: {layout_flags(best.layout)}"]
    if best.layout == chosen.layout or best.need_time().step >= chosen.need_time().step:
        return ["your fixed choices include the best layout the search finds with nothing fixed"]
    return ["the best layout with nothing fixed:", *compare(best, chosen, faster_name="best", slower_name="yours")]


def explain_experts(plans: Sequence[Plan], rejected: list[tuple[Plan, Violation]], gpus_per_node: int) -> list[str]:
    """For a mixture-of-experts search: the share of the best plan's step its exchanges take and
    where its ``ep x etp`` group runs (in a node or over the network), and why the best plan with
    its group on the other side of the node boundary loses: slower, or over the GPU's memory (the
    least memory of those rejected for it). Empty without plans or at ep = etp = 1 everywhere."""
    if not plans:
        return []
    best = plans[0]
    group = best.layout.ep * best.layout.etp
    if group == 1:  # one rank holds every expert: no exchange
        alt = next((p for p in plans if p.layout.ep * p.layout.etp > 1), None)
        if alt is None:
            return []
        rel = alt.need_time().step / best.need_time().step - 1.0  # its step over the best's
        return [
            f"experts: every rank holds all of them (ep 1, no exchange); the best with ep {alt.layout.ep}, etp "
            f"{alt.layout.etp} is {100 * rel:.1f}% slower"
        ]
    time = best.need_time()
    where = "inside a node" if group <= gpus_per_node else f"over the network ({group} ranks, {gpus_per_node} per node)"
    name = f"ep {best.layout.ep}" + (f" x etp {best.layout.etp}" if best.layout.etp > 1 else "")
    lines = [
        f"experts: {name} runs its all-to-alls {where}: {100 * time.ep_comm / time.step:.0f}% of the step "
        f"exposed, the expert-data-parallel reduction {100 * time.edp_comm / time.step:.0f}%"
    ]
    inside = group <= gpus_per_node
    alt = next((p for p in plans if (p.layout.ep * p.layout.etp <= gpus_per_node) != inside), None)
    side = "beyond a node" if inside else "inside a node"
    if alt is not None:
        rel = alt.need_time().step / time.step - 1.0  # its step over the best's
        gains, _ = deciding_terms(best, alt)
        lines.append(
            f"  the best with ep x etp {side} (ep {alt.layout.ep}, etp {alt.layout.etp}) is {100 * rel:.1f}% slower"
            + (f": {', '.join(gains)}" if gains else "")
        )
        return lines
    over = [
        p
        for p, _ in rejected
        if p.memory is not None and (p.layout.ep * p.layout.etp <= gpus_per_node) != inside and p.layout.ep > 1
    ]
    if over:
        least = min(over, key=lambda p: p.need_memory().total)
        lines.append(
            f"  ep x etp {side} does not fit: at best ep {least.layout.ep}, etp {least.layout.etp} needs "
            f"{least.need_memory().total / GiB:.1f} GiB on its most loaded GPU ({least.reasons[0]})"
        )
    return lines
