"""Property, trained: a fixed sample of the requests the validator accepts trains one step on gloo
workers with the loss of the single-process model (the property itself, without processes:
tests/unit/test_config_property.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.errors import ConfigError
from ptdp.layout.grid import ParallelLayout


def sample_requests(count: int, world: int, seed: int = 20240601) -> list[Config]:
    """The first ``count`` (at most 3) requests for ``world`` workers that the validator accepts,
    one per pipeline schedule, drawn from a fixed seed, with tiny shapes so that one step takes
    milliseconds."""
    rng, found, schedules = random.Random(seed), [], set()
    while len(found) < count:
        heads = rng.choice([2, 4, 8])
        tp = rng.choice([d for d in (1, 2, 4, 8) if world % d == 0])
        pp = rng.choice([d for d in (1, 2, 4, 8) if (world // tp) % d == 0])
        per_chunk = rng.choice([None, None, 1, 2])
        model = ModelConfig(
            num_layers=rng.randint(1, 8),
            hidden_size=heads * rng.choice([4, 8]),
            num_attention_heads=heads,
            ffn_hidden_size=rng.choice([None, 8 * tp, 24 * tp]),
            seq_length=rng.choice([4, 8]),
            vocab_size=rng.randint(258, 400),
            num_query_groups=rng.choice([None, tp]),
            untie_embeddings_and_output_weights=rng.random() < 0.5,
            params_dtype="float64",
        )
        parallel = ParallelConfig(
            tp,
            pp,
            world // (tp * pp),
            num_layers_per_virtual_pipeline_stage=per_chunk,
            pipeline_schedule=rng.choice([None, "gpipe"]) if per_chunk is None else None,
        )
        train = TrainConfig(
            micro_batch_size=rng.choice([1, 2]),
            global_batch_size=rng.choice([4, 8, 16]),
            train_iters=1,
            lr_warmup_iters=0,
        )
        try:
            config = resolve(Config(model=model, parallel=parallel, train=train), world)
        except ConfigError:
            continue
        if config.parallel.schedule not in schedules:  # one of each schedule
            schedules.add(config.parallel.schedule)
            found.append(config)
    return found


def _batch(config: Config, dp_rank: int, dp: int):
    """This dp rank's microbatches of one global batch of random tokens (the same for any layout)."""
    t, s = config.train, config.model.seq_length
    tokens = torch.randint(
        0, config.model.vocab_size, (t.global_batch_size, s + 1), generator=torch.Generator().manual_seed(7)
    )
    per_rank = t.global_batch_size // dp
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    b = t.micro_batch_size
    return [(mine[i : i + b, :-1], mine[i : i + b, 1:]) for i in range(0, per_rank, b)]


def one_step_worker(rank: int, world: int, configs: list[Config]) -> list[float]:
    losses = []
    for config in configs:
        p = config.parallel
        groups = ParallelGroups.build(ParallelLayout(tp=p.tp, pp=p.pp, dp=p.dp), PG_TIMEOUT)
        stage = build_stage(config, groups)
        losses.append(train_step(stage, _batch(config, groups.dp.rank, groups.dp.size), 0).loss)
    return losses


def test_a_sample_of_accepted_requests_trains_one_step():
    """Three accepted requests for 4 workers (one per schedule) train one step (one spawn); each
    loss equals the single-process model's on the same batch (float64, 1e-9)."""
    import dataclasses

    configs = sample_requests(3, world=4)
    print(
        "sampled layouts:",
        [
            (
                c.parallel.tp,
                c.parallel.pp,
                c.parallel.dp,
                c.parallel.schedule,
                c.model.num_layers,
                c.model.num_query_groups,
            )
            for c in configs
        ],
    )
    per_rank = run_in_pool(one_step_worker, 4, configs)
    for i, config in enumerate(configs):
        single = resolve(dataclasses.replace(config, parallel=ParallelConfig(1, 1, 1)), 1)
        reference = train_step(build_stage(single, ParallelGroups.single_process()), _batch(single, 0, 1), 0).loss
        for losses in per_rank:
            assert math.isfinite(losses[i]) and losses[i] == pytest.approx(reference, rel=1e-9), (
                config.parallel,
                losses[i],
                reference,
            )
