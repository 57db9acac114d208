"""Worker entry points of a training job.

- :func:`worker_entry`: what each process started by ``ptdp train`` (PyTorch's elastic launcher)
  runs; data and run directory were prepared by the launching process.
- :func:`main`: ``torchrun ... -m ptdp.train [flags]`` on a cluster. Every process validates the
  flags before any process group exists; local rank 0 of each node prepares the data (cached)
  while the others wait; global rank 0 creates the run directory and prints the summary.

Both resume by themselves when the launcher restarts the job (``--max-restarts``, see
:mod:`ptdp.run.restart`); a restarted job appends to the run directory of its first attempt.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ptdp.config.files import apply_config_file
from ptdp.config.flags import Parser, config_from_args, parse_args
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config
from ptdp.config.train_flags import HelpFormatter, add_train_arguments
from ptdp.data.prepared_data import PreparedData
from ptdp.engine import comm
from ptdp.engine.activity import CollectiveError
from ptdp.engine.groups import ParallelGroups, host_group
from ptdp.errors import ConfigError, DataError
from ptdp.layout.grid import ParallelLayout
from ptdp.run import rank_records
from ptdp.run.distributed import env_world, init_distributed
from ptdp.run.metrics import format_summary
from ptdp.run.preflight import Roles, Share, check_request, prepare_run
from ptdp.run.restart import check_torchrun_restarts, restart_count, resume_config
from ptdp.run.trainer import TrainingError, train

#: Waiting for another rank to tokenize a large corpus may take much longer than a collective.
DATA_PREPARATION_TIMEOUT = datetime.timedelta(hours=4)


def _run(config: Config, run_dir: Path, data: PreparedData, device, progress: bool, restart: int) -> dict:
    """Build the process groups and train."""
    p = config.parallel
    layout = ParallelLayout(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    groups = ParallelGroups.build(layout, datetime.timedelta(minutes=p.distributed_timeout_minutes), ep=p.ep, etp=p.etp)
    return train(config, groups, data, run_dir, device, progress=progress, restart=restart)


def worker_entry(config_json: str, run_dir: str, data_dir: str, progress: bool) -> dict:
    """Run one worker of a job launched by ``ptdp train``; returns the run summary, or
    ``{"error": message}`` when training had to stop (the same on every rank). A
    :class:`~ptdp.engine.activity.CollectiveError` (a peer stopped responding or went away) is raised, so
    that the launcher stops the other workers and reports it."""
    restart = restart_count()
    rank, _, world = env_world()
    with rank_records.recording(rank, restart):  # who failed first, and where (ptdp.run.postmortem)
        # the launcher's settings, resolved again for this world (the derived values travel as settings)
        config = resolve(resume_config(Config.from_dict(json.loads(config_json)), restart), world)
        device = init_distributed(config.parallel.distributed_timeout_minutes, bind_cpus=config.parallel.bind_cpus)
        try:
            with nccl_watch(device, config.parallel.distributed_timeout_minutes):
                return _run(config, Path(run_dir), PreparedData.load(data_dir), device, progress, restart)
        except TrainingError as e:
            return {"error": str(e)}
        except KeyboardInterrupt:
            raise SystemExit(130) from None  # the launcher reports the interruption
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``python -m ptdp.train`` under torchrun (or alone: then a single process)."""
    parser = Parser(prog="python -m ptdp.train", description=__doc__, formatter_class=HelpFormatter)
    add_train_arguments(parser, local_launch=False)
    set_single_process_environment()
    rank, local_rank, world = env_world()
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    try:
        apply_config_file(parser, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        say(f"ptdp.train: error: {e}")
        return 2
    args = parse_args(parser, argv)
    try:
        config = resolve(config_from_args(args), world, cuda=torch.cuda.is_available())
        if args.print_config:
            if rank == 0:
                print(config.to_json(), flush=True)
            return 0
        check_torchrun_restarts(args.output_dir)
        check_request(config, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ConfigError as e:
        say(f"ptdp.train: error: {e}")
        return 2
    try:
        device = init_distributed(config.parallel.distributed_timeout_minutes, bind_cpus=config.parallel.bind_cpus)
    except ConfigError as e:  # --bind-cpus cannot be done on this rank's node
        print(f"ptdp.train: error on rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        summary = train_in_process_group(config, device, progress=not args.no_progress)
        say(format_summary(summary, Path(summary["run_dir"])))
    except (ConfigError, DataError, TrainingError) as e:
        say(f"ptdp.train: error: {e}")
        return 1 if isinstance(e, TrainingError) else 2
    except CollectiveError as e:  # a peer stopped responding or went away: said by the rank that saw it
        print(f"ptdp.train: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


def train_in_process_group(config: Config, device, *, progress: bool) -> dict:
    """Train ``config`` (resolved and checked) in this worker, torch.distributed initialised: the
    host group, the job's restart count, the run directory and data (prepared by local rank 0 of
    each node while the others wait), the process groups, the training loop. Returns the run's
    summary with ``run_dir`` added. Raises ConfigError / DataError (bad request or data),
    TrainingError (training had to stop), CollectiveError (a peer went away)."""
    rank, local_rank, _ = env_world()
    host = host_group(DATA_PREPARATION_TIMEOUT)
    # a torchrun whose node saw no failure restarts its workers without counting: the job's count is the max
    restart = max(comm.all_gather_object(restart_count(), host))
    config = resume_config(config, restart)
    roles = Roles(checks_run_dir=rank == 0, prepares_data=local_rank == 0, writes_run_dir=rank == 0)
    config, run_dir, data = prepare_run(config, roles=roles, restart=restart, share=_host_share(host))
    with nccl_watch(device, config.parallel.distributed_timeout_minutes):
        summary = _run(config, run_dir, data, device, progress, restart)
    return {**summary, "run_dir": str(run_dir)}


def nccl_watch(device, timeout_minutes: float):
    """On a CUDA device (NCCL), a :class:`~ptdp.run.heartbeat.Heartbeat` that names this rank's
    phase and iteration before NCCL's watchdog aborts it, and every thread's stack on the abort;
    nothing on CPU (gloo raises :class:`CollectiveError` itself)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from ptdp.run.heartbeat import Heartbeat, enable_fatal_signal_stacks

    enable_fatal_signal_stacks()
    return Heartbeat(env_world()[0], 60.0 * timeout_minutes)


def _host_share(host) -> Share:
    """Agreement over the gloo host group: the first rank's error raised everywhere, rank 0's run
    directory given to all."""

    def raise_first(error):
        for e in comm.all_gather_object(error, host):
            if e is not None:
                raise e

    return Share(raise_first, lambda run_dir: Path(comm.broadcast_object(str(run_dir), host, src=0)))


def set_single_process_environment() -> None:
    """Without a launcher, run as a world of one process on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


if __name__ == "__main__":
    sys.exit(main())
