"""Step time and host synchronisations per steady-state training step, for this checkout and an
earlier ptdp source tree, side by side on the same machine in one run.

Each tree runs the same job: ``ptdp train``'s default model (4 layers, hidden 128, 4 heads, sequence
128, vocabulary 4096, float32) and batch (micro 4, global 32) at a layout (default tp = pp = dp = 2,
8 gloo workers with one thread each, as ``ptdp train`` starts), random tokens. After the warm-up
steps every rank times each step (the slowest rank's time counts) and counts the calls that would
make the host wait for a GPU (``tests/helpers/host_sync.py``'s shim: reading a value with ``item``,
``tolist``, ``float`` ..., or a blocking copy between devices; the label check takes its GPU path,
queued on the device, in both trees), for every rank, without reading any
result of the step in between (a trainer reads the loss once per ``--log-interval``; the count of
the step's own code is what is measured). The trees run alternately, ``--repeats`` times each, and
the report gives the median step time of all their steps, the syncs per step (max over ranks) and
the ratio after / before.

    git archive <commit> src | tar -x -C /tmp/ptdp-before
    python benchmarks/bench_step_syncs.py --before /tmp/ptdp-before/src
    python benchmarks/bench_step_syncs.py --before /tmp/ptdp-before/src --layout 1,1,1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worker(tp: int, pp: int, dp: int, steps: int, warmup: int) -> dict:
    """Inside each gloo worker: build the stage, run warm-up and timed steps, count syncs."""
    import datetime

    import pipeline_common as pc
    import torch

    from helpers.host_sync import count_host_syncs, label_check_on_device
    from ptdp.config.model import ModelConfig
    from ptdp.config.parallel import ParallelConfig
    from ptdp.config.resolve import resolve
    from ptdp.config.schema import Config, TrainConfig
    from ptdp.engine.groups import ParallelGroups
    from ptdp.engine.stage import build_stage
    from ptdp.engine.step import train_step
    from ptdp.layout.grid import ParallelLayout
    from ptdp.run.distributed import init_distributed

    init_distributed(pc.TIMEOUT_MINUTES, threads_per_worker=1)
    groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), datetime.timedelta(minutes=pc.TIMEOUT_MINUTES))
    config = resolve(
        Config(
            model=ModelConfig(),
            parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
            train=TrainConfig(train_iters=10_000),
        ),
        tp * pp * dp,
    )
    stage = build_stage(config, groups)
    b, gbs, s, vocab = config.train.micro_batch_size, config.train.global_batch_size, config.model.seq_length, 4096
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (gbs, s + 1), generator=gen)
    per_rank = gbs // dp
    mine = data[groups.dp.rank * per_rank : (groups.dp.rank + 1) * per_rank]
    mbs = [(mine[i : i + b, :-1], mine[i : i + b, 1:]) for i in range(0, per_rank, b)]
    times, syncs = [], []
    try:
        with label_check_on_device():  # count what a GPU would: the label check queued on the device
            for i in range(warmup + steps):
                torch.distributed.barrier()
                with count_host_syncs() as counted:
                    start = time.perf_counter()
                    train_step(stage, mbs, i)
                    elapsed = time.perf_counter() - start
                if i >= warmup:
                    times.append(max(pc.gather_floats(elapsed, groups.world)))
                    syncs.append(max(pc.gather_floats(float(counted.count), groups.world)))
    finally:
        torch.distributed.destroy_process_group()
    return {"step_s": times, "syncs": syncs}


def run_tree(src: Path, layout: tuple[int, int, int], steps: int, warmup: int) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), str(HERE), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            ",".join(map(str, layout)),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{src}: failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="an earlier ptdp's src/ folder")
    ap.add_argument("--layout", default="2,2,2", help="tp,pp,dp (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import pipeline_common as pc

        tp, pp, dp = map(int, args.worker.split(","))
        print(json.dumps(pc.launch(worker, tp * pp * dp, tp, pp, dp, args.steps, args.warmup)))
        return
    layout = tuple(map(int, args.layout.split(",")))
    trees = {"after": ROOT / "src"} | ({"before": args.before} if args.before else {})
    runs: dict[str, dict] = {name: {"step_s": [], "syncs": []} for name in trees}
    started = time.time()
    for _ in range(args.repeats):
        for name, src in trees.items():
            out = run_tree(src, layout, args.steps, args.warmup)
            for k in runs[name]:
                runs[name][k] += out[k]
    report = {
        "layout": {"tp": layout[0], "pp": layout[1], "dp": layout[2]},
        "steps": args.steps,
        "repeats": args.repeats,
        "load_1min_at_end": os.getloadavg()[0],
        "wall_s": time.time() - started,
    }
    for name, r in runs.items():
        report[name] = {
            "median_step_s": statistics.median(r["step_s"]),
            "syncs_per_step": max(r["syncs"]),
            "min_syncs_per_step": min(r["syncs"]),
        }
    if "before" in report:
        report["step_time_ratio_after_over_before"] = (
            report["after"]["median_step_s"] / report["before"]["median_step_s"]
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
