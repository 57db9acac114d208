"""ptdp: GPT and Llama training with tensor, context, pipeline and data parallelism on
torch.distributed, and a planner that picks the layout.

The Python API (``docs/api.md``); names are imported on first use, so ``import ptdp`` is light and
the planner never imports torch:

* :func:`plan` (:func:`ptdp.api.plan`): search the layouts of a model on a cluster, as
  ``ptdp plan`` does; returns a :class:`PlanResult` of typed :class:`~ptdp.planner.plan.Plan`.
* :class:`Config` (:class:`ptdp.spec.Config`) and :func:`load_config` (:func:`ptdp.api.load_config`):
  a run's configuration from a file and keywords, checked by the command line's rules.
* :func:`train` (:func:`ptdp.api.train`): train a config in a launched worker (torchrun, or alone).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports each name on first use
    from ptdp.api import PlanResult, load_config, plan, train
    from ptdp.spec import Config, ConfigError

__version__ = "0.2.0"

_WHERE = {
    "plan": ("ptdp.api", "plan"),
    "PlanResult": ("ptdp.api", "PlanResult"),
    "Config": ("ptdp.spec", "Config"),
    "ConfigError": ("ptdp.spec", "ConfigError"),
    "load_config": ("ptdp.api", "load_config"),
}

__all__ = ["Config", "ConfigError", "PlanResult", "load_config", "plan", "train", "__version__"]


def __getattr__(name: str):
    if name == "train":  # the callable worker module (ptdp/train.py), also run by `-m ptdp.train`
        return importlib.import_module("ptdp.train")
    if name not in _WHERE:
        raise AttributeError(f"module 'ptdp' has no attribute {name!r}")
    module, attr = _WHERE[name]
    return getattr(importlib.import_module(module), attr)
