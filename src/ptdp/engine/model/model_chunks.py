"""The model chunks of one pipeline rank under the interleaved schedule."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from ptdp.engine.model.gpt import GPTModel


class ModelChunks(nn.ModuleList):
    """The ``v`` GPT stages (chunks) one pipeline rank holds, in chunk order: chunk ``c`` of rank
    ``r`` is virtual stage ``c * pp + r`` (Narayanan et al. SC21, §2.2)."""

    def tied_embedding(self) -> nn.Parameter | None:
        """The word embedding whose gradient is summed over first and last stage, if this rank has it."""
        for chunk in self:
            param = cast("GPTModel", chunk).tied_embedding()
            if param is not None:
                return param
        return None


def global_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` with layout-independent names (``layers.5.mlp.fc1.weight``), whether
    ``model`` is one stage or the chunks of an interleaved rank."""
    if isinstance(model, ModelChunks):
        for chunk in model:
            yield from chunk.named_parameters()
    else:
        yield from model.named_parameters()
