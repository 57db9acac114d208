"""ptdp: GPT and Llama training with tensor, context, pipeline and data parallelism on
torch.distributed, and a planner that picks the layout.

The Python API (``docs/api.md``), importing no torch until a run starts:

* :func:`plan`: search the layouts of a model on a cluster, as ``ptdp plan`` does; returns a
  :class:`PlanResult` of typed :class:`~ptdp.planner.candidate.Plan`.
* :class:`Config` and :func:`load_config`: a run's configuration from a file and keywords,
  checked by the command line's rules; bad input raises :class:`ConfigError`.
* :func:`train`: train a config in a launched worker (torchrun, or alone). ``ptdp.train`` is also
  the worker module of ``torchrun -m ptdp.train``; imported, that module is callable the same way.
"""

from ptdp.api import PlanResult, load_config, plan, train
from ptdp.config.schema import Config
from ptdp.errors import ConfigError


def __getattr__(name: str) -> str:
    """``__version__``, pyproject.toml's, read from the installed metadata when first asked for."""
    if name == "__version__":
        from importlib.metadata import version

        return version("ptdp")
    raise AttributeError(f"module 'ptdp' has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "PlanResult", "load_config", "plan", "train", "__version__"]
