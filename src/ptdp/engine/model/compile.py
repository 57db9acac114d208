"""``--compile``: the stage compiled by ``torch.compile`` (inductor).

At tp = 1 (no collective inside the stage's forward) and without ``--overlap-param-gather`` (whose
module hooks wait for all-gathers) the embedding, the layers and the final norm are one compiled
graph (:func:`compile_stage`: ``GPTModel.hidden_states``), so inductor fuses across the layer
boundaries. Otherwise the layers are compiled, each on its own (they share one compiled graph when their shapes
agree: parameters are graph inputs), and, inside the chunked output layer + loss
(:mod:`~ptdp.engine.tensor_parallel.linear_cross_entropy`, ``compiled=True``), each chunk's
statistics and gradient; not the embedding or the pipeline runtime. Module hooks (the parameter all-gather waits of ``--overlap-param-gather``) stay
outside: the layer's ``forward`` is compiled, not its ``__call__``. Full recompute runs the
compiled layers inside its checkpoints; selective recompute's checkpoint of the attention core
is traced by dynamo inside the compiled layer.

Communication: the tensor-parallel functions that call :mod:`ptdp.engine.comm` (f, g, the
sequence-parallel gathers and scatters, the column-parallel linear with its overlapped
backward) are ``torch.compiler.disable``-d (:mod:`ptdp.engine.eager`, done here
before compiling), so each compiled layer is split into regions between
them and every collective still runs eagerly, counted per (axis, op, tag) exactly as without
``--compile``. At tp = 1 they are not called and a layer is one graph.
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
