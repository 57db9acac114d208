"""Start-up of one worker process inside a torchrun / elastic-launch job."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ptdp.topology.binding import bind_this_worker


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's environment (1 process if unset)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )


def init_distributed(timeout_minutes: float, threads_per_worker: int | None = None,
                     bind_cpus: str = "none") -> torch.device:
    """Initialise the default process group from the launcher's environment; return the device.

    NCCL on ``cuda:LOCAL_RANK`` when CUDA is available, gloo on CPU otherwise. First, before any
    process group or thread pool exists, the worker binds itself to CPUs as ``bind_cpus`` says
    (:func:`ptdp.topology.binding.bind_this_worker`; ``none``: no binding) and then uses the
    binding's thread count. Without binding, on CPU each worker uses ``threads_per_worker``
    threads (default: the cores this process may use divided by the local world size, at least 1)
    so the workers of one machine do not oversubscribe it.

    Raises:
        BindingError: the binding asked for cannot be done (a ``ConfigError``).
    """
    _, local_rank, _ = env_world()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    binding = bind_this_worker(bind_cpus, local_rank, local_world, use_gpus=torch.cuda.is_available())
    if binding is not None and binding.threads is not None:
        threads_per_worker = binding.threads
        os.environ["OMP_NUM_THREADS"] = str(binding.threads)
        torch.set_num_threads(binding.threads)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    if threads_per_worker is None:
        threads_per_worker = max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads_per_worker)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")
