"""Which transformer layers each pipeline stage (and each model chunk) holds: pure arithmetic,
used by the model, the configuration rules and the planner (no torch)."""

from __future__ import annotations

from ptdp.spec.errors import ConfigError


def stage_layer_counts(num_layers: int, pp: int, split: tuple[int, ...] | None) -> list[int]:
    """Layers held by each of the pp stages; raises ConfigError if they do not add up exactly.

    Even (``num_layers % pp == 0``) unless ``split`` lists the layers per stage explicitly (pp
    entries, each >= 1, summing to ``num_layers``: no layer is ever dropped silently).
    """
    if split is None:
        if num_layers % pp != 0:
            raise ConfigError(
                f"num_layers={num_layers} is not divisible by pipeline_model_parallel_size={pp} "
                f"(rule: num_layers % pp == 0); give an explicit --pipeline-layer-split to split "
                f"unevenly"
            )
        return [num_layers // pp] * pp
    if len(split) != pp or any(n < 1 for n in split) or sum(split) != num_layers:
        raise ConfigError(
            f"pipeline_layer_split={list(split)} must have pp={pp} entries, each >= 1, summing to "
            f"num_layers={num_layers} (sum is {sum(split)})"
        )
    return list(split)


def chunk_layer_counts(num_layers: int, pp: int, split: tuple[int, ...] | None,
                       layers_per_chunk: int | None) -> list[int]:
    """Layers of each model chunk (a stage, or a virtual stage when interleaved), the unit that
    recomputation works on; the layout rules must hold."""
    if layers_per_chunk:
        return [layers_per_chunk] * (num_layers // layers_per_chunk)
    return stage_layer_counts(num_layers, pp, split)


def virtual_stages(num_layers: int, pp: int, layers_per_chunk: int | None) -> int:
    """v, the model chunks per pipeline rank: ``num_layers / (pp * layers_per_chunk)`` (1 without)."""
    return num_layers // (pp * layers_per_chunk) if layers_per_chunk else 1


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
