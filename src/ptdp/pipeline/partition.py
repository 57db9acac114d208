"""Which transformer layers each pipeline stage holds."""

from __future__ import annotations

from ptdp.config import stage_layer_counts


def stage_layer_ids(num_layers: int, pp_size: int, pp_rank: int, split: tuple[int, ...] | None = None) -> range:
    """Global indices of the layers on stage ``pp_rank``: consecutive, every layer on exactly one stage.

    Even split (``num_layers % pp_size == 0``) unless ``split`` lists the layers per stage explicitly;
    raises ``ConfigError`` otherwise.
    """
    counts = stage_layer_counts(num_layers, pp_size, split)
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


def chunk_layer_ids(num_layers: int, pp_size: int, virtual_stages: int, pp_rank: int, chunk: int) -> range:
    """Layers of model chunk ``chunk`` on rank ``pp_rank``: virtual stage k = chunk * pp + pp_rank
    holds layers [k L / (pp v), (k + 1) L / (pp v)) (Narayanan et al. SC21, §2.2: rank r holds
    chunks r, r + p, r + 2p, ...). Raises ValueError unless L % (pp v) == 0."""
    per = num_layers // (pp_size * virtual_stages)
    if per * pp_size * virtual_stages != num_layers:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp*v = {pp_size}*{virtual_stages}")
    stage = chunk * pp_size + pp_rank
    return range(stage * per, (stage + 1) * per)
