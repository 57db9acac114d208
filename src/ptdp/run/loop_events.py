"""What the training loop does besides steps and may stop it for: steps skipped for non-finite
values (a warning, or :class:`TrainingError` past ``--max-skipped-steps``) and checkpoint saves
(synchronous or ``--async-save``; one that cannot be written stops training), with what a
checkpoint keeps of the run's tokenizer. Every rank calls them alike; rank 0 logs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from ptdp.data.prepared_data import PreparedData
from ptdp.data.tokenizer import tokenizer_config_beside
from ptdp.engine import activity
from ptdp.engine.step_results import NONFINITE_GRAD_NORM
from ptdp.run.checkpoint.folders import CheckpointError
from ptdp.run.checkpoint.saver import Checkpointer
from ptdp.run.metrics import RunLog


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. more than ``max_skipped_steps`` steps in a row had a nan/inf loss
    or gradient norm, or a checkpoint would hold non-finite values); all ranks raise it."""


def non_finite_step(result, iteration: int, in_a_row: int, limit: int, log: RunLog, codec: str = "none") -> None:
    """A step skipped for a nan/inf loss or gradient norm: a warning, or :class:`TrainingError`
    (on every rank alike) when it makes more than ``limit`` such steps in a row. With
    ``--grad-compression fp16`` (``codec``) a non-finite norm after a finite loss says that a mean
    gradient beyond float16's range overflows it."""
    what = (
        f"loss {result.loss} / gradient norm {result.grad_norm} is not finite at iteration {iteration} "
        f"({result.skip_reason} on some rank)"
    )
    if codec == "fp16" and result.skip_reason == NONFINITE_GRAD_NORM and math.isfinite(result.loss):
        what += (
            " (with --grad-compression fp16 a mean gradient above 65,504 overflows float16; "
            "--grad-compression bf16 has float32's range)"
        )
    if in_a_row > limit:
        log.close()
        raise TrainingError(
            f"{what}: {in_a_row} such steps in a row, more than --max-skipped-steps {limit}; "
            f"stopping (try a lower --lr or --clip-grad, or check the data)"
        )
    log.message(f"warning: {what}; the step is skipped on every rank, no update ({in_a_row} in a row, at most {limit})")


def tokenizer_files(data: PreparedData, tokenizer_model: str | None) -> dict[str, Path]:
    """What a checkpoint keeps of the run's tokenizer: its ``tokenizer.json`` and, for a
    ``--tokenizer-model`` with one beside it, the ``tokenizer_config.json`` naming its special
    tokens (``ptdp convert to-hf`` writes them out as given), or the one the prepared data hold
    (written for an ``--eod-token`` added to the tokenizer)."""
    files = {"tokenizer.json": Path(data.tokenizer_path)}
    config = tokenizer_config_beside(data.tokenizer_path) if tokenizer_model else None
    config = config or (tokenizer_config_beside(tokenizer_model) if tokenizer_model else None)
    return files | ({"tokenizer_config.json": config} if config else {})


def save_and_log(
    saver: Checkpointer, stage, ck, iteration: int, consumed_samples: int, log: RunLog, files: dict[str, Path]
) -> None:
    """Save a checkpoint (after completing one still being written, ``--async-save``); one that
    cannot be written (e.g. non-finite values, refused on every rank) stops training with
    :class:`TrainingError`."""
    start = time.perf_counter()
    activity.set_phase(activity.CHECKPOINT, iteration)
    try:
        folder, earlier = saver.save(
            stage,
            ck.save,
            iteration,
            consumed_samples=consumed_samples,
            keep_last=ck.keep_last,
            files=files,
        )
    except CheckpointError as e:
        log.close()
        raise TrainingError(str(e)) from e
    if earlier is not None:
        log.message(f"iteration {iteration:>6}: saved checkpoint {earlier} (written in the background)")
    took = f"{time.perf_counter() - start:.1f} s"
    log.message(
        f"iteration {iteration:>6}: checkpoint {folder} staged in CPU memory ({took}), written in the background"
        if saver.async_save
        else f"iteration {iteration:>6}: saved checkpoint {folder} ({took})"
    )


def complete_save(complete, log: RunLog) -> None:
    """Complete a save written in the background (``--async-save``): ``complete`` is the saver's
    ``wait`` (every rank waits for it) or ``poll`` (only once every rank has written it)."""
    try:
        folder = complete()
    except CheckpointError as e:
        log.close()
        raise TrainingError(str(e)) from e
    if folder is not None:
        log.message(f"saved checkpoint {folder} (written in the background)")
