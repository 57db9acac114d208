"""Functions that always run eagerly, outside ``torch.compile`` graphs, with ``torch._dynamo``
imported only when something is compiled.

``torch.compiler.disable(fn)`` imports ``torch._dynamo`` when applied, so :func:`outside_compile`
applies it at the first call, and :func:`prepare_for_compile` (called by
:mod:`ptdp.engine.model.compile`) to every such function before compiling: a compiled layer is
split around them, and their collectives run eagerly, counted by :mod:`ptdp.engine.comm`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_PENDING: list[tuple[Callable, dict]] = []


def outside_compile(fn: F) -> F:
    """``fn`` as ``torch.compiler.disable(fn)`` would make it, the disabling done on first use
    (or by :func:`prepare_for_compile`)."""
    state: dict = {"disabled": None}
    _PENDING.append((fn, state))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        disabled = state["disabled"]
        if disabled is None:
            disabled = state["disabled"] = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call  # type: ignore[return-value]  # it calls fn with fn's arguments: fn's type (F)


def prepare_for_compile() -> None:
    """Disable every :func:`outside_compile` function now (imports ``torch._dynamo``); call before
    ``torch.compile`` traces code that reaches them."""
    for fn, state in _PENDING:
        if state["disabled"] is None:
            state["disabled"] = torch.compiler.disable(fn)
