"""What a receive costs on gloo when it is posted after its message was sent, against one posted
in advance: the evidence behind a note on ptdp's pipeline runtime, which posts each receive in the
group of its program where the message is produced, and then waits for the group
(``ptdp.engine.pipeline.runtime._exchange``).

Two gloo workers. In each round rank 0 sends one tensor at once. "late": rank 1 sleeps 20 ms (the
message is long sent) and then posts ``irecv`` and waits. "early": rank 1 posts ``irecv`` first,
sleeps 30 ms (the message arrives meanwhile) and then waits. The time of the wait is measured on
rank 1; the report gives medians for a tiny tensor and for a [4, 128, 256] float32 activation.

    python benchmarks/bench_gloo_recv_posting.py
"""

from __future__ import annotations

import argparse
import json
import time

import pipeline_common as pc
import torch
import torch.distributed as dist

SHAPES = {"tiny [1, 1, 8]": (1, 1, 8), "activation [4, 128, 256]": (4, 128, 256)}


def worker(rounds: int) -> dict:
    groups = pc.init_pipeline(2)
    rank, out = dist.get_rank(), {}
    try:
        for name, shape in SHAPES.items():
            x = torch.zeros(shape)
            waits = {"late": [], "early": []}
            for _ in range(rounds):
                for mode in ("late", "early"):
                    dist.barrier()
                    if rank == 0:
                        dist.isend(x, 1).wait()
                        continue
                    if mode == "late":
                        time.sleep(0.02)
                        start = time.perf_counter()
                        dist.irecv(x, 0).wait()
                    else:
                        work = dist.irecv(x, 0)
                        time.sleep(0.03)
                        start = time.perf_counter()
                        work.wait()
                    waits[mode].append(time.perf_counter() - start)
            if rank == 1:
                out[name] = {mode: pc.median(w[2:]) * 1e6 for mode, w in waits.items()}
        result = pc.all_gather_object(out, groups.world)[1]
    finally:
        dist.destroy_process_group()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    out = pc.launch(worker, 2, args.rounds)
    print(
        json.dumps(
            {"benchmark": "gloo_recv_posting", "machine": pc.machine(), "rounds": args.rounds, "median_wait_us": out},
            indent=2,
        )
    )
    rows = [[name, f"{v['late']:.0f}", f"{v['early']:.0f}"] for name, v in out.items()]
    print()
    print(pc.table(["tensor", "wait, recv posted after the send (us)", "wait, recv posted before (us)"], rows))


if __name__ == "__main__":
    main()
