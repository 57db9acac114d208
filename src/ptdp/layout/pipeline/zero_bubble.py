"""The handcrafted zero-bubble schedules as each rank's compute order (pure, no torch): the backward
split into B (``backward_input``, the input gradient, sent on at once) and W (``backward_weight``,
the weight gradients, run later to fill what would be bubbles).

Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241 (§2, Figure 3; §6 and its figure
for ZB-V), with F = B = W = t and free transfers:

- ``zb-h1``: 1F1B whose Ws lag: rank r runs p - r forwards first, then per microbatch its B, the
  oldest W once r Bs wait for theirs, the next forward; every rank holds at most p microbatches
  (the 1F1B peak); bubble (p - 1) t where 1F1B's is 3 (p - 1) t.
- ``zb-h2``: 2 (p - r) - 1 forwards first and Ws lagging 2 r + 1 Bs: a parallelogram, bubble 0
  once m >= 2p; at most 2p - 1 microbatches held.
- ``zb-v``: two chunks per rank on the V placement (arXiv:2405.15362); rank r runs 2 (p - r) - 1
  forwards of chunk 0, r pairs of chunk-1 and chunk-0 forwards, p - r chunk-1 F, B, W, then F, B, W
  of chunk 0 and of chunk 1 in turn, and drains its Bs and Ws; at most 2p chunks of activations
  held (p microbatches, the 1F1B peak), bubble 0 once m >= 2p. With m < 2p - 1 it is the
  schedule of 2p - 1 microbatches without the missing ones.

Each order is a list of ``(kind, microbatch, chunk)``; :func:`ptdp.layout.pipeline.schedule.build_schedule`
adds the transfers.
"""

from __future__ import annotations

Order = list[tuple[str, int, int]]


def lagging_w_order(m: int, warmup: int, lag: int) -> Order:
    """One chunk: ``warmup`` forwards (at most m), then per microbatch its B, the oldest Ws until at
    most ``lag`` Bs wait for theirs, the next forward; then the Ws left (ZB-H1, ZB-H2)."""
    order: Order = [("forward", i, 0) for i in range(min(warmup, m))]
    forwards, weights = len(order), 0
    for i in range(m):
        order.append(("backward_input", i, 0))
        while i + 1 - weights > lag:
            order.append(("backward_weight", weights, 0))
            weights += 1
        if forwards < m:
            order.append(("forward", forwards, 0))
            forwards += 1
    return order + [("backward_weight", i, 0) for i in range(weights, m)]


def zb_h1_order(p: int, m: int, r: int) -> Order:
    return lagging_w_order(m, p - r, r)


def zb_h2_order(p: int, m: int, r: int) -> Order:
    return lagging_w_order(m, 2 * (p - r) - 1, 2 * r + 1)


def zb_v_order(p: int, m: int, r: int) -> Order:
    """Rank r's order on the V placement (chunk 0 is stage r, chunk 1 stage 2p - 1 - r)."""
    n = max(m, 2 * p - 1)
    done = {(kind, c): 0 for kind in ("forward", "backward_input", "backward_weight") for c in (0, 1)}
    order: Order = []

    def run(*steps: tuple[str, int]) -> None:
        for kind, c in steps:
            order.append((kind, done[(kind, c)], c))
            done[(kind, c)] += 1

    F, B, W = "forward", "backward_input", "backward_weight"
    run(*[(F, 0)] * (2 * (p - r) - 1))
    run(*[(F, 1), (F, 0)] * r)
    run(*[(F, 1), (B, 1), (W, 1)] * (p - r))
    while done[(F, 1)] < n:
        run(*([(F, 0)] if done[(F, 0)] < n else []), (B, 0), (W, 0), (F, 1), (B, 1), (W, 1))
    run(*[(B, 0), (B, 1)] * r)
    run(*[(B, 0), (W, 0)] * (p - r))
    run(*[(W, 1)] * (n - done[(W, 1)]), *[(W, 0)] * (n - done[(W, 0)]))
    return [step for step in order if step[1] < m]
