"""Start ``ptdp train``'s local workers with PyTorch's elastic launcher (the API behind torchrun)."""

from __future__ import annotations

import os
import tempfile
import uuid

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ptdp.config import Config


def launch_local(config: Config, nproc: int, run_dir: str, data_dir: str, *, progress: bool) -> dict:
    """Run ``nproc`` workers of ``ptdp.train.worker_entry`` on this machine; return rank 0's result.
    See :func:`launch_workers`. On a CUDA machine the workers' GPUs follow the placement of this
    machine's topology (:func:`ptdp.topology.gpu_order.gpu_order`), printed first."""
    import torch

    from ptdp.train import worker_entry

    if torch.cuda.is_available():
        from ptdp.topology.gpu_order import gpu_order

        p = config.parallel
        env, lines = gpu_order(p.tp, p.pp, p.dp, nproc)
        for line in lines:
            print(line, flush=True)
        os.environ.update(env)
    return launch_workers(worker_entry, nproc, config.to_json(), run_dir, data_dir, progress)


def launch_workers(entrypoint, nproc: int, *args) -> dict:
    """Run ``nproc`` workers of ``entrypoint(*args)`` on this machine; return rank 0's result.

    Rendezvous binds to loopback on a free port; there are no restarts. Each worker gets one CPU
    thread per core share (``OMP_NUM_THREADS``); workers print to this process's terminal and the
    launcher's per-attempt files go to a temporary folder removed afterwards. Raises the launcher's
    ``ChildFailedError`` if a worker fails, ``SignalException`` on Ctrl-C / SIGTERM.
    """
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    with tempfile.TemporaryDirectory(prefix="ptdp-launch-") as log_dir:
        return _launch(entrypoint, nproc, args, log_dir)


def _launch(entrypoint, nproc: int, args: tuple, log_dir: str) -> dict:
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ptdp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    return elastic_launch(launch_config, entrypoint)(*args)[0]
