"""Start-up of one worker process inside a torchrun / elastic-launch job."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ptdp.errors import ConfigError
from ptdp.topology.binding import bind_this_worker


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's environment (1 process if unset)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )


def init_distributed(
    timeout_minutes: float, threads_per_worker: int | None = None, bind_cpus: str = "none"
) -> torch.device:
    """Initialise the default process group from the launcher's environment; return the device.

    NCCL on :func:`cuda_device_index`'s GPU when CUDA is available (watchdog settings of
    :func:`nccl_watchdog_env`), gloo otherwise. First the worker binds itself to CPUs per ``bind_cpus``
    (:func:`ptdp.topology.binding.bind_this_worker`) and uses its thread count; unbound on CPU it uses
    ``threads_per_worker`` (default: allowed cores / local world size, at least 1).

    Raises:
        BindingError: the binding asked for cannot be done (a ``ConfigError``).
        ConfigError: more local workers than visible GPUs (:func:`cuda_device_index`).
    """
    _, local_rank, _ = env_world()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpu = cuda_device_index(local_rank, local_world, torch.cuda.device_count()) if torch.cuda.is_available() else None
    binding = bind_this_worker(bind_cpus, local_rank, local_world, use_gpus=torch.cuda.is_available())
    if binding is not None and binding.threads is not None:
        threads_per_worker = binding.threads
        os.environ["OMP_NUM_THREADS"] = str(binding.threads)
        torch.set_num_threads(binding.threads)
    if gpu is not None:
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
        for name, value in nccl_watchdog_env(os.environ).items():
            os.environ[name] = value  # read by ProcessGroupNCCL when it is created, just below
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    if threads_per_worker is None:
        threads_per_worker = max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads_per_worker)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def cuda_device_index(local_rank: int, local_world: int, device_count: int) -> int:
    """The CUDA device (index among the visible ones) of local rank ``local_rank`` of ``local_world``:
    ``0`` when one GPU is visible (one GPU per task, e.g. Slurm ``--gpus-per-task=1``), else
    ``local_rank`` (torchrun, ``ptdp train``).

    Raises:
        ConfigError: more local processes than visible GPUs (and more than one visible), naming both
            numbers: two processes would share a GPU, which NCCL refuses.
    """
    if device_count < 1:
        raise ConfigError("CUDA is available but shows no GPU (torch.cuda.device_count() = 0)")
    if device_count == 1:
        return 0
    if local_world > device_count:
        raise ConfigError(
            f"{local_world} processes on this node (LOCAL_WORLD_SIZE) but only {device_count} GPUs "
            f"visible (torch.cuda.device_count(), CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): each process needs a GPU of its own; "
            f"start at most {device_count} per node (torchrun --nproc-per-node)"
        )
    return local_rank % device_count


#: NCCL watchdog settings ptdp turns on unless the user set them (names as ProcessGroupNCCL of
#: torch 2.13 reads them when a group is created): 1 = on a failed or timed-out collective, abort
#: the communicators and then the process (SIGABRT), instead of 3 (torch's default: the process
#: only); the flight recorder keeps the last 2,000 collectives per group and dumps them on a
#: timeout (``TORCH_FR_BUFFER_SIZE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is its older name).
NCCL_WATCHDOG_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_BUFFER_SIZE": "2000",
}


def nccl_watchdog_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add before the NCCL process group exists: :data:`NCCL_WATCHDOG_DEFAULTS`
    not already set (a buffer size given under either name counts). The dump goes where torch
    puts it by default (a ``comm_lib_trace_rank_<rank>`` file in the temporary folder in torch
    2.13; ``TORCH_FR_DUMP_TEMP_FILE`` sets the path prefix). Pure."""
    out = {k: v for k, v in NCCL_WATCHDOG_DEFAULTS.items() if k not in environ}
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" in environ:
        out.pop("TORCH_FR_BUFFER_SIZE", None)
    return out
