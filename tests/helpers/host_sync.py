"""Counting host synchronisations on the CPU: a shim over the ``torch.Tensor`` methods that, on a
GPU, make the host wait for the device (reading a value: ``item``, ``tolist``, ``__bool__``,
``__float__``, ``__int__``, ``__index__``, ``cpu``, ``numpy``; a blocking copy between devices:
``to``/``copy_`` across devices without ``non_blocking=True``). On the CPU nothing waits, so the
shim counts the calls that would. On CUDA, ``torch.cuda.set_sync_debug_mode`` sees the real ones.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@dataclass
class SyncCount:
    calls: list[str] = field(default_factory=list)
    """One entry per counted call: the method and the innermost ptdp frame that made it."""

    @property
    def count(self) -> int:
        return len(self.calls)


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/ptdp/" in frame.filename or "/tests/" in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"
    return "?"


def _device_of(arg) -> torch.device | None:
    if isinstance(arg, torch.Tensor):
        return arg.device
    if isinstance(arg, (torch.device, str)):
        try:
            return torch.device(arg)
        except RuntimeError:
            return None
    return None


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    """Count, while the context is open, every call that would synchronise the host with a device."""
    counter, originals, busy = SyncCount(), {}, [False]

    def wrap(name, method, blocking_copy=None):
        def counted(self, *args, **kwargs):
            if not busy[0] and (blocking_copy is None or blocking_copy(self, args, kwargs)):
                counter.calls.append(f"{name} at {_caller()}")
            busy[0], was = True, busy[0]
            try:
                return method(self, *args, **kwargs)
            finally:
                busy[0] = was

        return counted

    def crosses(self, args, kwargs) -> bool:  # Tensor.to(...) / copy_(src) between devices, blocking
        if kwargs.get("non_blocking") or any(a is True for a in args[1:]):
            return False
        targets = [d for d in map(_device_of, [*args, kwargs.get("device")]) if d is not None]
        return any(d.type != self.device.type for d in targets)

    for name in READS:
        originals[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, wrap(name, originals[name]))
    for name in ("to", "copy_"):
        originals[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, wrap(name, originals[name], crosses))
    try:
        yield counter
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


@contextlib.contextmanager
def count_cuda_syncs() -> Iterator[SyncCount]:
    """Count, while the context is open, the operations CUDA reports as synchronising
    (``torch.cuda.set_sync_debug_mode("warn")``: one warning each)."""
    counter = SyncCount()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode("default")
            counter.calls.extend(str(w.message)[:200] for w in caught if "synchroniz" in str(w.message).lower())


@contextlib.contextmanager
def label_check_on_device() -> Iterator[None]:
    """Make the cross entropy's label check take its GPU path (``torch._assert_async``, queued on
    the device, no host read) on the CPU too, where it otherwise raises at once after reading
    ``bad.any()``: the shim then counts what a GPU step would synchronise."""

    def check(target, vocab_size, ignore_index=-100):
        bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
        torch._assert_async(~bad.any(), f"a label is outside [0, {vocab_size})")

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("ptdp.") and hasattr(m, "check_labels")]
    originals = [m.check_labels for m in modules]
    for module in modules:
        module.check_labels = check
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.check_labels = original
