"""The model chunks of one pipeline rank under the interleaved schedule."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from ptdp.engine.model.gpt import GPTModel


class ModelChunks(nn.ModuleList):
    """The ``v`` GPT stages (chunks) one pipeline rank holds, in chunk order: chunk ``c`` of rank
    ``r`` is virtual stage ``c * pp + r`` (Narayanan et al. SC21, §2.2), or on the V placement
    stage ``r`` and ``2 pp - 1 - r`` (:mod:`ptdp.layout.pipeline.placement`)."""

    def tied_embedding(self) -> nn.Parameter | None:
        """The word embedding whose gradient is summed over first and last stage, if this rank has
        it; None where the rank runs both (one parameter, shared by its chunks)."""
        chunks = [cast("GPTModel", chunk) for chunk in self]
        if any(c.pre_process for c in chunks) and any(c.post_process for c in chunks):
            return None
        for chunk in self:
            param = cast("GPTModel", chunk).tied_embedding()
            if param is not None:
                return param
        return None


def global_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` with layout-independent names (``layers.5.mlp.fc1.weight``), whether
    ``model`` is one stage or the chunks of an interleaved rank; a parameter two chunks share (a
    tied embedding on one rank) once."""
    if isinstance(model, ModelChunks):
        seen: set[int] = set()
        for chunk in model:
            for name, param in chunk.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param
    else:
        yield from model.named_parameters()
