"""Which transformer layers each pipeline stage (and each model chunk) holds: pure arithmetic,
used by the model, the configuration rules and the planner (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.errors import ConfigError
from ptdp.layout.pipeline.placement import stage_owner, virtual_stage


@dataclass(frozen=True)
class PipelineSplit:
    """Where the layers sit, resolved once from the split options (:func:`pipeline_split`).

    Attributes:
        num_layers, pp: the model's layers and the pipeline size.
        virtual_stages: v, model chunks per pipeline rank (interleaved schedule when > 1).
        layer_split: layers per pipeline stage when the options give them (explicit, first/last
            counts, or the embedding / loss counted as layers); None: even.
        embedding, loss: the embedding / the output layer + loss count as one layer each of the
            split over ``pp * v`` chunks (:func:`accounted_split`).
        placement: which virtual stage each chunk is (:mod:`ptdp.layout.pipeline.placement`).
    """

    num_layers: int
    pp: int
    virtual_stages: int = 1
    layer_split: tuple[int, ...] | None = None
    embedding: bool = False
    loss: bool = False
    placement: str = "looped"

    @property
    def stage_layers(self) -> list[int]:
        """Layers of each pipeline stage."""
        return stage_layer_counts(self.num_layers, self.pp, self.layer_split)

    def chunk_layer_ids(self, pp_rank: int, chunk: int = 0) -> range:
        """Global indices of the layers of model chunk ``chunk`` of rank ``pp_rank``."""
        if self.virtual_stages == 1:
            return stage_layer_ids(self.num_layers, self.pp, pp_rank, self.layer_split)
        return chunk_layer_ids(
            self.num_layers,
            self.pp,
            self.virtual_stages,
            pp_rank,
            chunk,
            embedding=self.embedding,
            loss=self.loss,
            placement=self.placement,
        )

    @property
    def chunk_layers(self) -> list[int]:
        """Layers of every model chunk, virtual stage by virtual stage (the unit of recomputation)."""
        owners = (stage_owner(k, self.pp, self.placement) for k in range(self.pp * self.virtual_stages))
        return [len(self.chunk_layer_ids(r, c)) for r, c in owners]


def pipeline_split(
    num_layers: int,
    pp: int,
    split: tuple[int, ...] | None = None,
    first: int | None = None,
    last: int | None = None,
    *,
    embedding: bool = False,
    loss: bool = False,
    layers_per_chunk: int | None = None,
    v: int | None = None,
    placement: str = "looped",
) -> PipelineSplit:
    """The :class:`PipelineSplit` the options ask for: ``v`` chunks per rank (else ``(num_layers +
    counted) / (pp * layers_per_chunk)``, else 1) and :func:`layer_split`'s layers per stage.

    Raises:
        ConfigError: as :func:`layer_split`.
    """
    if v is None:
        v = virtual_stages(num_layers, pp, layers_per_chunk, embedding + loss)
    stages = layer_split(num_layers, pp, split, first, last, embedding=embedding, loss=loss, v=v, placement=placement)
    return PipelineSplit(num_layers, pp, v, stages, embedding, loss, placement)


def stage_layer_counts(num_layers: int, pp: int, split: tuple[int, ...] | None) -> list[int]:
    """Layers held by each of the pp stages; raises ConfigError if they do not add up exactly.

    Even (``num_layers % pp == 0``) unless ``split`` lists the layers per stage explicitly (pp
    entries, each >= 1, summing to ``num_layers``: no layer is ever dropped silently). More stages
    than layers is refused as such.
    """
    if split is None:
        if pp > num_layers:
            raise ConfigError(
                f"pipeline_model_parallel_size={pp} is more stages than num_layers={num_layers} "
                f"(rule: every stage holds at least one layer, pp <= num_layers)"
            )
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


def first_last_split(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    """Layers per stage from Megatron-LM's ``--decoder-first-pipeline-num-layers`` (``first``) and
    ``--decoder-last-pipeline-num-layers`` (``last``): those stages hold that many layers, the others
    split the rest evenly. Example: 126 layers, pp = 16, first = last = 7 -> ``(7, 8, ..., 8, 7)``,
    Llama 3 405B's split (arXiv:2407.21783, §3.3.2).

    Raises:
        ConfigError: pp < 2, a value < 1, or remaining layers that do not split evenly into at
            least one layer per remaining stage (with pp = 2 and both given, they must sum to num_layers).
    """
    given = {
        name: n
        for name, n in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last))
        if n is not None
    }
    text = " and ".join(f"{name}={n}" for name, n in given.items())
    if pp < 2:
        raise ConfigError(f"{text} needs pipeline_model_parallel_size >= 2, got {pp}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in given.values()):
        raise ConfigError(f"{text}: each must be an integer >= 1 (layers on that stage)")
    rest, stages = num_layers - sum(given.values()), pp - len(given)
    if stages == 0:
        if rest != 0:
            raise ConfigError(
                f"{text} with pp={pp}: the two stages must hold all num_layers={num_layers} layers "
                f"(their sum is {num_layers - rest})"
            )
        return tuple(given.values())  # (first, last): both given
    if rest < stages or rest % stages:
        minus = " - ".join(["num_layers", *("first" if "first" in k else "last" for k in given)])
        raise ConfigError(
            f"{text} leave {num_layers} - {sum(given.values())} = {rest} layers for the other {stages} of pp={pp} "
            f"stages, which must split them evenly with at least one layer each (rule: ({minus}) % "
            f"(pp - {len(given)}) == 0)"
        )
    per = rest // stages
    return (first if first is not None else per,) + (per,) * (pp - 2) + (last if last is not None else per,)


def layer_split(
    num_layers: int,
    pp: int,
    split: tuple[int, ...] | None = None,
    first: int | None = None,
    last: int | None = None,
    *,
    embedding: bool = False,
    loss: bool = False,
    v: int = 1,
    placement: str = "looped",
) -> tuple[int, ...] | None:
    """The explicit layers per stage the options ask for: ``split`` (``--pipeline-layer-split``)
    as given, the first/last stage counts expanded (:func:`first_last_split`), the split with the
    embedding and/or loss counted as layers over ``pp`` ranks of ``v`` chunks
    (:func:`accounted_split`), or None (even).

    Raises:
        ConfigError: more than one way of splitting given (``split``, ``first``/``last``,
            ``embedding``/``loss``), or counts that cannot split ``num_layers``.
    """
    if embedding or loss:
        others = [
            f"{name}={value}"
            for name, value in (
                ("pipeline_layer_split", split and list(split)),
                ("decoder_first_pipeline_num_layers", first),
                ("decoder_last_pipeline_num_layers", last),
            )
            if value
        ]
        if others:
            raise ConfigError(
                f"account_for_embedding/loss_in_pipeline_split already decide every stage's layers; "
                f"they cannot be combined with {', '.join(others)} (give one way of splitting)"
            )
        return accounted_split(num_layers, pp, v, embedding=embedding, loss=loss, placement=placement)
    if first is None and last is None:
        return split
    if split is not None:
        raise ConfigError(
            f"pipeline_layer_split={list(split)} lists every stage's layers; it cannot be combined with "
            + " or ".join(
                f"decoder_{k}_pipeline_num_layers={n}" for k, n in (("first", first), ("last", last)) if n is not None
            )
            + " (give one or the other)"
        )
    return first_last_split(num_layers, pp, first, last)


def first_last_of(split: tuple[int, ...]) -> tuple[int | None, int | None] | None:
    """Megatron's (first, last) stage counts that give ``split`` (None for a stage equal to the
    middle ones, both None for an even split), or None when ``split`` has another shape (its middle
    stages differ: only ``--pipeline-layer-split`` expresses it). With two stages: (first, None)."""
    if len(split) == 2:
        return (None, None) if split[0] == split[1] else (split[0], None)
    middle = set(split[1:-1])
    if len(middle) != 1:
        return None
    (per,) = middle
    return (split[0] if split[0] != per else None, split[-1] if split[-1] != per else None)


def accounted_split(
    num_layers: int, pp: int, v: int = 1, *, embedding: bool, loss: bool, placement: str = "looped"
) -> tuple[int, ...]:
    """Layers per pipeline rank when the input embedding (``embedding``) and the output layer + loss
    (``loss``) each count as one layer of the split (Megatron-LM's
    ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``): the
    ``U = num_layers + embedding + loss`` units split evenly over the ``pp v`` virtual stages
    (:func:`chunk_layer_ids`). Example: 126 layers, both, pp = 16, v = 8: 128 units, one per chunk,
    so rank 0 holds 7 layers (its first chunk only the embedding), ranks 1-14 hold 8, rank 15 holds 7
    (its last chunk only the output layer and loss): Llama 3 405B's layout (arXiv:2407.21783, §3.3.2).

    Raises:
        ConfigError: ``U % (pp v) != 0``, or a rank left without any layer.
    """
    units, what = (
        num_layers + embedding + loss,
        " and ".join(name for name, on in (("embedding", embedding), ("loss", loss)) if on),
    )
    if units % (pp * v):
        raise ConfigError(
            f"num_layers={num_layers} + the {what} counted as layers = {units} is not divisible by "
            f"pp*v = {pp}*{v} = {pp * v} (rule: (num_layers + embedding + loss) % (pp * v) == 0 with "
            f"account_for_{'_'.join(what.split(' and '))}_in_pipeline_split)"
        )
    counts = tuple(
        sum(
            len(chunk_layer_ids(num_layers, pp, v, r, c, embedding=embedding, loss=loss, placement=placement))
            for c in range(v)
        )
        for r in range(pp)
    )
    if min(counts) < 1:
        raise ConfigError(
            f"num_layers={num_layers} + the {what} counted as layers = {units} over pp*v = {pp}*{v} "
            f"leaves a pipeline rank without layers (layers per rank: {list(counts)})"
        )
    return counts


def virtual_stages(num_layers: int, pp: int, layers_per_chunk: int | None, extra: int = 0) -> int:
    """v, the model chunks per pipeline rank: ``(num_layers + extra) / (pp * layers_per_chunk)`` (1
    without); ``extra``: the embedding and loss when they count as layers of the split."""
    return (num_layers + extra) // (pp * layers_per_chunk) if layers_per_chunk else 1


def stage_layer_ids(num_layers: int, pp_size: int, pp_rank: int, split: tuple[int, ...] | None = None) -> range:
    """Global indices of the layers on stage ``pp_rank``: consecutive, every layer on exactly one stage.

    Even split (``num_layers % pp_size == 0``) unless ``split`` lists the layers per stage explicitly;
    raises ``ConfigError`` otherwise.
    """
    counts = stage_layer_counts(num_layers, pp_size, split)
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


def chunk_layer_ids(
    num_layers: int,
    pp_size: int,
    virtual_stages: int,
    pp_rank: int,
    chunk: int,
    *,
    embedding: bool = False,
    loss: bool = False,
    placement: str = "looped",
) -> range:
    """Layers of model chunk ``chunk`` on rank ``pp_rank``: virtual stage k (looped: chunk * pp +
    pp_rank; :mod:`ptdp.layout.pipeline.placement`) holds layers [k L / (pp v), (k + 1) L / (pp v))
    (Narayanan et al. SC21, §2.2: rank r holds chunks r, r + p, r + 2p, ...). With ``embedding`` / ``loss`` the embedding and the output
    layer + loss are one unit each of ``U = L + embedding + loss``, the first and the last: virtual
    stage k holds units [k U / (pp v), (k + 1) U / (pp v)), i.e. the layers among them (possibly
    none). Raises ValueError unless U % (pp v) == 0."""
    units = num_layers + embedding + loss
    per = units // (pp_size * virtual_stages)
    if per * pp_size * virtual_stages != units:
        raise ValueError(
            f"num_layers={num_layers} (+{embedding + loss} counted as layers) is not divisible by "
            f"pp*v = {pp_size}*{virtual_stages}"
        )
    stage = virtual_stage(pp_rank, chunk, pp_size, placement)
    start, end = (min(max(k * per - embedding, 0), num_layers) for k in (stage, stage + 1))
    return range(start, end)
