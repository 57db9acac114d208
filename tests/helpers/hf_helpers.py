"""Shared by the Hugging Face conversion tests: logits of an imported checkpoint at tp=2 pp=2."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.dist_helpers import PG_TIMEOUT
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.layout.grid import ParallelLayout
from ptdp.run.checkpoint.hf import configs_from_hf
from ptdp.run.checkpoint.io import load_checkpoint


def tp2_pp2_logits_worker(
    rank: int, world: int, ckpt: str, hf_config: dict, tokens: torch.Tensor, vocab: int
) -> torch.Tensor | None:
    """Load ``ckpt`` at tp=2 pp=2 dp=1 (4 workers) and return the last stage's logits ``[b, s, vocab]``
    for ``tokens`` (stage 0 returns None). Stage 0's output goes to stage 1 over the pipeline group;
    the vocab-parallel logits are all-gathered over tp and cut to the real rows."""
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=2, dp=1), PG_TIMEOUT)
    b, s = tokens.shape
    model, moe = configs_from_hf(hf_config)
    cfg = resolve(
        Config(
            model=model,
            moe=moe,
            parallel=ParallelConfig(2, 2),
            train=TrainConfig(micro_batch_size=b, global_batch_size=b),
        ),
        4,
    )
    stage = build_stage(cfg, groups)
    load_checkpoint(stage, ckpt)
    model = stage.model
    with torch.no_grad():
        h = model(tokens).contiguous() if groups.is_first_stage else torch.empty(s, b, cfg.model.hidden_size)
        dist.broadcast(h, src=rank % 2, group=groups.pp.group)
        if groups.is_first_stage:
            return None
        for layer in model.layers.values():
            h = layer(h)
        out = model.output_layer if hasattr(model, "output_layer") else model.word_embeddings
        local = F.linear(model.final_norm(h), out.weight)  # padded rows: cut below
        parts = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(parts, local, group=groups.tp.group)
        return torch.cat(parts, dim=-1)[..., :vocab].transpose(0, 1)  # [s, b, V] -> [b, s, V]
