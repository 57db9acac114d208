"""Workers and GPUs: the default worker count on a GPU machine is its GPU count, more workers than
GPUs is an error before any process starts, one GPU per task uses cuda:0, and the NCCL watchdog
settings (ptdp.config.resolve.local_world_size, ptdp.run.distributed). CUDA is simulated by
monkeypatching torch.cuda."""

from __future__ import annotations

import os

import pytest
import torch

from ptdp import cli
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import local_world_size
from ptdp.config.schema import Config, LaunchConfig
from ptdp.errors import ConfigError
from ptdp.run import distributed


def _config(tp=2, pp=2, dp=None, nproc=None) -> Config:
    return Config(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp),
        launch=LaunchConfig(nproc_per_node=nproc),
    )


@pytest.mark.parametrize(
    "tp, pp, gpus, expected",
    [
        (2, 2, 4, 4),  # a 4-GPU node: 4 workers (dp 1), not 8
        (2, 2, 8, 8),
        (1, 1, 1, 1),  # one GPU
        (1, 2, 6, 6),
        (2, 2, None, 8),  # no CUDA: 8 local CPU workers as before
        (1, 1, None, 8),
    ],
)
def test_default_workers_are_the_visible_gpus(tp, pp, gpus, expected):
    assert local_world_size(_config(tp, pp), gpus) == expected


@pytest.mark.parametrize(
    "config, gpus, named",
    [
        (_config(2, 2), 2, "4 local workers (tp x cp x pp)"),  # the default layout on 2 GPUs
        (_config(2, 2, nproc=8), 4, "8 local workers (--nproc-per-node)"),
        (_config(1, 2, dp=4), 4, "8 local workers (tp x cp x pp x dp)"),
    ],
)
def test_more_workers_than_gpus_is_an_error_naming_both(config, gpus, named):
    with pytest.raises(ConfigError) as info:
        local_world_size(config, gpus)
    text = str(info.value)
    assert named in text and f"only {gpus} GPU(s)" in text, text
    [violation] = info.value.violations
    assert violation.rule == "workers <= gpus"
    assert violation.values["gpus"] == gpus and violation.values["workers"] == int(named.split()[0])


def test_as_many_workers_as_gpus_or_fewer_is_fine():
    assert local_world_size(_config(2, 2, nproc=4), 4) == 4
    assert local_world_size(_config(1, 1, dp=3), 8) == 3


@pytest.mark.parametrize(
    "local_rank, local_world, count, index",
    [
        (3, 4, 4, 3),  # torchrun / ptdp train: every process sees every GPU of the node
        (0, 8, 8, 0),
        (5, 4, 8, 5),  # fewer processes than GPUs
        (3, 4, 1, 0),  # one GPU per task (Slurm --gpus-per-task=1): the only visible one
        (0, 1, 1, 0),
        (6, 1, 1, 0),  # SLURM_LOCALID-style local rank with a single visible device
    ],
)
def test_device_index(local_rank, local_world, count, index):
    assert distributed.cuda_device_index(local_rank, local_world, count) == index


def test_more_processes_than_visible_gpus_is_an_error_naming_both(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(
        ConfigError,
        match=r"8 processes on this node .* only 4 GPUs visible .*"
        r"CUDA_VISIBLE_DEVICES=0,1,2,3",
    ):
        distributed.cuda_device_index(5, 8, 4)
    with pytest.raises(ConfigError, match="shows no GPU"):
        distributed.cuda_device_index(0, 1, 0)


def test_nccl_watchdog_settings_respect_the_users_values():
    assert distributed.nccl_watchdog_env({}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
    }
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    assert distributed.nccl_watchdog_env(mine) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def _fake_cuda(monkeypatch, count: int) -> list:
    calls = []
    monkeypatch.setattr("ptdp.config.train_flags.cpu_only_torch", lambda: False)  # a CUDA build, as faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        distributed.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw["device_id"]))
    )
    return calls


def test_one_gpu_per_task_initialises_nccl_on_cuda0(monkeypatch):
    """Slurm with one GPU per task: local rank 3 of 4 sees one GPU and drives cuda:0; the
    watchdog settings are in the environment before the NCCL group is created."""
    for name in distributed.NCCL_WATCHDOG_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    calls = _fake_cuda(monkeypatch, 1)
    device = distributed.init_distributed(1.0)
    assert device == torch.device("cuda", 0)
    assert calls == [("set_device", torch.device("cuda", 0)), ("nccl", torch.device("cuda", 0))]
    assert {k: os.environ[k] for k in distributed.NCCL_WATCHDOG_DEFAULTS} == distributed.NCCL_WATCHDOG_DEFAULTS


def test_too_many_processes_for_the_gpus_stop_before_any_group(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    calls = _fake_cuda(monkeypatch, 2)
    with pytest.raises(ConfigError, match="4 processes on this node"):
        distributed.init_distributed(1.0)
    assert calls == []


def test_ptdp_train_refuses_more_workers_than_gpus_before_starting(monkeypatch, capsys):
    """Exit 2 with both numbers, before any data preparation or worker (the launcher is never reached)."""
    _fake_cuda(monkeypatch, 2)
    import ptdp.run.launch as launch

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("workers were started"))
    assert cli.main(["train", "--nproc-per-node", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "ptdp train: error:" in err and "4 local workers (--nproc-per-node)" in err and "only 2 GPU(s)" in err
    assert cli.main(["train", "--no-progress"]) == 2  # default tp 2 x pp 2 needs 4 GPUs
    assert "4 local workers (tp x cp x pp)" in capsys.readouterr().err


def test_torchrun_worker_with_more_processes_than_gpus_exits_2_naming_both(monkeypatch, capsys):
    """``torchrun --nproc-per-node 4 -m ptdp.train`` on a node showing 2 GPUs: each worker stops
    before any process group exists (exit 2)."""
    from ptdp.run import worker

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for name, value in {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    calls = _fake_cuda(monkeypatch, 2)
    assert worker.main(["--force", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "ptdp.train: error on rank 2: 4 processes on this node (LOCAL_WORLD_SIZE) but only 2 GPUs visible" in err
    assert calls == []
