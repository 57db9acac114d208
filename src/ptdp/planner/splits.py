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


def expand_megatron_layout(text: str) -> list[str]:
    """The segments of a Megatron-Core ``--pipeline-model-parallel-layout`` (``E``, ``t``, ``m``,
    ``L``, ``|`` between segments, ``X*N`` and ``(...)*N`` repeating). ValueError naming what is
    wrong."""
    chars = [c for c in text if not c.isspace()]
    pos = 0

    def group(depth: int) -> str:
        nonlocal pos
        out = ""
        while pos < len(chars):
            c = chars[pos]
            if c == ")":
                if depth == 0:
                    raise ValueError(f"an unmatched ')' at character {pos + 1}")
                pos += 1
                return out
            pos += 1
            if c == "(":
                item = group(depth + 1)
            elif c in "EtmL|":
                item = c
            else:
                raise ValueError(f"{c!r} at character {pos}: a layout has E, t, m, L, |, (...) and *N")
            if pos < len(chars) and chars[pos] == "*":
                digits = ""
                pos += 1
                while pos < len(chars) and chars[pos].isdigit():
                    digits += chars[pos]
                    pos += 1
                if not digits:
                    raise ValueError(f"'*' at character {pos} needs a count")
                item *= int(digits)
            out += item
        if depth:
            raise ValueError("an unmatched '('")
        return out

    return group(0).split("|")


def layout_split(
    text: str, num_layers: int, mtp_layers: int, pp: int, v: int | None
) -> tuple[int, tuple[int, ...] | None, tuple[bool, bool], str | None]:
    """(v, the layer split at v = 1 or None, (embedding, loss) counted as layers, the layout
    planned where it differs) that plan the Megatron-Core layout ``text`` of ``num_layers`` layers
    (the last ``mtp_layers`` MTP modules) over ``pp`` stages, as :func:`megatron_layout` writes it.
    Interleaved chunks (v > 1) are planned even, counting the embedding and the loss as layers or
    not: an uneven layout gets the nearest of those (fewest layers moved). ValueError naming the
    rule the layout breaks."""
    segments = expand_megatron_layout(text)
    if len(segments) % pp:
        raise ValueError(f"{len(segments)} segments do not split over pp = {pp} stages")
    chunks = len(segments) // pp
    if v is not None and v != chunks:
        raise ValueError(f"{len(segments)} segments over pp = {pp} are v = {chunks} chunks, not {v}")
    order = "".join(segments)
    if order.count("E") != 1 or not segments[0].startswith("E"):
        raise ValueError("E (the embedding) begins the first segment, once")
    if order.count("L") != 1 or not segments[-1].endswith("L"):
        raise ValueError("L (the loss) ends the last segment, once")
    layers = _layers_of(order)
    main = num_layers - mtp_layers
    if layers != "t" * layers.count("t") + "m" * layers.count("m"):
        raise ValueError("the MTP modules (m) come after every transformer layer (t)")
    if (layers.count("t"), layers.count("m")) != (main, mtp_layers):
        raise ValueError(
            f"{layers.count('t')} t and {layers.count('m')} m, the model has {main} transformer layers "
            f"and {mtp_layers} MTP modules"
        )
    counts = [len(_layers_of(seg)) for seg in segments]
    if chunks == 1:
        return 1, (None if len(set(counts)) == 1 else tuple(counts)), (False, False), None
    options = []
    for counted in ((False, False), (True, False), (False, True), (True, True)):
        try:
            written = megatron_layout(num_layers, mtp_layers, pp, chunks, None, counted)
        except ValueError:  # these layers do not split evenly so
            continue
        moved = sum(abs(len(_layers_of(w)) - n) for w, n in zip(written.split("|"), counts))
        options.append((moved, counted, written))
    if not options:
        raise ValueError(
            f"{num_layers} layers split evenly over pp * v = {pp * chunks} chunks neither as they are nor "
            "with the embedding and/or the loss counted as layers: the planner plans interleaved chunks even"
        )
    moved, counted, written = min(options, key=lambda o: o[0])
    return chunks, None, counted, (None if moved == 0 else written)


def _layers_of(segment: str) -> str:
    """A layout segment's layers (``t`` and ``m``), its embedding and loss left out."""
    return segment.replace("E", "").replace("L", "")


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
