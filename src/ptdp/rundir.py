"""Preparing a run before any worker starts: its data and its run directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ptdp.config import Config, ConfigError
from ptdp.data import DataError, PreparedData, prepare_data
from ptdp.metrics import write_json


def cache_dir(config: Config) -> Path:
    """``--data-cache-dir``, else ``$PTDP_CACHE_DIR``, else ``~/.cache/ptdp``."""
    if config.data.data_cache_dir:
        return Path(config.data.data_cache_dir).expanduser()
    return Path(os.environ.get("PTDP_CACHE_DIR", "~/.cache/ptdp")).expanduser()


def prepare(config: Config, log=print) -> PreparedData:
    """Tokenizer and token files for the run's corpus (cached; the default corpus when none given).

    Raises:
        DataError: unusable data, or too little of it for one global batch of training samples or
            one validation sequence (checked here, before any worker starts).
        CheckpointError: ``--load`` names no usable checkpoint for this model.
    """
    if config.checkpoint.save:
        from ptdp.checkpoint.io import check_save_dir

        check_save_dir(config.checkpoint.save)
    paths = list(config.data.data_paths) or None
    cache = cache_dir(config)
    if cache.exists() and not cache.is_dir():
        raise DataError(f"data cache directory {cache} exists and is not a directory")
    data = prepare_data(paths, config.model.vocab_size, cache, config.data.valid_fraction, log=log)
    check_data_fits(config, data)
    if config.checkpoint.load:
        from ptdp.checkpoint.io import precheck
        from ptdp.step import with_vocab

        precheck(with_vocab(config, data.vocab_size))
    return data


def check_data_fits(config: Config, data: PreparedData) -> None:
    """Raise DataError unless the corpus holds one global batch of samples and one validation sample."""
    s, big_b = config.model.seq_length, config.train.global_batch_size
    train_samples = max(0, (data.num_train_tokens - 1) // s)
    if train_samples < big_b:
        raise DataError(
            f"the training split has {data.num_train_tokens:,} tokens = {train_samples} samples of "
            f"seq_length+1={s + 1} tokens, fewer than global_batch_size={big_b}; use more data, a "
            f"shorter --seq-length or a smaller --global-batch-size"
        )
    if config.train.eval_iters > 0 and data.num_valid_tokens < s + 1:
        raise DataError(
            f"the validation split has {data.num_valid_tokens:,} tokens, fewer than one sample of "
            f"seq_length+1={s + 1}; use more data, a larger --valid-fraction or --eval-iters 0"
        )


def run_dir_path(config: Config) -> Path:
    """``--output-dir``, else ``runs/<YYYYmmdd-HHMMSS>-tp<TP>-pp<PP>-dp<DP>``."""
    p = config.parallel
    return Path(config.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-tp{p.tp}-pp{p.pp}-dp{p.dp}")


def check_run_dir(path: Path, *, overwrite: bool) -> None:
    """Raise ConfigError if ``path`` is a file, or a non-empty folder and not ``overwrite``."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output directory {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ConfigError(f"output directory {path} exists and is not empty; pass --overwrite or another --output-dir")


def make_run_dir(path: Path, *, overwrite: bool) -> Path:
    """Create the run directory (after :func:`check_run_dir`); a stale ``metrics.jsonl`` is removed."""
    check_run_dir(path, overwrite=overwrite)
    path.mkdir(parents=True, exist_ok=True)
    metrics = path / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    return path


def write_config(run_dir: Path, config: Config, data: PreparedData) -> None:
    """``config.json``: the resolved config (real vocabulary size) and the prepared data it used."""
    from ptdp.step import with_vocab

    record = with_vocab(config, data.vocab_size).to_dict()
    record["requested_vocab_size"] = config.model.vocab_size
    record["num_microbatches"] = config.num_microbatches
    record["prepared_data"] = {
        "cache_dir": str(data.cache_dir), "tokenizer": str(data.tokenizer_path),
        "train_tokens": data.num_train_tokens, "valid_tokens": data.num_valid_tokens,
        "train_documents": data.num_train_docs, "valid_documents": data.num_valid_docs,
    }
    write_json(run_dir / "config.json", record)
