"""``ptdp.plan(...)``: the planner from Python, with the rules and defaults of ``ptdp plan``.

Keyword arguments are the flags of ``ptdp plan`` with ``_`` for ``-`` (``global_batch_size``,
``recompute_granularity``, ``use_flash_attn``, ...), or their short aliases (``tp``, ``pp``,
``dp``, ``cp``, ``mbs``, ``gbs``). They are turned into the command line and parsed by the same
parser, so types, choices and every rule are checked exactly as on the command line; a bad
request raises :class:`ptdp.spec.ConfigError` (a ``ValueError``) naming the numbers and the rule,
before any search. Booleans map to ``--flag`` / ``--no-flag``; sequences (``pipeline_layer_split``)
to comma lists. No torch is imported.

Example::

    import ptdp
    result = ptdp.plan("llama3-8b", gpus=64, gpu="h100-sxm", global_batch_size=512, seq_length=8192)
    best = result.best                      # a ptdp.planner.plan.Plan
    best.layout.tp, best.time.step, best.memory.total   # sizes, seconds per step, bytes per GPU
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from ptdp.planner.models import ModelSpec
from ptdp.planner.plan import Plan
from ptdp.planner.rules import Rejection
from ptdp.planner.hardware import Cluster
from ptdp.spec.keywords import RaisingParser, keyword_actions, keywords_to_argv

#: options that are not part of a search
_NOT_FOR_SEARCH = ("validate", "calibrate", "update_benchmarks", "nproc_per_node", "json", "plot")


@dataclass
class PlanResult:
    """What :func:`plan` found.

    Attributes:
        model, cluster: the model and cluster planned for (presets resolved, flags applied).
        plans: the fitting plans, fastest first (:class:`~ptdp.planner.plan.Plan`: ``layout``,
            ``memory`` in bytes per GPU, ``time`` in seconds per step, ``tflops_per_gpu``, ``mfu``).
        rejected: every layout that breaks a rule or does not fit, with the rule.
        notes: what the search left out and why, and what a Hugging Face config holds that the
            planner does not model.
        explanation: why the best plan beats the runner-up and, with fixed choices, how far it is
            from the best plan found without them (the lines ``ptdp plan`` prints).
    """

    model: ModelSpec
    cluster: Cluster
    plans: list[Plan]
    rejected: list[tuple[Plan, Rejection]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    explanation: list[str] = field(default_factory=list)

    @property
    def best(self) -> Plan | None:
        """The fastest fitting plan; None when no layout fits."""
        return self.plans[0] if self.plans else None

    def report(self, top: int = 10) -> str:
        """The table ``ptdp plan`` prints."""
        from ptdp.planner.report import text_report
        from ptdp.planner.search import SearchResult

        result = SearchResult(self.plans, self.rejected, self.notes)
        return text_report(self.model, self.cluster, result, top=top, explanation=self.explanation)

    def to_json(self, top: int = 10) -> list[dict]:
        """The records of ``ptdp plan --json``: the ``top`` fitting plans, then a few rejected ones."""
        from ptdp.planner.report import representatives
        from ptdp.planner.search import SearchResult

        result = SearchResult(self.plans, self.rejected, self.notes)
        return [p.to_json() for p in self.plans[:top] + representatives(result)]


def _parser() -> argparse.ArgumentParser:
    from ptdp.planner.args import add_plan_arguments

    parser = RaisingParser(prog="ptdp.plan", add_help=False)
    add_plan_arguments(parser)
    return parser


def plan(model: str | ModelSpec | None = None, **options: Any) -> PlanResult:
    """Search the layouts of ``model`` on a cluster, as ``ptdp plan`` does.

    Args:
        model: a preset name (``"llama3-405b"``, ``"gpt3-175b"``, ...), the path of a Hugging Face
            ``config.json`` (or its folder), a :class:`~ptdp.planner.models.ModelSpec`, or None to
            give the shape by keywords (``num_layers``, ``hidden_size``, ``num_attention_heads``, ...).
        **options: ``ptdp plan``'s flags by name (module docstring); ``gpus`` and
            ``global_batch_size`` are required.

    Returns:
        :class:`PlanResult`; ``result.plans`` is empty when no layout fits (``ptdp plan`` then exits 1).

    Raises:
        ConfigError: a bad request (the message ``ptdp plan`` prints before exiting with code 2).
        TypeError: an unknown keyword.
    """
    from ptdp.commands.plan import prepare

    parser = _parser()
    names = keyword_actions(parser, _NOT_FOR_SEARCH)
    argv = keywords_to_argv({**({"model": model} if isinstance(model, str) else {}), **options}, names,
                            caller="ptdp.plan")
    args = parser.parse_args(argv)
    request = prepare(args, model=model if isinstance(model, ModelSpec) else None)
    result = request.search()
    return PlanResult(request.model, request.cluster, result.plans, result.rejected,
                      [*request.notes, *result.notes], request.explanation(result))
