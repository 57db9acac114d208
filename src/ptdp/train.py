"""Worker entry points of a training job.

- :func:`worker_entry`: what each process started by ``ptdp train`` (PyTorch's elastic launcher)
  runs; data and run directory were prepared by the launching process.
- :func:`main`: ``torchrun ... -m ptdp.train [flags]`` on a cluster. Every process validates the
  flags before any process group exists; local rank 0 of each node prepares the data (cached)
  while the others wait; global rank 0 creates the run directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch.distributed as dist

from ptdp import comm
from ptdp.args import add_train_arguments, config_from_args
from ptdp.config import Config, ConfigError, resolve
from ptdp.data import DataError, PreparedData
from ptdp.distributed import env_world, init_distributed
from ptdp.groups import ParallelGroups
from ptdp.layout import ParallelLayout
from ptdp.rundir import make_run_dir, prepare, write_config
from ptdp.trainer import train


def _run(config: Config, run_dir: Path, data: PreparedData, device, progress: bool) -> dict:
    p = config.parallel
    layout = ParallelLayout(tp=p.tp, pp=p.pp, dp=p.dp)
    groups = ParallelGroups.build(layout, datetime.timedelta(minutes=p.distributed_timeout_minutes))
    return train(config, groups, data, run_dir, device, progress=progress)


def worker_entry(config_json: str, run_dir: str, data_dir: str, progress: bool) -> dict:
    """Run one worker of a job launched by ``ptdp train``; returns the run summary."""
    config = Config.from_dict(json.loads(config_json))
    device = init_distributed(config.parallel.distributed_timeout_minutes)
    try:
        return _run(config, Path(run_dir), PreparedData.load(data_dir), device, progress)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``python -m ptdp.train`` under torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    parser = argparse.ArgumentParser(prog="python -m ptdp.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(parser, local_launch=False)
    args = parser.parse_args(argv)
    rank, local_rank, world = env_world()
    try:
        config = resolve(config_from_args(args), world)
    except ConfigError as e:
        print(f"ptdp.train: error: {e}", file=sys.stderr)
        return 2
    device = init_distributed(config.parallel.distributed_timeout_minutes)
    try:
        data = _prepare_once(config, local_rank)
        run_dir = None
        if rank == 0:
            run_dir = make_run_dir(config, overwrite=args.overwrite)
            config = dataclasses.replace(config, output_dir=str(run_dir))
            write_config(run_dir, config, data)
        run_dir = Path(comm.broadcast_object(run_dir, src=0))
        _run(config, run_dir, data, device, progress=not args.no_progress)
    except (ConfigError, DataError) as e:
        print(f"ptdp.train: rank {rank}: error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def _prepare_once(config: Config, local_rank: int) -> PreparedData:
    """Local rank 0 builds the cache; the others wait, then find it ready."""
    if local_rank == 0:
        data = prepare(config)
    comm.world_barrier()
    if local_rank != 0:
        data = prepare(config, log=lambda _msg: None)
    return data


if __name__ == "__main__":
    sys.exit(main())
