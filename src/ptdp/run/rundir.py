"""Preparing a run before any worker starts: its data and its run directory.

Nothing that exists is overwritten unless asked: a non-empty run directory needs ``--overwrite``,
or ``--load`` of a checkpoint that run saved (the run is continued: its files are kept and
``metrics.jsonl`` is appended to); a ``--save`` folder that already holds checkpoints is used
only to resume from them (``--load`` inside it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ptdp.config.schema import Config
from ptdp.data.prepare import prepare_data
from ptdp.data.prepared_data import PreparedData
from ptdp.errors import ConfigError, DataError
from ptdp.run.metrics import write_json
from ptdp.run.paths import folder_problem


def cache_dir(config: Config) -> Path:
    """``--data-cache-dir``, else ``$PTDP_CACHE_DIR``, else ``~/.cache/ptdp``."""
    if config.data.data_cache_dir:
        return Path(config.data.data_cache_dir).expanduser()
    return Path(os.environ.get("PTDP_CACHE_DIR", "~/.cache/ptdp")).expanduser()


def prepare(config: Config, log=print) -> PreparedData:
    """Tokenizer and token files for the run's corpus (cached; the default corpus when none given).

    Raises:
        DataError: unusable data, or too little for one global batch or one validation sequence.
        CheckpointError: ``--load`` names no usable checkpoint for this model (checked before the data
            are prepared), or ``--save`` holds checkpoints that ``--load`` does not resume from.
    """
    ck = config.checkpoint
    if ck.load:
        from ptdp.run.checkpoint.folders import check_model_shape

        loaded = check_model_shape(ck.load, config)
    if ck.save:
        from ptdp.run.checkpoint.folders import check_save_dir

        check_save_dir(ck.save)
        check_save_holds_no_other_run(ck.save, ck.load)
    paths = list(config.data.data_paths) or None
    cache = cache_dir(config)
    if cache.exists() and not cache.is_dir():
        raise DataError(f"data cache directory {cache} exists and is not a directory")
    problem = folder_problem(cache)
    if problem:
        raise DataError(f"data cache directory (--data-cache-dir or $PTDP_CACHE_DIR): {problem}")
    d = config.data
    data = prepare_data(
        paths,
        config.model.vocab_size,
        cache,
        d.valid_fraction,
        log=log,
        tokenizer_model=d.tokenizer_model,
        eod_token=d.eod_token,
        text_key=d.data_text_key,
        workers=d.tokenizer_workers,
        progress=not config.launch.no_progress,
    )
    check_data_fits(config, data)
    if ck.load and d.tokenizer_model and loaded["model"]["vocab_size"] != data.vocab_size:
        raise DataError(
            f"--tokenizer-model {d.tokenizer_model} has {data.vocab_size} tokens but the model in --load "
            f"{ck.load} has a vocabulary of {loaded['model']['vocab_size']}: they must be equal"
        )
    if ck.load:
        from ptdp.engine.stage import with_vocab
        from ptdp.run.checkpoint.folders import precheck

        precheck(with_vocab(config, data.vocab_size))
    return data


def check_data_fits(config: Config, data: PreparedData) -> None:
    """Raise DataError unless the corpus holds one global batch of samples and one validation sample."""
    s, big_b = config.model.seq_length, config.train.global_batch_size
    train_samples = max(0, (data.num_train_tokens - 1) // s)
    if train_samples < big_b:
        raise DataError(
            f"the training split has {data.num_train_tokens:,} tokens = {train_samples} samples of "
            f"seq_length+1={s + 1} tokens, fewer than global_batch_size={big_b}: one global batch needs "
            f"{big_b}*{s}+1 = {big_b * s + 1:,} tokens; use more data, a shorter --seq-length or a "
            f"smaller --global-batch-size"
        )
    if config.train.eval_iters > 0 and data.num_valid_tokens < s + 1:
        raise DataError(
            f"the validation split has {data.num_valid_tokens:,} tokens, fewer than the seq_length+1 = "
            f"{s + 1} tokens of one sample; use more data, a larger --valid-fraction or --eval-iters 0"
        )


def run_dir_path(config: Config) -> Path:
    """``--output-dir``, else ``runs/<YYYYmmdd-HHMMSS>-tp<TP>-pp<PP>-dp<DP>`` (``-cp<CP>`` after
    the tp part when cp > 1)."""
    p = config.parallel
    cp = f"-cp{p.cp}" if p.cp > 1 else ""
    return Path(config.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-tp{p.tp}{cp}-pp{p.pp}-dp{p.dp}")


def check_run_dir(path: Path, *, overwrite: bool, load: str | None = None) -> None:
    """Raise ConfigError if ``path`` is a file, or a non-empty folder, unless ``overwrite`` or
    ``load`` continues the run that wrote it (:func:`continues_run`)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output directory {path} exists and is not a directory")
    problem = folder_problem(path)
    if problem:
        raise ConfigError(f"output directory (--output-dir): {problem}")
    if path.is_dir() and any(path.iterdir()) and not overwrite and not continues_run(path, load):
        raise ConfigError(
            f"output directory {path} exists and is not empty; pass --overwrite to write into it, "
            f"--load with a checkpoint that run saved to continue it, or another --output-dir"
        )


def continues_run(path: Path, load: str | None) -> bool:
    """True if ``load`` names a checkpoint in the folder the run in ``path`` saved into (its
    ``config.json``'s ``checkpoint.save``, relative paths taken from the current directory)."""
    if not load:
        return False
    from ptdp.run.checkpoint.folders import CheckpointError, resolve_checkpoint

    try:
        saved = json.loads((path / "config.json").read_text())["checkpoint"]["save"]
        folder = resolve_checkpoint(load)
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return False
    return bool(saved) and Path(saved).resolve() == folder.parent.resolve()


def check_save_holds_no_other_run(save: str, load: str | None) -> None:
    """Raise CheckpointError if ``save`` holds complete checkpoints and ``load`` is not one of them:
    saving there would replace them (same iterations, ``latest``, ``--keep-last`` pruning)."""
    from ptdp.run.checkpoint.folders import CheckpointError, complete_checkpoints, resolve_checkpoint

    found = complete_checkpoints(save)
    if not found:
        return
    if load:
        try:
            if resolve_checkpoint(load).parent.resolve() == Path(save).resolve():
                return
        except CheckpointError:
            pass
    raise CheckpointError(
        f"--save {save} already holds {len(found)} checkpoint(s) (newest {found[-1].name}) that this run "
        f"would overwrite; continue from them with --load {save}, or save into another folder"
    )


def make_run_dir(path: Path, *, overwrite: bool, load: str | None = None) -> Path:
    """Create the run directory (after :func:`check_run_dir`). A stale ``metrics.jsonl`` is removed,
    unless the run is continued (``load``), whose lines are appended to it."""
    check_run_dir(path, overwrite=overwrite, load=load)
    continued = continues_run(path, load)
    path.mkdir(parents=True, exist_ok=True)
    metrics = path / "metrics.jsonl"
    if metrics.exists() and not continued:
        metrics.unlink()
    return path


def write_config(run_dir: Path, config: Config, data: PreparedData) -> None:
    """``config.json``: the resolved config (real vocabulary size) and the prepared data it used."""
    from ptdp.engine.stage import with_vocab

    record = with_vocab(config, data.vocab_size).to_dict()
    record["requested_vocab_size"] = config.model.vocab_size
    record["num_microbatches"] = config.num_microbatches
    record["prepared_data"] = {
        "cache_dir": str(data.cache_dir),
        "tokenizer": str(data.tokenizer_path),
        "train_tokens": data.num_train_tokens,
        "valid_tokens": data.num_valid_tokens,
        "train_documents": data.num_train_docs,
        "valid_documents": data.num_valid_docs,
    }
    write_json(run_dir / "config.json", record)
