"""Command-line flags of ``ptdp train`` (and ``python -m ptdp.train`` under torchrun), generated
from the configuration schema (:mod:`ptdp.config.flags`).

Flag names follow Megatron-LM (``--tensor-model-parallel-size``, ``--micro-batch-size``, ...) with
short aliases (``--tp``, ``--mbs``). Defaults come from the schema, except the parallel sizes:
``ptdp train`` defaults to tp=2, pp=2 and dp inferred from the number of workers (8 local workers,
or one per visible GPU, unless told otherwise), and its process-group timeout is 2 minutes on a
machine without CUDA.
``--config FILE`` takes settings from a TOML, YAML or JSON file (:mod:`ptdp.config.files`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ptdp.config.files import add_config_flags
from ptdp.config.flags import add_flags, config_from_args
from ptdp.config.resolve import local_world_size as _local_world_size
from ptdp.errors import ConfigError

DEFAULT_TP, DEFAULT_PP = 2, 2
#: ``ptdp train``'s process-group timeout on a machine without CUDA: local CPU workers keep each
#: other waiting for seconds at most, so a stopped worker is reported soon
LOCAL_CPU_TIMEOUT_MINUTES = 2.0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and shows each flag's default value, unless the help
    text already explains it or there is none (switches, optional values)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action, argparse._StoreFalseAction):  # a switch that turns something off: off by default
            return text
        if isinstance(action.default, tuple):  # (0, 3) -> 0,3, as the flag is written
            return f"{text} (default: {','.join(map(str, action.default))})"
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_train_arguments(parser: argparse.ArgumentParser, *, local_launch: bool) -> None:
    """Add every training flag to ``parser`` (from the schema) and ``--config``/``--print-config``;
    ``local_launch``: ``ptdp train``'s own (``--nproc-per-node``, ``--max-restarts``, and a
    2-minute process-group timeout without CUDA)."""
    defaults = {}
    if local_launch and not _cuda_available():
        defaults["distributed_timeout_minutes"] = LOCAL_CPU_TIMEOUT_MINUTES
    add_flags(parser, "train" if local_launch else "torchrun", defaults)
    add_config_flags(parser)


def _cuda_available() -> bool:
    """Whether torch sees a GPU; a CPU-only build is told without importing torch (:func:`cpu_only_torch`)."""
    if cpu_only_torch():
        return False
    import torch

    return torch.cuda.is_available()


def cpu_only_torch() -> bool:
    """True when the installed torch is a CPU-only build: its ``torch/version.py`` says ``cuda =
    None`` and ``hip = None``, read without importing torch, so that ``ptdp train`` answers a bad
    request on a CPU machine without torch's import (seconds). False when unsure (ask torch)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations or not (Path(locations[0]) / "version.py").is_file():
        return False
    version_spec = importlib.util.spec_from_file_location("_ptdp_torch_version", Path(locations[0]) / "version.py")
    if version_spec is None or version_spec.loader is None:
        return False
    version = importlib.util.module_from_spec(version_spec)
    try:
        version_spec.loader.exec_module(version)
    except Exception:  # an unusual build: ask torch itself
        return False
    return getattr(version, "cuda", "") is None and getattr(version, "hip", "") is None


def local_world_size(args: argparse.Namespace, gpus: int | None = None) -> int:
    """Workers ``ptdp train`` starts on this machine (``gpus``: the visible GPUs, None without
    CUDA; see :func:`ptdp.config.resolve.local_world_size`); ConfigError unless ``--nproc-per-node``
    is a positive integer, or when it asks for more workers than ``gpus``."""
    return _local_world_size(config_from_args(args), gpus)


def max_restarts(args: argparse.Namespace) -> int:
    """``--max-restarts`` of ``ptdp train``; raises ConfigError unless it is >= 0."""
    if not isinstance(args.max_restarts, int) or args.max_restarts < 0:
        raise ConfigError(f"max_restarts={args.max_restarts!r} must be >= 0 (0: a failed worker ends the run)")
    return args.max_restarts
