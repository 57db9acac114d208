"""How a stage's gradients are grouped for their data-parallel reduction: the buckets of one model
chunk's parameters, and when a sharded-gradient strategy reduces a chunk's gradient once per round.
One plan for the engine's gradient buffer and the planner's count of its transients."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def chunk_buckets(
    sizes: Sequence[int],
    bucket_size: int,
    *,
    units: Sequence[int | None] | None = None,
    deferred: Collection[int] = (),
) -> list[tuple[int, ...]]:
    """The parameter indices of each bucket of one chunk whose parameters have ``sizes`` elements
    (in the chunk's order): cut back to front (the order backward produces the gradients), at
    most ``bucket_size`` elements each (a larger parameter alone), never across two ``units``
    (ZeRO-3: parameter index -> unit), each ``deferred`` parameter alone. Padding is the caller's."""
    out: list[tuple[int, ...]] = []
    current: list[int] = []
    total = 0
    for i in reversed(range(len(sizes))):
        if i in deferred:
            out.append((i,))
            continue
        other_unit = units is not None and bool(current) and units[current[-1]] != units[i]
        if current and (other_unit or total + sizes[i] > bucket_size):
            out.append(tuple(current))
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    if current:
        out.append(tuple(current))
    return out


def chunk_by_chunk(strategy: str, shard: int, virtual_stages: int, num_microbatches: int, pp: int) -> bool:
    """Whether a sharded-gradient strategy reduces each model chunk's gradient once per round of
    the interleaved schedule: ``optim_grads`` or ``optim_grads_params`` over ``shard > 1`` ranks
    with ``virtual_stages > 1`` and ``num_microbatches`` a multiple of ``pp`` (``m / pp`` rounds).
    In a round every rank runs the ``pp`` backwards of its last chunk, then of the chunk before,
    and so on, so a chunk's gradient of the round is whole after its last backward there."""
    return (
        shard > 1
        and strategy in ("optim_grads", "optim_grads_params")
        and virtual_stages > 1
        and num_microbatches % pp == 0
    )


def chunk_rounds(num_microbatches: int, pp: int) -> int:
    """Rounds of the interleaved schedule (``num_microbatches / pp``): the reductions of each chunk's
    gradient per step when :func:`chunk_by_chunk` holds."""
    return max(1, num_microbatches // pp)
