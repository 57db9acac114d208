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
