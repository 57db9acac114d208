"""Checkpoint save and load: ptdp at (tp, pp, dp) = (2, 2, 2) on 8 gloo workers against a
single-process ``torch.save`` / ``torch.load`` of the same model and optimizer state.

Both sides hold the default ``ptdp train`` model (4 layers, h=128, 4 heads, s=128, V=4096,
float32) after one AdamW step (so Adam's moments exist). ptdp: ``save_checkpoint`` (DCP, one file
per rank, plus metadata and JSON) then ``load_checkpoint`` into a freshly built stage; time = the
slowest rank's, between barriers. Reference: one process at tp = pp = dp = 1 saving
``{"model": state_dict(), "optimizer": optimizer.state_dict()}`` with ``torch.save`` and loading it
with ``torch.load(weights_only=True)`` + ``load_state_dict``. Bytes: everything written. Median of
``--repeats`` runs each; the checkpoint folder is on the local disk (``--dir``, default a temp dir).

    python benchmarks/bench_checkpoint.py [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pipeline_common as pc
import torch
import torch.distributed as dist

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.layout.grid import ParallelLayout
from ptdp.run.checkpoint.io import load_checkpoint, save_checkpoint
from ptdp.run.distributed import init_distributed

LAYOUT = (2, 2, 2)


def make_config(tp: int, pp: int, dp: int) -> Config:
    model = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=4096)
    train = TrainConfig(micro_batch_size=4, global_batch_size=32, train_iters=10, lr_warmup_iters=1)
    return resolve(Config(model=model, parallel=ParallelConfig(tp, pp, dp), train=train), tp * pp * dp)


def one_step(stage, cfg: Config, dp_rank: int, dp_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 4096, (cfg.train.global_batch_size, cfg.model.seq_length + 1), generator=gen)
    per = data.shape[0] // dp_size
    mine = data[dp_rank * per : (dp_rank + 1) * per]
    b = cfg.train.micro_batch_size
    train_step(stage, [(mine[i : i + b, :-1], mine[i : i + b, 1:]) for i in range(0, per, b)], 0)


def _timed(fn, world) -> float:
    return pc.timed_step(fn, world)


def worker(root: str, repeats: int) -> dict:
    init_distributed(pc.TIMEOUT_MINUTES, threads_per_worker=1)
    import datetime

    groups = ParallelGroups.build(ParallelLayout(*LAYOUT), datetime.timedelta(minutes=pc.TIMEOUT_MINUTES))
    cfg = make_config(*LAYOUT)
    stage = build_stage(cfg, groups)
    one_step(stage, cfg, groups.dp.rank, groups.dp.size)
    fresh = build_stage(cfg, groups)
    saves, loads = [], []
    for i in range(repeats):
        target = f"{root}/r{i}"
        saves.append(_timed(lambda: save_checkpoint(stage, target, 1, consumed_samples=32), groups.world))
        loads.append(_timed(lambda: load_checkpoint(fresh, target), groups.world))
    same = all(torch.equal(a, b) for a, b in zip(stage.model.parameters(), fresh.model.parameters()))
    ok = torch.tensor(float(same))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    folder = Path(root) / "r0" / "iter_0000001"
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return {
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
        "bytes": size,
        "loaded_equal": bool(ok.item()),
    }


def reference(root: Path, repeats: int) -> dict:
    torch.set_num_threads(1)
    cfg = make_config(1, 1, 1)
    stage = build_stage(cfg, ParallelGroups.single_process())
    one_step(stage, cfg, 0, 1)
    fresh = build_stage(cfg, ParallelGroups.single_process())
    saves, loads, path = [], [], root / "ref.pt"
    for _ in range(repeats):
        start = time.perf_counter()
        torch.save({"model": stage.model.state_dict(), "optimizer": stage.optimizer.state_dict()}, path)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        state = torch.load(path, weights_only=True)
        fresh.model.load_state_dict(state["model"])
        fresh.optimizer.load_state_dict(state["optimizer"])
        loads.append(time.perf_counter() - start)
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "bytes": path.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ptdp-bench-ckpt-"))
    try:
        ptdp = pc.launch(worker, 8, str(root / "ptdp"), args.repeats)
        ref = reference(root, args.repeats)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    report = {
        "benchmark": "checkpoint",
        "machine": pc.machine(),
        "layout": LAYOUT,
        "ptdp": ptdp,
        "torch_save": ref,
        "ratio_save": ptdp["save_s"] / ref["save_s"],
        "ratio_load": ptdp["load_s"] / ref["load_s"],
        "ratio_bytes": ptdp["bytes"] / ref["bytes"],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        pc.table(
            ["", "save s", "load s", "bytes"],
            [
                ["ptdp (2,2,2), 8 ranks, DCP", f"{ptdp['save_s']:.3f}", f"{ptdp['load_s']:.3f}", f"{ptdp['bytes']:,}"],
                ["torch.save, 1 process", f"{ref['save_s']:.3f}", f"{ref['load_s']:.3f}", f"{ref['bytes']:,}"],
                ["ratio", f"{report['ratio_save']:.2f}", f"{report['ratio_load']:.2f}", f"{report['ratio_bytes']:.3f}"],
            ],
        )
    )
    print(f"loaded parameters bitwise equal to the saved ones: {ptdp['loaded_equal']}")


if __name__ == "__main__":
    main()
