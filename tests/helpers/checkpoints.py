"""Reading a checkpoint folder's tensors in one process; training a few steps and recording them
(the resume tests)."""

from __future__ import annotations

import torch


def stored_tensors(folder) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint folder, read in one process."""
    import warnings

    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(folder).read_metadata()
    sd = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if k.startswith(("model/", "optim/"))
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return sd


def train_steps(stage, cfg, groups, first: int, last: int) -> list:
    """Steps ``first`` .. ``last - 1`` of the tiny model's data; their results."""
    from helpers.layout_cases import rank_microbatches
    from ptdp.engine.step import train_step

    return [train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i) for i in range(first, last)]


def record_run(stage, results) -> dict:
    """Losses, gradient norms and the global parameters after ``results``."""
    from ptdp.engine.model.model_chunks import global_named_parameters

    stage.wait_for_params()
    return {
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "params": {n: p.detach().clone() for n, p in global_named_parameters(stage.model)},
    }
