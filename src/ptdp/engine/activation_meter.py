"""Live and peak bytes of the tensors autograd keeps for backward: the activation memory of a step.

Every tensor saved for backward is seen through ``torch.autograd.graph.saved_tensors_hooks`` and
counted by its storage's ``nbytes``, once per storage (views share one), until the graph drops its
last reference. The peak is what :func:`ptdp.planner.memory.activations.stage_activation_bytes`
predicts. Not counted: storages in ``exclude`` (the parameters') and memory autograd does not save.
Use: ``meter = SavedActivationMeter(parameter_storages(model))``, run forward and backward inside
``with meter.hooks():``, then read ``meter.peak`` (bytes).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn


class _Packed:
    """What autograd keeps instead of the saved tensor; its death means the graph released it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def parameter_storages(modules: nn.Module | Iterable[nn.Module]) -> set[int]:
    """Data pointers of the storages of every parameter of ``modules`` (to exclude from the count)."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    return {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}


class SavedActivationMeter:
    """Live and peak bytes of the storages autograd holds for backward (each storage once).

    ``live``: bytes saved now; ``peak``: the largest ``live``; ``packed``: saved tensors counted.
    ``exclude``: data pointers of storages never counted. Use as ``with meter.hooks(): ...``;
    subclasses may override :meth:`on_pack`, called after every counted save.
    """

    def __init__(self, exclude: Iterable[int] = ()) -> None:
        self.exclude = set(exclude)
        self.live = self.peak = 0
        self.packed = 0
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context manager: tensors saved for backward inside it are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def holds(self, key: int) -> bool:
        """Whether the storage with data pointer ``key`` is saved for backward now."""
        return key in self._refs

    def on_pack(self) -> None:
        """Called after each counted save (``live`` and ``peak`` already updated)."""

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude:
            return tensor
        self.packed += 1
        if self._refs.get(key, 0) == 0:
            self._sizes[key] = storage.nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        box = _Packed(tensor)
        weakref.finalize(box, self._release, key)
        self.on_pack()
        return box

    @staticmethod
    def _unpack(box):
        return box.tensor if isinstance(box, _Packed) else box

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)
