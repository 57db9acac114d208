"""ptdp's Python API (``docs/api.md``): the planner (:func:`plan`), a validated
:class:`~ptdp.config.Config` from a file and keywords (:func:`load_config`), and training in a
launched worker (:func:`train`). :func:`plan` and :func:`load_config` import no torch.

Each takes the command line's flags by name (:mod:`ptdp.config.keywords`: ``global_batch_size``,
or an alias such as ``tp``, ``mbs``), checked like the flags; a bad request raises
:class:`ptdp.errors.ConfigError` (a ``ValueError``) naming the numbers and the rule. Example::

    import ptdp
    result = ptdp.plan("llama3-8b", gpus=64, gpu="h100-sxm", global_batch_size=512, seq_length=8192)
    best = result.best                      # a ptdp.planner.candidate.Plan
    best.layout.tp, best.time.step, best.memory.total   # sizes, seconds per step, bytes per GPU
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptdp.config.keywords import RaisingParser, keyword_namespace
from ptdp.config.model import ModelConfig
from ptdp.config.schema import Config
from ptdp.errors import Violation
from ptdp.planner.candidate import Plan
from ptdp.planner.inputs.hardware import Cluster

#: options that are not part of a search
_NOT_FOR_SEARCH = ("validate", "calibrate", "update_benchmarks", "nproc_per_node", "json", "plot")


@dataclass
class PlanResult:
    """What :func:`plan` found.

    Attributes:
        model, cluster: the model and cluster planned for (presets resolved, flags applied).
        plans: the fitting plans, fastest first (:class:`~ptdp.planner.candidate.Plan`: ``layout``,
            ``memory`` in bytes per GPU, ``time`` in seconds per step, ``tflops_per_gpu``, ``mfu``),
            a :class:`~ptdp.planner.search.ranking.RankedPlans` sequence.
        rejected: every layout that breaks a rule or does not fit, with the rule.
        notes, explanation: what the search left out and why; why the best plan wins (as ``ptdp plan`` prints).
    """

    model: ModelConfig
    cluster: Cluster
    plans: Sequence[Plan]
    rejected: list[tuple[Plan, Violation]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    explanation: list[str] = field(default_factory=list)
    name: str = "custom"
    """The model's name in the report (a preset's, ``hf:FOLDER``, or ``custom``)."""

    @property
    def best(self) -> Plan | None:
        """The fastest fitting plan; None when no layout fits."""
        return self.plans[0] if self.plans else None

    def report(self, top: int = 10) -> str:
        """The table ``ptdp plan`` prints."""
        from ptdp.planner.report.render import text_report
        from ptdp.planner.search.layouts import SearchResult

        result = SearchResult(self.plans, self.rejected, self.notes)
        return text_report(self.name, self.model, self.cluster, result, top=top, explanation=self.explanation)

    def to_json(self, top: int = 10) -> list[dict]:
        """The records of ``ptdp plan --json``: the ``top`` fitting plans, then a few rejected ones."""
        from ptdp.planner.report.render import json_records
        from ptdp.planner.search.layouts import SearchResult

        return json_records(SearchResult(self.plans, self.rejected, self.notes), top=top)


def plan(model: str | os.PathLike[str] | ModelConfig | None = None, **options: Any) -> PlanResult:
    """Search the layouts of ``model`` on a cluster, as ``ptdp plan`` does.

    Args:
        model: a preset name (``"llama3-405b"``, ...), a Hugging Face ``config.json`` path (or its
            folder), a :class:`~ptdp.config.model.ModelConfig`, or None with the shape as keywords.
        **options: ``ptdp plan``'s flags by name; ``gpus`` is required, ``global_batch_size`` too
            except for a preset.

    Returns :class:`PlanResult`; ``result.plans`` is empty when no layout fits (``ptdp plan`` exits 1).

    Raises:
        ConfigError: a bad request (what ``ptdp plan`` prints before exiting with code 2).
        TypeError: an unknown keyword, two names of one option, or a ``model`` of another type.
    """
    from ptdp.planner.inputs.plan_flags import add_plan_arguments
    from ptdp.planner.request import prepare

    model = _model_argument(model)

    parser = RaisingParser(prog="ptdp.plan", add_help=False)
    add_plan_arguments(parser)
    named = {"model": model} if isinstance(model, str) else {}
    values = keyword_namespace(parser, {**named, **options}, skip=_NOT_FOR_SEARCH, caller="ptdp.plan")
    request = prepare(values, model=model if isinstance(model, ModelConfig) else None)
    result = request.search()
    return PlanResult(
        request.model,
        request.cluster,
        result.plans,
        result.rejected,
        [*request.notes, *result.notes],
        request.explanation(result),
        request.name,
    )


def _model_argument(model: object) -> str | ModelConfig | None:
    """:func:`plan`'s ``model``, a path as text. TypeError for any other type."""
    if isinstance(model, os.PathLike):
        return os.fspath(model)
    if model is None or isinstance(model, (str, ModelConfig)):
        return model
    raise TypeError(f"ptdp.plan() model: a preset name, a config.json path or a ModelConfig, not {model!r}")


def load_config(
    path: str | Path | None = None, *, world_size: int | None = None, cuda: bool = False, **flags: Any
) -> Config:
    """The resolved, checked configuration of a training run.

    Args:
        path: a TOML, YAML or JSON settings file (as ``--config FILE``; a run's ``config.json``
            replays it), or None.
        world_size: processes of the run (tp x cp x pp x dp); default ``WORLD_SIZE``, else 1.
        cuda: whether the workers train on CUDA GPUs (``params_dtype auto`` is then bfloat16).
        **flags: training flags by name, overriding the file (``tp=2``, ``data=["corpus.txt"]``...).

    Returns the :class:`~ptdp.config.Config` with ``dp`` filled in and ``params_dtype`` concrete.

    Raises:
        ConfigError (a ValueError): a bad file or setting, naming the values and the rule.
        TypeError: an unknown keyword.
    """
    from ptdp.config.files import file_defaults
    from ptdp.config.flags import config_from_args, settings
    from ptdp.config.resolve import resolve
    from ptdp.config.train_flags import add_train_arguments

    parser = RaisingParser(prog="ptdp.load_config", add_help=False)
    add_train_arguments(parser, local_launch=False)
    if path is not None:
        dests = {action.dest for action in parser._actions}
        parser.set_defaults(**file_defaults(path, [s for s in settings() if s.dest in dests]))
    args = keyword_namespace(parser, flags, skip=("config", "print_config"), caller="ptdp.load_config")
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    return resolve(config_from_args(args), world, cuda=cuda)


def train(config: Config, *, progress: bool = False) -> dict:
    """Train ``config`` in this process, one worker of a launched job (under ``torchrun``, or alone as a
    world of one), as ``python -m ptdp.train`` does: re-check the config for this world, initialise
    torch.distributed (NCCL on CUDA, gloo on CPU), prepare data on local rank 0, create the run
    directory on global rank 0, train, destroy the process group.

    Returns the run's summary (the same on every rank): iterations, losses, throughput, ``run_dir``...

    Raises:
        ConfigError, DataError: a bad request or data, before training starts.
        TrainingError: training had to stop (non-finite losses, ...).
        CollectiveError: a peer stopped responding or went away.
    """
    import torch
    import torch.distributed as dist

    from ptdp.config.resolve import resolve
    from ptdp.run.distributed import env_world, init_distributed
    from ptdp.run.preflight import check_request
    from ptdp.run.worker import set_single_process_environment, train_in_process_group

    set_single_process_environment()
    _, _, world = env_world()
    config = resolve(config, world, cuda=torch.cuda.is_available())
    check_request(config, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    device = init_distributed(config.parallel.distributed_timeout_minutes, bind_cpus=config.parallel.bind_cpus)
    try:
        return train_in_process_group(config, device, progress=progress)
    finally:
        dist.destroy_process_group()
