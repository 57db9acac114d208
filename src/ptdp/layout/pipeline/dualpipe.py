"""DualPipeV as each rank's compute order (pure, no torch).

DualPipe (DeepSeek-V3 technical report, arXiv:2412.19437, §3.2.1) runs two pipelines in opposite
directions over the same ranks and overlaps the forward of one microbatch with the backward of
another; DualPipeV is its "cut-in-half" form (Sea AI Lab; the DualPipe repository's DualPipeV
figure): one pipeline on the V placement, two chunks per rank (chunk 0 is stage r, chunk 1 stage
2p - 1 - r). Rank r, with m >= 2p microbatches, runs eight phases:

1. 2 (p - r - 1) chunk-0 forwards;
2. r + 1 times a chunk-0 then a chunk-1 forward;
3. p - r - 1 times a chunk-1 B, a W, a chunk-1 forward;
4. m - 2p + r + 1 times the overlapped pairs (chunk-0 F, chunk-1 backward) and (chunk-1 F, chunk-0 backward);
5. p - r - 1 times a chunk-1 backward, then the pair (chunk-1 F, chunk-0 backward);
6. r + 1 times a chunk-1 then a chunk-0 backward, whole in the first half and split into B from
   the middle pair on (from its chunk-0 backward when r is even, its chunk-1 one when r is odd);
7. p - r - 1 times a W, then a chunk-0 B;
8. r + 1 Ws.

Backwards in phases 4 to 6 are whole unless split: a whole backward is its B immediately followed
by its W, so its input gradient is sent before the weight gradients are computed (a program whose
point-to-point groups each wait for both ends would otherwise hold a neighbour's send back until
the whole backward ends: 59 chunk units instead of 51 at p = 4, m = 8). Each other W runs the
oldest queued B's weight gradients (first in, first out, over both chunks). An overlapped pair is two consecutive actions,
the forward then the backward: the runtime may run them together, the schedule's data and its
transfers are those of the two in order. At most 2p + 1 chunks of activations are held, bubble
(p - 1)(F&B + B - 3W) in chunk times (the DualPipe repository's table, PP = 2p stages).
"""

from __future__ import annotations

Order = list[tuple[str, int, int]]


def dualpipev_order(p: int, m: int, r: int) -> Order:
    """Rank r's order (see the module docstring); needs m >= 2p."""
    F, B, W, BW = "forward", "backward_input", "backward_weight", "backward"
    count = {("forward", 0): 0, ("forward", 1): 0, ("backward", 0): 0, ("backward", 1): 0}
    queued: list[tuple[int, int]] = []  # (microbatch, chunk) of each B whose W has not run
    order: Order = []

    def run(kind: str, chunk: int) -> None:
        if kind == W:
            order.append((W, *queued.pop(0)))
            return
        key = ("forward" if kind == F else "backward", chunk)
        if kind == BW:  # a whole backward as its B, then its W at once: the input gradient leaves first
            order.extend([(B, count[key], chunk), (W, count[key], chunk)])
        else:
            order.append((kind, count[key], chunk))
        if kind == B:
            queued.append((count[key], chunk))
        count[key] += 1

    def runs(*steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            run(kind, chunk)

    runs(*[(F, 0)] * (2 * (p - r - 1)))
    runs(*[(F, 0), (F, 1)] * (r + 1))
    runs(*[(B, 1), (W, 0), (F, 1)] * (p - r - 1))
    runs(*[(F, 0), (BW, 1), (F, 1), (BW, 0)] * (m - 2 * p + r + 1))
    runs(*[(BW, 1), (F, 1), (BW, 0)] * (p - r - 1))
    half = (r + 1) // 2
    for i in range(r + 1):
        split1 = i > half or (i == half and r % 2 == 1)
        runs((B if split1 else BW, 1), (B if i >= half else BW, 0))
    runs(*[(W, 0), (B, 0)] * (p - r - 1))
    runs(*[(W, 0)] * (r + 1))
    return order
