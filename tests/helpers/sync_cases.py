"""A short ``ptdp.run.trainer.train`` on synthetic tokens whose every step counts the host
synchronisations it would make on a GPU (:mod:`helpers.host_sync`), for the unit (one process)
and dist (2, 2, 2) tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from helpers.host_sync import count_cuda_syncs, count_host_syncs
from helpers.layout_cases import VOCAB, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.run import trainer

ITERS, LOG_INTERVAL = 7, 3


class _Tokens:
    """The part of :class:`ptdp.data.IndexedTokens` the trainer reads."""

    def __init__(self, seed: int, n: int) -> None:
        self.tokens = np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int64)
        self.num_tokens = n


@dataclasses.dataclass
class SyntheticData:
    """The part of :class:`ptdp.data.PreparedData` the trainer reads (no checkpoint is saved)."""

    vocab_size: int = VOCAB
    tokenizer_path: Path | None = None

    def train_tokens(self) -> _Tokens:
        return _Tokens(1, 20_000)

    def valid_tokens(self) -> _Tokens:
        return _Tokens(2, 2_000)


def logged(iteration: int) -> bool:
    return iteration % LOG_INTERVAL == 0 or iteration in (1, ITERS)


def counted_run(
    groups: ParallelGroups,
    tp: int,
    pp: int,
    dp: int,
    run_dir: Path,
    dtype: str = "float64",
    device: str = "cpu",
    moe=None,
    train: dict | None = None,
    **parallel,
) -> dict:
    """Train ITERS steps through the trainer on ``device``, counting each step's synchronisations
    (the shim on the CPU, CUDA's sync debug mode on a GPU); ``moe``: a ``MoEConfig``; ``train``:
    train overrides; returns ``{"per_step": {iteration: [calls]}, "final_loss", "iterations"}``."""
    counting = count_cuda_syncs if torch.device(device).type == "cuda" else count_host_syncs
    cfg = tiny_config(tp, pp, dp, dtype, parallel_overrides=parallel, train_overrides=train, moe=moe)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train, train_iters=ITERS, log_interval=LOG_INTERVAL, eval_interval=ITERS, eval_iters=1
        ),
    )
    per_step: dict[int, list[str]] = {}
    original = trainer._Loop.step

    def step(loop, it):
        with counting() as count:
            original(loop, it)
        per_step[it + 1] = count.calls

    run_dir.mkdir(parents=True, exist_ok=True)
    trainer._Loop.step = step
    try:
        summary = trainer.train(cfg, groups, SyntheticData(), run_dir, torch.device(device), progress=False)
    finally:
        trainer._Loop.step = original
    return {"per_step": per_step, "final_loss": summary["final_loss"], "iterations": summary["iterations"]}
