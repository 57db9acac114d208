"""Start ``ptdp train``'s local workers with PyTorch's elastic launcher (the API behind torchrun)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ptdp.config.schema import Config
from ptdp.run import postmortem, rank_records


class WorkerFailedError(RuntimeError):
    """A worker died or raised, and the launcher had no restart left; the message names it."""


def launch_local(
    config: Config, nproc: int, run_dir: str, data_dir: str, *, progress: bool, max_restarts: int = 0
) -> dict:
    """Run ``nproc`` workers of ``ptdp.run.worker.worker_entry`` on this machine; return rank 0's result,
    or ``{"error": message}`` when a worker failed for good. See :func:`launch_workers`. On a CUDA
    machine the workers' GPUs follow the placement of this machine's topology
    (:func:`ptdp.topology.gpu_order.gpu_order`), printed first."""
    import torch

    from ptdp.run.worker import worker_entry

    if torch.cuda.is_available():
        from ptdp.topology.gpu_order import gpu_order

        p = config.parallel
        # rank order tp-cp-dp-pp is tp-dp-pp with the dp x cp ranks as one axis (index cp_rank + cp * dp_rank)
        env, lines = gpu_order(p.tp, p.pp, p.cp * p.dp, nproc)
        for line in lines:
            print(line, flush=True)
        os.environ.update(env)
    try:
        return launch_workers(
            worker_entry,
            nproc,
            config.to_json(),
            run_dir,
            data_dir,
            progress,
            max_restarts=max_restarts,
            collective_timeout_s=60.0 * config.parallel.distributed_timeout_minutes,
        )
    except WorkerFailedError as e:
        return {"error": str(e)}


def launch_workers(
    entrypoint, nproc: int, *args, max_restarts: int = 0, collective_timeout_s: float | None = None
) -> dict:
    """Run ``nproc`` workers of ``entrypoint(*args)`` on this machine; return rank 0's result.

    Rendezvous on loopback, a free port. A failed worker makes the launcher restart all, up to
    ``max_restarts`` times (resuming: :mod:`ptdp.run.restart`). ``collective_timeout_s``: the workers'
    process-group timeout, to tell NCCL watchdog aborts from failures (:func:`ptdp.run.postmortem.diagnose`).
    Raises :class:`WorkerFailedError` naming the first failed rank and how it ended when no restart is
    left, ``SignalException`` on Ctrl-C / SIGTERM.
    """
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    with (
        tempfile.TemporaryDirectory(prefix="ptdp-launch-") as log_dir,
        _fresh_store_per_attempt(max_restarts),
        _environ(rank_records.DIR_ENV, os.path.join(log_dir, "postmortem")),
        _quiet_launcher(),
    ):
        try:
            return _launch(entrypoint, nproc, args, log_dir, max_restarts)
        except ChildFailedError as e:
            records = _last_attempt(os.path.join(log_dir, "postmortem"))
            diagnosis = postmortem.diagnose(records, nproc, collective_timeout_s) if records is not None else None
            raise WorkerFailedError(failure_message(e, max_restarts, diagnosis)) from e


def failure_message(error: ChildFailedError, max_restarts: int, diagnosis: postmortem.Diagnosis | None = None) -> str:
    """One paragraph: which rank failed first, how (signal or exit code, the worker's own error and
    the end of its traceback), in which phase and iteration, that no restart was left, and that
    the other ranks' errors follow from it. ``diagnosis`` (the workers' own records,
    :mod:`ptdp.run.postmortem`) decides which rank failed first; without it, the rank the launcher
    reports."""
    rank, failure = error.get_first_failure()
    restarts = (
        f"after {max_restarts} restart(s), none left (--max-restarts {max_restarts})"
        if max_restarts
        else "no restarts allowed (--max-restarts 0)"
    )
    if diagnosis is not None:
        first = diagnosis.first
        pid = failure.pid if first.rank == rank else (first.pid if first.pid is not None else "?")
        exit_text = _exit_text(failure) if first.rank == rank else None
        head = f"worker rank {first.rank} (local rank {first.rank}, pid {pid})"  # one node: local = global rank
        return f"{diagnosis.message(head=head, exit_text=exit_text)}\n{restarts}"
    text = f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {_exit_text(failure)}; {restarts}"
    others = sorted(r for r in error.failures if r != rank)
    if others:
        text += f"; ranks {others} failed too"
    message: object = failure.message  # annotated str, but torch puts the error file's JSON object there
    if failure.exitcode >= 0 and isinstance(message, str) and failure.error_file != "<N/A>":
        text += f"\n{message}"
    elif failure.exitcode >= 0 and isinstance(message, dict):
        text += f"\n{message.get('message', '')}"
    return text


def _exit_text(failure) -> str:
    if failure.exitcode < 0:
        return f"was killed by signal {failure.signal_name()} (exit code {failure.exitcode})"
    return f"exited with code {failure.exitcode}"


def _last_attempt(root: str) -> Path | None:
    """The records folder of the job's last attempt, if any."""
    attempts = sorted(Path(root).glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    return attempts[-1] if attempts else None


@contextlib.contextmanager
def _environ(name: str, value: str):
    """``os.environ[name] = value`` while the block runs (the spawned workers inherit it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def _quiet_launcher():
    """Keep the launcher's own error logs (the traceback of whichever worker it polled first, and
    its "Terminating process" lines) off the terminal: :func:`failure_message` says who failed
    first and how."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


#: torch's switch that gives every attempt its own TCPStore (hosted by worker rank 0 on a new free
#: port) instead of the launcher's one store shared by all attempts.
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextlib.contextmanager
def _fresh_store_per_attempt(max_restarts: int):
    """With restarts, set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` while the launcher runs: in the
    store it shares by default, a restarted worker finds the previous attempt's process-group keys
    (its peers' old addresses) and fails to connect (pytorch/pytorch#135712, #167288)."""
    if not max_restarts:
        yield
        return
    with _environ(NO_SHARED_STORE, "1"):
        yield


def _launch(entrypoint, nproc: int, args: tuple, log_dir: str, max_restarts: int) -> dict:
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ptdp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    return elastic_launch(launch_config, entrypoint)(*args)[0]
