"""``--compile``: the stage compiled by ``torch.compile`` (inductor).

At tp = 1 without ``--overlap-param-gather`` the embedding, the layers and the final norm are one
compiled graph (:func:`compile_stage`: ``GPTModel.hidden_states``). Otherwise each layer's
``forward`` is compiled on its own (module hooks stay outside), and each chunk of the output layer
+ loss (:mod:`~ptdp.engine.tensor_parallel.linear_cross_entropy`, ``compiled=True``); not the
embedding or the pipeline runtime. The functions that communicate are ``torch.compiler.disable``-d
(:mod:`ptdp.engine.eager`), so compiled layers are split around them and every collective runs
eagerly, counted per (axis, op, tag) as without ``--compile``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ptdp.engine.eager import prepare_for_compile

if TYPE_CHECKING:
    from ptdp.engine.model.gpt import GPTModel


def compile_layers(model: GPTModel, *, backend: str = "inductor") -> int:
    """Replace the ``forward`` of every transformer layer of ``model`` (a
    :class:`~ptdp.engine.model.gpt.GPTModel` stage: its ``layers``) by its compiled version;
    parameter names and the state dict do not change. Returns the number of layers compiled.
    Compilation itself happens at the first forward of each shape."""
    prepare_for_compile()
    layers = list(model.layers.values())
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False)
    return len(layers)


def compile_stage(model: GPTModel, *, whole: bool = True, backend: str = "inductor") -> bool:
    """Where the stage calls no collective in its forward (tp = 1: the embedding, layers and final
    norm of a :class:`~ptdp.engine.model.gpt.GPTModel` stage are single-device code) and ``whole``
    (no module hooks will wait inside it: not with ``--overlap-param-gather``), compile them as one
    graph (``hidden_states``), so inductor fuses across layer boundaries as it does for a whole
    model; otherwise compile each layer (:func:`compile_layers`). Returns True for the one graph."""
    if whole and model.tp.size == 1:
        prepare_for_compile()
        # the instance's compiled method shadows the class's (mypy does not model assigning to a method)
        model.hidden_states = torch.compile(  # type: ignore[method-assign]
            model.hidden_states, backend=backend, dynamic=False
        )
        return True
    compile_layers(model, backend=backend)
    return False
