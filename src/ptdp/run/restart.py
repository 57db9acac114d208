"""Restarts of a training job (``ptdp train --max-restarts N`` or ``torchrun --max-restarts N``).

PyTorch's elastic launcher restarts all workers with ``TORCHELASTIC_RESTART_COUNT=k``; each resumes
by itself (:func:`resume_config`) from the newest complete checkpoint in ``--save`` (it wins over
``--load``; optimizer and RNG states restored), else from ``--load``, else from scratch (rank 0
says so). Data continue from the checkpoint's sample position, so training matches an
uninterrupted run. Rank 0 appends to the same ``metrics.jsonl`` with ``"restart": k`` on every
line, after ``{"event": "restart", "restart": k, "resumed_from_iteration": i, "checkpoint": path}``.
"""

from __future__ import annotations

import dataclasses
import os

from ptdp.config.schema import Config
from ptdp.errors import ConfigError
from ptdp.run.checkpoint.folders import newest_checkpoint


def restart_count() -> int:
    """How many times the launcher has restarted this job's workers (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def max_restarts_of_torchrun() -> int:
    """``--max-restarts`` of the torchrun that started this worker (0 without one)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)


def check_torchrun_restarts(output_dir: str | None) -> None:
    """Under ``torchrun --max-restarts N`` (N > 0), raise ConfigError unless a restart can work:
    ``--output-dir`` is needed (the default run directory's name holds the start time, and the
    resumed part is appended to the first attempt's), and so is ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in torchrun's environment: in the store torchrun shares with its workers by default, a
    restarted worker finds the previous attempt's process-group keys (its peers' old addresses)
    and cannot connect (pytorch/pytorch#135712, #167288). ``ptdp train`` sets it itself."""
    n = max_restarts_of_torchrun()
    needs = []
    if n and not output_dir:
        needs.append("--output-dir (a restarted job appends to the run directory of its first attempt)")
    if n and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        needs.append(
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (with the store torchrun "
            "shares by default, restarted workers read their peers' addresses from the previous "
            "attempt and cannot connect)"
        )
    if needs:
        raise ConfigError(f"torchrun --max-restarts {n} needs " + " and ".join(needs))


def resume_config(config: Config, restart: int) -> Config:
    """``config`` for attempt ``restart`` of the job: ``checkpoint.load`` set to the newest complete
    checkpoint in ``checkpoint.save`` when restarting and there is one; otherwise unchanged."""
    ck = config.checkpoint
    newest = newest_checkpoint(ck.save) if restart and ck.save else None
    if newest is None:
        return config
    own = dataclasses.replace(ck, load=str(newest), no_load_optim=False, no_load_rng=False)
    return dataclasses.replace(config, checkpoint=own)
