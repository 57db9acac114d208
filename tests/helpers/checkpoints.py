"""Reading a checkpoint folder's tensors in one process."""

from __future__ import annotations

import torch


def stored_tensors(folder) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint folder, read in one process."""
    import warnings

    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(folder).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith(("model/", "optim/"))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return sd
