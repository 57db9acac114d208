"""The pieces of the configuration schema: the flag a field carries and the choices.

The schema (:mod:`ptdp.config.model`, :mod:`ptdp.config.parallel`, :mod:`ptdp.config.schema`) is frozen
dataclasses with a docstring per field, choices as ``Literal`` types, and on each field its
command-line flag (:class:`Flag`); :mod:`ptdp.config.flags` and :mod:`ptdp.config.files` build the
flags and read config files from them. Sizes use "1 means disabled".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ptdp.layout.codecs import CODECS

DTYPES = ("float32", "float64", "bfloat16", "float16")
BIND_POLICIES = ("none", "numa", "exclusive")
ACTIVATIONS = ("gelu", "gelu_tanh")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "auto")
#: the schedules ``ptdp schedule`` shows but ``ptdp train`` does not run yet (B and W apart)
SCHEDULES_NOT_TRAINED = ("auto",)
#: schedules with separate input- and weight-gradient passes that ptdp train runs
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zb-h2", "zb-v", "dualpipev")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
CP_COMM_TYPES = ("p2p", "all_gather")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
GRAD_COMPRESSIONS = CODECS
MIN_VOCAB_SIZE = 258  # 256 byte symbols + end-of-document token + at least one merge


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()
"""No command-specific default: the field's own default applies."""


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line and in config files.

    Attributes:
        name: the long flag (Megatron-LM's name where it has one).
        aliases: short forms (``--tp``).
        help: one line for ``--help``.
        group: the argparse group (a key of :data:`GROUPS`).
        plan: ``ptdp plan`` has the flag too (there its default is None: searched, or the model
            preset's value).
        plan_searched: ``ptdp plan`` searches the setting when the flag is not given (False: it
            plans ``ptdp train``'s default).
        cli_default: the default of ``ptdp train`` when it differs from the field's (tp = pp = 2).
        none_choice: a choice that means None (``--recompute-granularity none``).
        negate: the flag sets the field to False (``--disable-bias-linear``).
        shortcuts: extra switches setting a value (``--bf16`` -> ``params_dtype=bfloat16``).
        local: only ``ptdp train`` (its local launcher) has it, not ``python -m ptdp.train``.
        train: ``ptdp train`` has it (False: a ``ptdp plan`` setting only, e.g. the attention kernel
            of a run on another stack).
    """

    name: str
    help: str
    group: str
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    plan: bool = False
    plan_searched: bool = True
    cli_default: Any = UNSET
    none_choice: str | None = None
    negate: bool = False
    shortcuts: tuple[tuple[str, Any, str], ...] = ()
    local: bool = False
    append: bool = False
    train: bool = True


GROUPS = {
    "layout": "parallel layout (world = tp x cp x pp x dp; TP innermost, then CP, PP outermost)",
    "dp": "data-parallel gradient reduction and optimizer",
    "checkpoint": "checkpoints",
    "model": "model",
    "moe": "mixture of experts (Megatron-Core's flags; docs/training.md)",
    "fp8": "FP8 training of the layers' GEMMs (Megatron-Core's flags; docs/training.md)",
    "recompute": "activation recomputation (same results, less activation memory, more compute)",
    "train": "training",
    "data": "data and output",
    "launch": "launch",
}


def opt(default: Any, name: str, help: str, group: str, **flag: Any) -> Any:
    """A dataclass field with ``default`` and its :class:`Flag` (the other arguments)."""
    meta = {"flag": Flag(name=name, help=help, group=group, **flag)}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
