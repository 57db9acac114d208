"""Live and peak bytes of the tensors autograd keeps for backward: the activation memory of a step.

Counted: every tensor saved for backward (``ctx.save_for_backward`` of autograd functions and the
built-in operators alike), seen through ``torch.autograd.graph.saved_tensors_hooks``. A tensor is
counted by its storage, once: views sharing one storage (the q, k and v of one QKV output, a
reshape saved by the next linear) are one allocation, held with a reference count. When the graph
drops its last reference to a saved storage (after that node's backward, or when the graph is
freed), the storage's bytes leave the live total. The peak of the live total is the activation
peak that the planner's memory model predicts (:func:`ptdp.planner.memory.activations.stage_activation_bytes`).

Not counted: storages in ``exclude`` (pass the parameters' storages: a weight saved by a linear
layer is model state, not an activation), and memory autograd does not save: gradients, the
outputs a pipeline stage sends, temporaries of a kernel, the allocator's caching. The bytes are
the storage's ``nbytes`` (a saved view pins its whole storage).

Use::

    meter = SavedActivationMeter(parameter_storages(model))
    with meter.hooks():
        loss = model(x, y)
        loss.backward()
    meter.peak  # bytes
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

    Attributes:
        live: bytes of saved storages alive now.
        peak: the largest ``live`` seen.
        packed: saved tensors counted (a storage saved twice counts twice here, once in bytes).

    Use as ``with meter.hooks(): ...``. ``exclude``: data pointers of storages never counted.
    Subclasses may override :meth:`on_pack`, called after every counted save.
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
