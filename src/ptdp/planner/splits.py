"""Uneven pipeline splits: which layers-per-stage the search tries, and how a user asks for one.

The first stage also looks up the embedding and the last runs the output layer and loss, so giving
them fewer layers balances the pipeline (Llama 3 405B: 126 layers at pp = 16 as 7, 8 x 14, 7; Llama 3
paper, arXiv:2407.21783, §3.3.2). Splits are expressed with Megatron-LM's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` and, interleaved,
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
(:mod:`ptdp.layout.pipeline.partition`). :func:`candidate_splits` and :func:`interleaved_splits`
propose them; :func:`split_options` / :func:`split_flags` say how to run one. Pure arithmetic.
"""

from __future__ import annotations

import functools
import math
from itertools import accumulate, islice, repeat
from operator import add, mul, sub

from ptdp.errors import ConfigError
from ptdp.layout.pipeline.partition import PipelineSplit, accounted_split, chunk_layer_ids, first_last_of


def candidate_splits(num_layers: int, pp: int, first_extra: float, last_extra: float) -> list[tuple[int, ...] | None]:
    """Layers per stage worth predicting, None (the even split) first when ``pp`` divides ``l``; at most 6.

    ``first_extra`` / ``last_extra``: the first / last stage's edge work in layers (>= 0). With
    ``W = l + first_extra + last_extra``, middle stages take ``c = ceil(W / pp)`` or ``c - 1`` layers and
    the rest goes to the first and last so that both are about equally busy (rounded both ways, and
    one fewer on the first, which holds the most microbatches in flight); each stage >= 1 layer.
    """
    out: list[tuple[int, ...] | None] = [None] if num_layers % pp == 0 else []
    if pp < 2:
        return out or [None]
    even = (num_layers // pp,) * pp if num_layers % pp == 0 else None
    middles: list[tuple[int | None, int]]
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


#: (embedding, loss) counted as layers, in the order the search tries them: both, the loss alone
#: (the heavier edge), the embedding alone
ACCOUNTING = ((True, True), (False, True), (True, False))


def interleaved_splits(
    num_layers: int, pp: int, accounting=ACCOUNTING, *, uneven_only: bool = True
) -> list[tuple[int, tuple[int, ...]]]:
    """(v, layers per rank) of the interleaved layouts (v > 1) that count the embedding and/or the
    loss as layers (Megatron-LM's ``--account-for-embedding/loss-in-pipeline-split``,
    :func:`ptdp.config.accounted_split`): for each way in ``accounting`` with ``(l + counted) % pp ==
    0``, every v > 1 dividing ``(l + counted) / pp`` whose split is valid (and, with ``uneven_only``,
    not the same on every rank). Llama 3 405B (126 layers) at pp = 16: v = 2, 4, 8 with both
    counted, each ``7, 8 x 14, 7``."""
    out: list[tuple[int, tuple[int, ...]]] = []
    for embedding, loss in accounting:
        units = num_layers + embedding + loss
        if pp < 2 or units % pp:
            continue
        for v in range(2, units // pp + 1):
            if (units // pp) % v:
                continue
            try:
                split = accounted_split(num_layers, pp, v, embedding=embedding, loss=loss)
            except ConfigError:
                continue
            if (len(set(split)) > 1 or not uneven_only) and (v, split) not in out:
                out.append((v, split))
    return out


@functools.lru_cache(maxsize=4096)
def accounting_of(split: tuple[int, ...], v: int) -> tuple[bool, bool] | None:
    """The (embedding, loss) counted as layers that make ``split`` at ``v`` chunks per rank (the
    first of :data:`ACCOUNTING` that does), or None. Cached: the search asks it for every
    candidate layout of a split."""
    for embedding, loss in ACCOUNTING:
        units = sum(split) + embedding + loss
        if units % (len(split) * v) == 0:
            try:
                if accounted_split(sum(split), len(split), v, embedding=embedding, loss=loss) == tuple(split):
                    return embedding, loss
            except ConfigError:
                continue
    return None


@functools.lru_cache(maxsize=65536)
def chunk_layers(split: tuple[int, ...], v: int, pp_rank: int) -> tuple[int, ...] | None:
    """Layers of each of rank ``pp_rank``'s ``v`` model chunks under an interleaved ``split`` that
    counts the embedding and/or loss as layers (:func:`accounting_of`), or None for another split."""
    counted = accounting_of(split, v)
    if counted is None:
        return None
    return tuple(
        len(chunk_layer_ids(sum(split), len(split), v, pp_rank, c, embedding=counted[0], loss=counted[1]))
        for c in range(v)
    )


def interleaved_peak(
    counts: tuple[int, ...], pp: int, m: int, pp_rank: int, *, last: bool, loss_weight: float = 0.0
) -> tuple[float, float]:
    """:func:`_interleaved_peak`, cached (the search asks for the same schedules many times; the
    loss weight matters only on the last rank)."""
    return _interleaved_peak(tuple(counts), pp, m, pp_rank, last, loss_weight if last else 0.0)


@functools.lru_cache(maxsize=65536)
def _interleaved_peak(
    counts: tuple[int, ...], pp: int, m: int, pp_rank: int, last: bool, loss_weight: float
) -> tuple[float, float]:
    """(layers, losses) held at the peak of ``layers + loss_weight * losses`` by rank ``pp_rank`` of
    an interleaved 1F1B pipeline whose ``v = len(counts)`` chunks hold ``counts`` layers, over ``m``
    microbatches: warm-up forwards ``j < 2 (pp - r - 1) + (v - 1) pp`` of chunk ``(j // pp) % v``
    ([N21] §2.2), then one forward and one backward per step, backwards from chunk ``v - 1`` down.
    On the ``last`` rank a forward of chunk ``v - 1`` also keeps the loss side until its backward.
    With equal chunks the layers are ``min(W + 1, m v) / v`` stages' worth, W the warm-up forwards."""
    v = len(counts)
    total = m * v
    warmup = min(2 * (pp - pp_rank - 1) + (v - 1) * pp, total)
    rounds = -(-total // (pp * v))  # the order repeats every pp * v chunk passes
    forward = ([c for c in counts for _ in range(pp)] * rounds)[:total]
    backward = ([c for c in reversed(counts) for _ in range(pp)] * rounds)[:total]
    held = list(accumulate(forward, initial=0))  # held[k]: layers of the first k forwards
    # the warm-up alone, then step t adds forward warmup + t (the peak is taken there) after
    # the t backwards before it have freed theirs
    layers = [held[warmup], *map(sub, islice(held, warmup + 1, None), accumulate(backward, initial=0))]
    if not last:
        return float(max(layers)), 0.0
    loss_block = [0.0] * (pp * (v - 1)) + [1.0] * pp
    f_loss = (loss_block * rounds)[:total]  # a forward of chunk v - 1 keeps the loss side
    b_loss = ((loss_block[-pp:] + loss_block[:-pp]) * rounds)[:total]  # its backward (chunk v - 1 first) frees it
    kept = list(accumulate(f_loss, initial=0.0))
    losses = [kept[warmup], *map(sub, islice(kept, warmup + 1, None), accumulate(b_loss, initial=0.0))]
    best = max(zip(map(add, layers, map(mul, losses, repeat(loss_weight))), layers, losses))
    return float(best[1]), float(best[2])


def split_options(split: tuple[int, ...] | None, v: int = 1) -> dict[str, object] | None:
    """The :class:`~ptdp.config.ParallelConfig` fields that make ``ptdp train`` run ``split`` at ``v``
    chunks per rank: the first/last stage counts where the middle stages are equal, else
    ``pipeline_layer_split``; with ``v`` > 1 the embedding / loss counted as layers and the units
    per model chunk (``num_layers_per_virtual_pipeline_stage``). ``{}`` for an even split, None for a
    split no option gives at that v."""
    if split is None:
        return {}
    if v > 1:
        counted = accounting_of(split, v)
        if counted is None:
            return None
        names = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
        return {
            **{name: True for name, on in zip(names, counted) if on},
            "num_layers_per_virtual_pipeline_stage": (sum(split) + sum(counted)) // (len(split) * v),
        }
    counts = first_last_of(split)
    if counts is None:
        return {"pipeline_layer_split": tuple(split)}
    names = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
    return {name: n for name, n in zip(names, counts) if n is not None}


def split_flags(split: tuple[int, ...] | None, v: int = 1) -> str | None:
    """:func:`split_options` as the command line of ``ptdp train`` (Megatron-LM's flag names), e.g.
    ``--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7``; None when no flag
    is needed (even split) or none gives the split."""
    options = split_options(split, v)
    if not options:
        return None
    words = []
    for name, value in options.items():
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words.append(",".join(map(str, value)) if isinstance(value, tuple) else str(value))
    return " ".join(words)


def split_report_lines(split: tuple[int, ...] | None, v: int = 1) -> list[str]:
    """What ``ptdp plan``'s text report says of a plan's split (nothing for an even split, given
    explicitly or not: no flag is needed)."""
    if split is None or split_options(split, v) == {}:
        return []
    flags = split_flags(split, v) or f"none gives this split at v = {v}"
    return [f"pipeline: layers per stage {describe_split(split)}; ptdp train (and Megatron-LM) flags: {flags}"]


def megatron_layout(
    num_layers: int, mtp_layers: int, pp: int, v: int, split: tuple[int, ...] | None, counted: tuple[bool, bool]
) -> str:
    """Megatron-Core's ``--pipeline-model-parallel-layout`` of a split whose last ``mtp_layers``
    layers are multi-token-prediction modules: one segment per virtual pipeline stage, in order
    (model chunk by chunk, pipeline rank by rank), ``E`` the embedding, ``t`` a transformer layer,
    ``m`` an MTP module, ``L`` the loss, ``|`` between segments."""
    layout = PipelineSplit(num_layers, pp, v, split, *counted)
    main = num_layers - mtp_layers
    segments = []
    for chunk in range(v):
        for rank in range(pp):
            ids = layout.chunk_layer_ids(rank, chunk)
            text = "E" if (rank, chunk) == (0, 0) else ""
            text += "".join("t" if i < main else "m" for i in ids)
            text += "L" if (rank, chunk) == (pp - 1, v - 1) else ""
            segments.append(text)
    return "|".join(segments)


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
