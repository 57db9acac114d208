"""The host random number generators of a rank in a checkpoint, as JSON: Python's, torch's CPU
generator, NumPy's legacy state, and the dropout streams' (:class:`ptdp.engine.tensor_parallel.random.DropoutRNG`).
Written per rank by :func:`ptdp.run.checkpoint.io.start_save`, restored by
:func:`ptdp.run.checkpoint.io.load_checkpoint`."""

from __future__ import annotations

import random
from typing import cast

import numpy as np
import torch


def host_rng_state(stage) -> dict:
    """This rank's generator states (JSON-able lists); ``stage.dropout_rng``'s too when it has one."""
    np_state = cast(tuple, np.random.get_state(legacy=True))  # legacy=True: the tuple, never the dict
    state = {
        "python": _to_json(random.getstate()),
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    if stage.dropout_rng is not None:
        state["dropout"] = stage.dropout_rng.state_dict()
    return state


def _to_json(obj):
    return [_to_json(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _to_tuple(obj):
    return tuple(_to_tuple(x) for x in obj) if isinstance(obj, list) else obj


def set_host_rng_state(state: dict) -> None:
    """Restore Python's, torch's CPU and NumPy's generators from :func:`host_rng_state`'s record (the
    dropout streams are restored by the caller, with the model)."""
    random.setstate(_to_tuple(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
