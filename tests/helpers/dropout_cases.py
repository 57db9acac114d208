"""The dropout tests' tiny model, training loop with recorded masks, and bitwise comparison."""

from __future__ import annotations

import torch

from helpers.layout_cases import STEPS, rank_microbatches, tiny_config
from ptdp.config.schema import Config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step

P = 0.2
DROPOUT = {"hidden_dropout": P, "attention_dropout": P}
LLAMA = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "num_query_groups": 2,
    "add_bias_linear": False,
}
RECOMPUTE = {
    "full_uniform_1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full_uniform_2": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full_block_1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},
}


def config(tp: int, pp: int, dp: int, *, parallel: dict | None = None, **model) -> Config:
    return tiny_config(tp, pp, dp, "float64", parallel_overrides=parallel, **(DROPOUT | model))


def train(cfg: Config, groups: ParallelGroups, *, steps=range(STEPS), stage=None, record=False) -> dict:
    """Train ``steps`` (iteration numbers) on the layout_cases data; losses, norms, parameters,
    and the recorded masks ``(stream name, mask)`` in draw order when ``record``."""
    stage = stage if stage is not None else build_stage(cfg, groups)
    if record:
        stage.dropout_rng.recording = []
    losses, norms = [], []
    for step in steps:
        result = train_step(stage, rank_microbatches(step, cfg, groups.dp.rank, groups.dp.size), step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    stage.wait_for_params()
    c = groups.coords
    return {
        "losses": losses,
        "norms": norms,
        "coords": (c.tp_rank, c.dp_rank, c.pp_rank),
        "params": {
            name: (p.detach().clone(), p.ptdp_global, False) for name, p in global_named_parameters(stage.model)
        },
        "masks": stage.dropout_rng.recording,
        "stage": stage,
    }


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == want["losses"] and got["norms"] == want["norms"], what
    for name, (tensor, _, _) in want["params"].items():
        assert torch.equal(got["params"][name][0], tensor), f"{what}: {name}"
