"""ptdp's Python API besides the planner: a validated :class:`~ptdp.spec.Config` from a file and
keywords (:func:`load_config`), and training in a launched worker (:func:`train`).

Both take the command line's flags by name (:mod:`ptdp.spec.keywords`), parsed by the parser of
``python -m ptdp.train``, so every rule is checked once, the same way, before any process group
exists. See ``docs/api.md``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ptdp.spec import Config


def load_config(path: str | Path | None = None, *, world_size: int | None = None, cuda: bool = False,
                **flags: Any) -> Config:
    """The resolved, checked configuration of a training run.

    Args:
        path: a TOML, YAML or JSON file of settings (as ``--config FILE``; a run's own
            ``config.json`` replays that run), or None.
        world_size: number of processes of the run (tp x cp x pp x dp); default: ``WORLD_SIZE``
            from the environment (set by torchrun), else 1.
        cuda: whether the workers train on CUDA GPUs (``params_dtype auto`` is then bfloat16).
        **flags: training flags by name, overriding the file (``tp=2``, ``micro_batch_size=4``,
            ``sequence_parallel=True``, ``data=["corpus.txt"]``...).

    Returns:
        The :class:`~ptdp.spec.Config` with ``dp`` filled in and ``params_dtype`` concrete.

    Raises:
        ConfigError (a ValueError): a bad file or setting, naming the values and the rule.
        TypeError: an unknown keyword.
    """
    from ptdp.commands.train_flags import add_train_arguments, config_from_args
    from ptdp.spec import resolve
    from ptdp.spec.files import apply_config_file
    from ptdp.spec.keywords import RaisingParser, keyword_actions, keywords_to_argv

    parser = RaisingParser(prog="ptdp.load_config", add_help=False)
    add_train_arguments(parser, local_launch=False)
    names = keyword_actions(parser, ("config", "print_config"))
    argv = (["--config", str(path)] if path is not None else []) + keywords_to_argv(flags, names,
                                                                                 caller="ptdp.load_config")
    apply_config_file(parser, argv)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    return resolve(config_from_args(args), world, cuda=cuda)


def train(config: Config, *, progress: bool = False) -> dict:
    """Train ``config`` in this process, one worker of a launched job: under ``torchrun`` (its
    ``RANK``/``WORLD_SIZE``/... environment) or alone as a world of one process.

    What ``python -m ptdp.train`` does after parsing its flags: the config is checked again for this
    world (:func:`ptdp.spec.resolve`; a config from :func:`load_config` passes), torch.distributed
    is initialised (NCCL on CUDA, gloo on CPU), local rank 0 of each node prepares the data (cached)
    while the others wait, global rank 0 creates the run directory, then every rank trains and the
    process group is destroyed.

    Returns:
        The run's summary (the same on every rank): iterations, losses, throughput, ``run_dir``...

    Raises:
        ConfigError, DataError: a bad request or data, before training starts.
        TrainingError: training had to stop (non-finite losses, ...).
        CollectiveError: a peer stopped responding or went away.
    """
    import torch
    import torch.distributed as dist

    from ptdp.run.distributed import env_world, init_distributed
    from ptdp.run.preflight import check_request
    from ptdp.run.worker import set_single_process_environment, train_in_process_group
    from ptdp.spec import resolve

    set_single_process_environment()
    _, _, world = env_world()
    config = resolve(config, world, cuda=torch.cuda.is_available())
    check_request(config, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    device = init_distributed(config.parallel.distributed_timeout_minutes, bind_cpus=config.parallel.bind_cpus)
    try:
        return train_in_process_group(config, device, progress=progress)
    finally:
        dist.destroy_process_group()
