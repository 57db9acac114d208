"""Checkpoints under context parallelism (gloo, one job of the world-4 pool): saved at
(tp, cp, pp, dp) = (1, 2, 1, 2) after 2 steps with the distributed optimizer sharded over the 4
dp x cp ranks, the checkpoint loads at cp 1 with other tp, pp and dp, at cp 4, and in one process:
parameters and Adam's moments bitwise, the evaluation loss and the next step's loss and gradient
norm within 1e-9; saved again at (2, 1, 2, 1) it loads back at cp 2. cp changes nothing stored: the
checkpoint holds each tensor once (its files are as large as those of a cp 1 save)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import VOCAB, rank_microbatches
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage
from ptdp.engine.step import eval_loss, train_step
from ptdp.engine.tensor_parallel.sharding import global_param, unshard
from ptdp.layout.grid import ParallelLayout
from ptdp.run.checkpoint.io import load_checkpoint, save_checkpoint
from ptdp.run.checkpoint.optim_state import gather_local_state

SAVE = ((1, 2, 1, 2), {"use_distributed_optimizer": True, "ddp_bucket_size": 777})  # (tp, cp, pp, dp), parallel
LOADS = [  # each loads the cp 2 checkpoint, checks it, and runs step 3
    ((2, 1, 2, 1), {}),
    ((1, 1, 1, 4), {"use_distributed_optimizer": True, "ddp_bucket_size": 1001}),
    ((1, 4, 1, 1), {"use_distributed_optimizer": True, "cp_comm_type": "all_gather"}),
    ((2, 2, 1, 1), {"sequence_parallel": True}),
]
RESAVE = LOADS[0]  # saves what it loaded again, which (1, 2, 1, 2) loads back
STEPS = 2


def _config(layout: tuple, parallel: dict) -> Config:
    """2 layers, h 32, 4 heads, s 16, b 2, B 8, float64, clipping active."""
    tp, cp, pp, dp = layout
    model = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=16,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=8,
        params_dtype="float64",
    )
    train = TrainConfig(
        micro_batch_size=2,
        global_batch_size=8,
        train_iters=4,
        lr=3e-3,
        min_lr=3e-4,
        lr_warmup_iters=1,
        clip_grad=0.05,
        weight_decay=0.1,
    )
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        context_parallel_size=cp,
        **parallel,
    )
    return resolve(Config(model=model, parallel=par, train=train), tp * cp * pp * dp)


def _groups(layout: tuple) -> ParallelGroups:
    tp, cp, pp, dp = layout
    if tp * cp * pp * dp == 1:
        return ParallelGroups.single_process()
    return ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT)


def _full_state(stage, groups: ParallelGroups) -> dict:
    """Global parameters and Adam moments of this rank's stage (gathered over tp), by name."""
    params = list(global_named_parameters(stage.model))
    moments = gather_local_state(stage.optimizer, [p for _, p in params], groups.dp_cp)
    out = {}
    for name, p in params:
        for kind, local in [("param", p.detach())] + list(moments[id(p)].items()):
            shards = [local]
            if groups.tp.size > 1:
                shards = [torch.empty_like(local) for _ in range(groups.tp.size)]
                torch.distributed.all_gather(shards, local.contiguous(), group=groups.tp.group)
            full = unshard([s.clone() for s in shards], global_param(p))
            real = global_param(p).real_rows
            out[f"{kind}/{name}"] = full[:real] if real is not None else full
    return out


def _check_and_step(stage, cfg, groups) -> dict:
    """What a loaded (or saved) stage holds, its evaluation loss, then step 3's loss and norm."""
    stage.wait_for_params()
    state = _full_state(stage, groups)
    evaluated = eval_loss(stage, [rank_microbatches(100, cfg, groups.dp.rank, groups.dp.size)])
    step = train_step(stage, rank_microbatches(STEPS, cfg, groups.dp.rank, groups.dp.size), STEPS)
    return {"state": state, "eval": evaluated, "loss": step.loss, "norm": step.grad_norm}


def _load(layout: tuple, parallel: dict, root: str) -> dict:
    groups = _groups(layout)
    cfg = _config(layout, parallel)
    stage = build_stage(cfg, groups)
    meta = load_checkpoint(stage, root)
    return dict(_check_and_step(stage, cfg, groups), iteration=meta["iteration"])


def checkpoint_worker(rank: int, world: int, roots: tuple[str, str, str]) -> dict:
    first, second, plain = roots
    out = {}
    groups, cfg = _groups(SAVE[0]), _config(*SAVE)
    stage = build_stage(cfg, groups)
    for i in range(STEPS):
        train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i)
    save_checkpoint(stage, first, STEPS, consumed_samples=STEPS * cfg.train.global_batch_size)
    out["saved"] = _check_and_step(stage, cfg, groups)
    for layout, parallel in LOADS:
        out[layout] = _load(layout, parallel, first)
    groups, cfg = _groups(RESAVE[0]), _config(*RESAVE)
    stage = build_stage(cfg, groups)
    load_checkpoint(stage, first)
    save_checkpoint(stage, second, STEPS, consumed_samples=STEPS * cfg.train.global_batch_size)
    out["back"] = _load(*SAVE, second)
    # the same training state at cp 1 (dp 4, the same ZeRO-1 over 4 ranks): its files' size
    groups, cfg = _groups((1, 1, 1, 4)), _config((1, 1, 1, 4), SAVE[1])
    stage = build_stage(cfg, groups)
    load_checkpoint(stage, first)
    save_checkpoint(stage, plain, STEPS, consumed_samples=STEPS * cfg.train.global_batch_size)
    return out


def _merge(per_rank: list[dict], key) -> dict:
    """One result over all ranks: the ranks' states together (each rank's must agree where they
    overlap, bitwise), the scalars of rank 0 (checked equal on every rank)."""
    state: dict[str, torch.Tensor] = {}
    for res in per_rank:
        r = res[key]
        for name, value in r["state"].items():
            assert name not in state or torch.equal(state[name], value), (key, name)
            state[name] = value
        for scalar in ("eval", "loss", "norm"):
            assert r[scalar] == per_rank[0][key][scalar], (key, scalar)
    return dict(per_rank[0][key], state=state)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], tuple[str, str, str]]:
    roots = tuple(str(tmp_path_factory.mktemp(name)) for name in ("cp2", "resaved", "cp1"))
    return run_in_pool(checkpoint_worker, 4, roots), roots


def _same(got: dict, want: dict, what) -> None:
    assert sorted(got["state"]) == sorted(want["state"]), what
    for name, value in want["state"].items():
        assert torch.equal(got["state"][name], value), (what, name)
    for scalar in ("eval", "loss", "norm"):
        torch.testing.assert_close(got[scalar], want[scalar], rtol=1e-9, atol=0, msg=f"{what} {scalar}")


@pytest.mark.parametrize("layout", [layout for layout, _ in LOADS] + ["back"], ids=str)
def test_cp2_checkpoint_loads_at_other_layouts(runs, layout):
    per_rank, _ = runs
    want = _merge(per_rank, "saved")
    assert any(v.abs().sum() > 0 for k, v in want["state"].items() if k.startswith("exp_avg/"))
    got = _merge(per_rank, layout)
    assert got["iteration"] == STEPS
    _same(got, want, layout)


def test_cp2_checkpoint_loads_in_one_process(runs):
    per_rank, (first, _, _) = runs
    got = _load((1, 1, 1, 1), {}, first)
    _same(got, _merge(per_rank, "saved"), "one process")


def test_cp_stores_each_tensor_once(runs):
    _, (first, _, plain) = runs

    def data_bytes(root: str) -> int:
        return sum(f.stat().st_size for f in Path(root, "iter_0000002").glob("*.distcp"))

    assert data_bytes(first) == data_bytes(plain) > 0
