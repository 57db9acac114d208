"""Uneven pipeline splits: which layers-per-stage the search tries, and how a user asks for one.

A pipeline stage's microbatch is its layers plus its edge work: the first stage also looks up the
embedding, the last one runs the output layer and the loss. With ``l`` layers over ``pp`` stages,
an even split (when ``pp`` divides ``l``) leaves the last stage the busiest; giving the first and
last stages fewer layers balances them (Llama 3 405B: 126 layers at pp = 16 as 7, 8 x 14, 7,
Llama 3 paper, arXiv:2407.21783, §3.3.2). The search expresses such splits with Megatron-LM's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` (the middle
stages split the rest evenly, :func:`ptdp.engine.pipeline.partition.first_last_split`), which
``ptdp train`` runs.

:func:`candidate_splits` proposes a handful of splits from the edge work in layer equivalents
(:func:`ptdp.planner.perf.edge_layer_equivalents`); the search predicts each (memory per stage and
the busiest stage's time) and keeps the fastest that fits. Pure arithmetic, no torch.
"""

from __future__ import annotations

import math

from ptdp.spec import first_last_of


def candidate_splits(num_layers: int, pp: int, first_extra: float, last_extra: float) -> list[tuple[int, ...] | None]:
    """Layers per stage worth predicting, None (the even split) first when ``pp`` divides ``l``.

    ``first_extra`` / ``last_extra``: the first / last stage's edge work in layers (>= 0). With the
    total ``W = l + first_extra + last_extra``, a balanced stage holds ``W / pp``; for the middle
    count ``c = ceil(W / pp)`` and ``c - 1``, the ``R = l - (pp - 2) c`` remaining layers go to the
    first and last stages so that ``f + first_extra`` is about ``r + last_extra``: ``f`` rounded
    down and up (and one layer fewer on the first stage for ``c = ceil(W / pp)``, which holds the
    most microbatches in flight: less memory), each stage >= 1 layer and no edge stage above
    ``c + 1``. With pp = 2 the two counts split ``l`` the same way. At most 6 splits.
    """
    out: list[tuple[int, ...] | None] = [None] if num_layers % pp == 0 else []
    if pp < 2:
        return out or [None]
    even = (num_layers // pp,) * pp if num_layers % pp == 0 else None
    if pp == 2:
        middles = [(None, num_layers)]
    else:
        top = max(1, math.ceil((num_layers + first_extra + last_extra) / pp))
        middles = [(c, num_layers - (pp - 2) * c) for c in (top, top - 1) if c >= 1]
    for c, rest in middles:
        ideal = (rest - first_extra + last_extra) / 2
        firsts = [math.floor(ideal), math.ceil(ideal)]
        if c is None or middles[0][0] == c:
            firsts.append(math.floor(ideal) - 1)
        for f in firsts:
            last = rest - f
            if f < 1 or last < 1 or (c is not None and max(f, last) > c + 1):
                continue
            split = (f, last) if c is None else (f,) + (c,) * (pp - 2) + (last,)
            if split != even and split not in out:
                out.append(split)
    return out


def split_flags(split: tuple[int, ...] | None) -> str | None:
    """The flags of ``ptdp train`` (and Megatron-LM) that give ``split``: the first/last stage
    counts where the middle stages are equal, else ``--pipeline-layer-split``; None for an even
    split (no flag needed)."""
    if split is None:
        return None
    counts = first_last_of(split)
    if counts is None:
        return "--pipeline-layer-split " + ",".join(map(str, split))
    first, last = counts
    flags = [f"--decoder-first-pipeline-num-layers {first}" if first is not None else "",
             f"--decoder-last-pipeline-num-layers {last}" if last is not None else ""]
    return " ".join(f for f in flags if f) or None


def split_report_lines(split: tuple[int, ...] | None) -> list[str]:
    """What ``ptdp plan``'s text report says of a plan's split (nothing for an even split)."""
    if split is None:
        return []
    return [f"pipeline: layers per stage {describe_split(split)}; ptdp train (and Megatron-LM) flags: "
            f"{split_flags(split)}"]


def describe_split(split: tuple[int, ...]) -> str:
    """``(7, 8, ..., 8, 7)`` -> ``"7, 8 x 14, 7"``: runs of equal counts shortened."""
    parts, i = [], 0
    while i < len(split):
        j = i
        while j < len(split) and split[j] == split[i]:
            j += 1
        parts.append(str(split[i]) if j - i == 1 else f"{split[i]} x {j - i}")
        i = j
    return ", ".join(parts)
