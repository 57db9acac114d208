"""One training step and one evaluation at (tp, cp, pp, dp) = (1, 2, 1, 2) communicate exactly what
docs/architecture.md says ("Communication of one step", the context-parallelism bullet): on the
cp axis, per layer and microbatch, one all-gather of E = 2 b (kv/t) (s/C) d elements forward and an
all-gather of E plus a reduce-scatter of C E backward (``all_gather``), or C - 1 sends and receives
forward and 2C - 1 backward (``p2p``), times L layers and m microbatches, plus the forward's once
more per layer under full and under selective recompute; an evaluation counts the forward's only.
The gradients go over the dp x cp group (4 ranks), counted on the dp axis. Every variant runs in
one job of the world-4 pool, against counts written out here from the formula (not from the
code's own ``cp_attention_comm``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import LLAMA_OPTIONS, VOCAB, rank_microbatches
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import eval_loss, train_step
from ptdp.layout.grid import ParallelLayout

LAYOUT = (1, 2, 1, 2)  # tp, cp, pp, dp
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
VARIANTS = {  # name -> (comm type, model overrides, whether backward runs the attention forward again)
    "p2p": ("p2p", {}, False),
    "all_gather": ("all_gather", {}, False),
    "llama_p2p_full": ("p2p", LLAMA_OPTIONS | FULL, True),  # 2 key/value heads of 4
    "all_gather_selective": ("all_gather", {"recompute_granularity": "selective"}, True),
}


def _config(variant: str) -> Config:
    """3 layers, h 32, 4 heads, s 16, b 2, B 8 (m = 2 per dp rank), float64."""
    comm, overrides, _ = VARIANTS[variant]
    model = dataclasses.replace(
        ModelConfig(
            num_layers=3,
            hidden_size=32,
            num_attention_heads=4,
            ffn_hidden_size=64,
            seq_length=16,
            vocab_size=VOCAB,
            make_vocab_size_divisible_by=8,
            params_dtype="float64",
        ),
        **overrides,
    )
    tp, cp, pp, dp = LAYOUT
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        context_parallel_size=cp,
        cp_comm_type=comm,
    )
    train = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=1, lr=1e-3, min_lr=1e-4)
    return resolve(Config(model=model, parallel=parallel, train=train), tp * cp * pp * dp)


def comm_worker(rank: int, world: int) -> dict:
    tp, cp, pp, dp = LAYOUT
    groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT)
    out = {}
    for variant in VARIANTS:
        cfg = _config(variant)
        stage = build_stage(cfg, groups)
        mbs = rank_microbatches(0, cfg, groups.dp.rank, groups.dp.size)
        groups.stats.reset()
        train_step(stage, mbs, 0).loss  # noqa: B018 - reads the step's result (the host waits here)
        step = groups.stats.as_dict()
        groups.stats.reset()
        evaluated = rank_microbatches(1, cfg, groups.dp.rank, groups.dp.size)
        eval_loss(stage, [evaluated])
        out[variant] = {
            "step": step,
            "eval": groups.stats.as_dict(),
            "m": len(mbs),
            "eval_m": len(evaluated),
            "grad_numel": stage.grads.data.numel(),
        }
    return out


@functools.cache
def results() -> list[dict]:
    return run_in_pool(comm_worker, 4)


def _count(calls: int, numel: int, nbytes: int) -> dict:
    return {"calls": calls, "numel": numel, "bytes": nbytes}


def expected_cp(
    comm_type: str,
    *,
    b: int,
    kv: int,
    s: int,
    d: int,
    cp: int,
    e: int,
    g: int,
    layers: int,
    m: int,
    refwd: bool,
    forward_only: bool = False,
) -> dict:
    """The docs' formula: ``"cp/op/tag"`` -> calls, numel, bytes of one step (or one evaluation)."""
    E, C = 2 * b * kv * (s // cp) * d, cp
    fwd, bwd = "cp/{}/cp_attention_forward", "cp/{}/cp_attention_backward"
    if comm_type == "all_gather":
        one = {fwd.format("all_gather"): (1, E, E * e)}
        back = {bwd.format("all_gather"): (1, E, E * e), bwd.format("reduce_scatter"): (1, C * E, C * E * g)}
    else:
        one = {fwd.format(op): (C - 1, (C - 1) * E, (C - 1) * E * e) for op in ("send", "recv")}
        back = {bwd.format(op): (2 * C - 1, (2 * C - 1) * E, (C - 1) * E * e + C * E * g) for op in ("send", "recv")}
    times = layers * m
    out = {k: _count(*(x * times * (2 if refwd and not forward_only else 1) for x in v)) for k, v in one.items()}
    if not forward_only:
        out |= {k: _count(*(x * times for x in v)) for k, v in back.items()}
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cp_bytes_of_one_step_and_one_evaluation(variant):
    cfg = _config(variant)
    m, p = cfg.model, cfg.parallel
    kv = m.num_query_groups or m.num_attention_heads
    shape = dict(
        b=cfg.train.micro_batch_size,
        kv=kv,
        s=m.seq_length,
        d=m.hidden_size // m.num_attention_heads,
        cp=p.cp,
        e=8,
        g=8,
        layers=m.num_layers,
    )  # float64: activations and accumulation 8 bytes
    refwd = VARIANTS[variant][2]
    for rank, res in enumerate(results()):
        got = res[variant]
        assert got["m"] == 2
        cp_step = {k: v for k, v in got["step"].items() if k.startswith("cp/")}
        assert cp_step == expected_cp(p.cp_comm_type, **shape, m=got["m"], refwd=refwd), (rank, cp_step)
        cp_eval = {k: v for k, v in got["eval"].items() if k.startswith("cp/")}
        assert cp_eval == expected_cp(p.cp_comm_type, **shape, m=got["eval_m"], refwd=refwd, forward_only=True), (
            rank,
            cp_eval,
        )
        # the gradients: one all-reduce of the whole buffer over the 4 dp x cp ranks, on the dp axis
        grads = got["step"]["dp/all_reduce/grads"]
        assert grads["numel"] == got["grad_numel"] and grads["bytes"] == 8 * got["grad_numel"]
        assert not any(k.startswith(("tp/", "pp/", "embedding/")) for k in got["step"]), got["step"]
