"""One preflight for ``ptdp train``'s local launcher and ``torchrun -m ptdp.train``.

After :func:`ptdp.config.resolve`, the checks that need no worker run in order, and the first
problem stops the run with a one-line error (exit 2) before anything is written:

1. :func:`check_request`: requested trackers installed (:func:`ptdp.run.tracking.check_trackers`)
   and the planner's memory estimate (unless ``--force``);
2. :func:`prepare_run`: run directory, ``--load`` and ``--save`` folders, the data (cached, holding
   one global batch), then the run directory and its ``config.json``.

Under torchrun the steps are split over ranks (:class:`Roles`) and any rank's error is raised on
every rank (``share``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ptdp.config.schema import Config
from ptdp.data.prepared_data import PreparedData
from ptdp.errors import ConfigError, DataError
from ptdp.run.memory_check import check_memory
from ptdp.run.rundir import check_run_dir, make_run_dir, prepare, run_dir_path, write_config
from ptdp.run.tracking import check_trackers


def check_request(config: Config, local_workers: int) -> None:
    """Checks of the resolved request alone: the packages of the trackers it asks for
    (:func:`~ptdp.run.tracking.check_trackers`), a given ``--hardware-profile``
    (:func:`check_hardware_profile`), then the memory estimate of the
    ``local_workers`` on this machine (:mod:`ptdp.run.memory_check`), unless ``--force``; with
    ``--tokenizer-model`` it is made for that tokenizer's vocabulary, not ``--vocab-size``. Raises
    ConfigError, or DataError naming a ``--tokenizer-model`` that is not a tokenizer."""
    check_trackers(config)
    check_hardware_profile(config)
    if not config.launch.force:
        check_memory(_with_given_vocabulary(config), local_workers)


def check_hardware_profile(config: Config) -> None:
    """A ``--hardware-profile`` given explicitly must be one ``ptdp plan --calibrate`` wrote (the
    run compares its step time with the planner's prediction from it at the end); ConfigError
    naming the path otherwise, before any worker starts. The default profile, used when present,
    is not required."""
    if not config.hardware_profile:
        return
    from ptdp.planner.time.profile import load_profile

    try:
        load_profile(config.hardware_profile)
    except ValueError as e:
        raise ConfigError(f"--hardware-profile: {e}") from None


def _with_given_vocabulary(config: Config) -> Config:
    """``config`` with the vocabulary of its ``--tokenizer-model`` (read here), if it has one."""
    if config.data.tokenizer_model is None:
        return config
    from ptdp.data.tokenizer import load_tokenizer_model

    vocab = load_tokenizer_model(config.data.tokenizer_model, config.data.eod_token).vocab_size
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab))


@dataclass(frozen=True)
class Roles:
    """Which preflight steps this process does (all of them for ``ptdp train``'s launcher)."""

    checks_run_dir: bool = True
    prepares_data: bool = True
    writes_run_dir: bool = True


@dataclass(frozen=True)
class Share:
    """How processes agree (torchrun): ``raise_first(error)`` raises the first rank's error on every
    rank (or returns), ``run_dir(path)`` gives every rank rank 0's run directory."""

    raise_first: Callable[[BaseException | None], None]
    run_dir: Callable[[Path], Path]


def prepare_run(
    config: Config,
    *,
    roles: Roles = Roles(),
    restart: int = 0,
    share: Share | None = None,
    log: Callable[[str], None] = print,
) -> tuple[Config, Path, PreparedData]:
    """Check the run directory, prepare the data and create the run directory with its
    ``config.json`` (a restarted job keeps its first attempt's). Returns the config with
    ``output_dir`` set, the run directory and the prepared data. Raises ConfigError/DataError."""
    run_dir = run_dir_path(config)
    overwrite, load = config.launch.overwrite, config.checkpoint.load
    error, data = None, None
    try:
        if roles.checks_run_dir and not restart:
            check_run_dir(run_dir, overwrite=overwrite, load=load)
        if roles.prepares_data:
            data = prepare(config, log=log)
    except (ConfigError, DataError) as e:
        if share is None:
            raise
        error = e
    if share is not None:
        share.raise_first(error)
    if data is None:
        data = prepare(config, log=lambda _msg: None)  # built by another process: found in the cache
    if roles.writes_run_dir and restart:
        run_dir.mkdir(parents=True, exist_ok=True)
    elif roles.writes_run_dir:
        make_run_dir(run_dir, overwrite=overwrite, load=load)
        write_config(run_dir, dataclasses.replace(config, output_dir=str(run_dir)), data)
    if share is not None:
        run_dir = share.run_dir(run_dir)
    return dataclasses.replace(config, output_dir=str(run_dir)), run_dir, data
