"""A tiny mixture-of-experts GPT trained a few steps at a given (tp, cp, pp, dp) layout, for the MoE
equivalence tests: every layout of a world size in one job on the session's workers."""

from __future__ import annotations

import dataclasses
import functools

import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import LLAMA_OPTIONS, TOL, VOCAB, real_rows, train_and_collect
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.layout.grid import ParallelLayout

#: world size -> layouts (tp, cp, pp, dp); tp > 1 runs sequence parallelism (MoE's rule)
LAYOUTS = {2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)], 4: [(2, 1, 2, 1)]}

#: name -> (model overrides, MoE options). 4 layers, the first dense in two of them.
VARIANTS = {
    # softmax top-2 of 4 experts, the Switch loss per micro-batch and the z-loss, a dense first layer
    "moe": (
        {},
        MoEConfig(
            num_experts=4,
            moe_router_topk=2,
            moe_aux_loss_coeff=0.01,
            moe_z_loss_coeff=1e-3,
            moe_layer_freq=(0, 1, 1, 1),
        ),
    ),
    # a capacity that drops (by probability), a shared expert, the loss per sequence
    "moe_capacity_shared": (
        {},
        MoEConfig(
            num_experts=4,
            moe_router_topk=2,
            moe_expert_capacity_factor=0.75,
            moe_shared_expert_intermediate_size=32,
            moe_router_load_balancing_type="seq_aux_loss",
            moe_aux_loss_coeff=0.01,
        ),
    ),
    # Llama-like with sigmoid scores, group-limited routing, scaling and drops by position
    "moe_llama_sigmoid": (
        LLAMA_OPTIONS,
        MoEConfig(
            num_experts=8,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            moe_router_topk_scaling_factor=2.0,
            moe_expert_capacity_factor=1.0,
            moe_token_drop_policy="position",
            moe_layer_freq=(2,),
        ),
    ),
    # aux-loss-free balancing: the expert bias moved after every step, with full recompute (counted once)
    "moe_bias": (
        {"recompute_granularity": "full", "recompute_num_layers": 1},
        MoEConfig(
            num_experts=4,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.05,
        ),
    ),
    # the forced balanced assignment, softmax before the top-k
    "moe_forced": (
        {},
        MoEConfig(num_experts=4, moe_router_topk=1, moe_router_force_load_balancing=True, moe_router_pre_softmax=True),
    ),
}


def moe_config(name: str, tp: int, cp: int, pp: int, dp: int, ep: int = 1) -> Config:
    """The tiny MoE model of ``name`` at this layout: 4 layers, h 32, 4 heads, s 16, b 2, B 8
    (4 / dp micro-batches per pipeline), float64, clipping active."""
    model_overrides, moe = VARIANTS[name]
    model = dataclasses.replace(
        ModelConfig(
            num_layers=4,
            hidden_size=32,
            num_attention_heads=4,
            ffn_hidden_size=48,
            seq_length=16,
            vocab_size=VOCAB,
            make_vocab_size_divisible_by=8,
            params_dtype="float64",
        ),
        **model_overrides,
    )
    train = TrainConfig(
        micro_batch_size=2,
        global_batch_size=8,
        train_iters=3,
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
        sequence_parallel=tp > 1,
        expert_model_parallel_size=ep,
    )
    return resolve(Config(model=model, moe=moe, parallel=par, train=train), tp * cp * pp * dp)


#: the variants each layout runs (besides "moe", run everywhere): every one at two layouts or more
RUNS = {
    (2, 1, 1, 1): ["moe_capacity_shared", "moe_forced"],
    (1, 2, 1, 1): ["moe_capacity_shared", "moe_bias"],
    (1, 1, 2, 1): ["moe_llama_sigmoid", "moe_bias"],
    (1, 1, 1, 2): ["moe_llama_sigmoid", "moe_forced"],
    (2, 1, 2, 1): ["moe_capacity_shared", "moe_bias", "moe_llama_sigmoid"],
}


def variants(layout: tuple[int, int, int, int]) -> list[str]:
    return ["moe", *RUNS[layout]]


def moe_worker(rank: int, world: int) -> dict:
    out = {}
    for tp, cp, pp, dp in LAYOUTS[world]:
        groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT)
        out[(tp, cp, pp, dp)] = {
            name: train_and_collect(moe_config(name, tp, cp, pp, dp), groups) for name in variants((tp, cp, pp, dp))
        }
    return out


@functools.cache
def world_results(world: int) -> list[dict]:
    return run_in_pool(moe_worker, world)


@functools.cache
def reference(name: str) -> dict:
    return train_and_collect(moe_config(name, 1, 1, 1, 1), ParallelGroups.single_process())


#: world size -> layouts (tp, cp, pp, dp, ep) with experts split over ep ranks (parallel folding:
#: the ep group spans tp, then cp, then dp ranks)
EP_LAYOUTS = {
    2: [(1, 1, 1, 2, 2)],
    4: [(1, 1, 1, 4, 4), (2, 1, 1, 2, 2), (1, 2, 1, 2, 2), (1, 1, 2, 2, 2)],
}


def collect_ep(cfg: Config, groups: ParallelGroups) -> dict:
    """Train 3 steps; losses, norms and every parameter: dense ones with their spec, experts with
    this rank's ep rank (their slice of the global experts)."""
    from helpers.layout_cases import rank_microbatches
    from ptdp.engine.model.model_chunks import global_named_parameters
    from ptdp.engine.stage import build_stage
    from ptdp.engine.step import train_step

    stage = build_stage(cfg, groups)
    losses, norms, comm = [], [], None
    for step in range(3):
        groups.stats.reset()
        result = train_step(stage, rank_microbatches(step, cfg, groups.dp.rank, groups.dp.size), step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        comm = comm or groups.stats.as_dict()
    params = {}
    ep_rank = groups.ep.rank if groups.ep is not None else 0
    for name, p in global_named_parameters(stage.model):
        if hasattr(p, "ptdp_expert"):
            params[name] = (p.detach().clone(), "expert", ep_rank)
        else:
            params[name] = (p.detach().clone(), p.ptdp_global, groups.tp.rank)
    return {"losses": losses, "norms": norms, "params": params, "comm": comm, "pp_rank": groups.pp.rank}


def ep_variants(layout: tuple[int, int, int, int, int]) -> list[str]:
    """moe_ep everywhere; the Llama-like sigmoid router at ep over dp ranks and with two stages;
    the dropless one (its traffic checked) at ep 4."""
    extra = ["moe_llama_sigmoid"] if layout in ((1, 1, 1, 2, 2), (1, 1, 2, 2, 2)) else []
    return ["moe_ep", *extra, *(["moe_ep_dropless"] if layout == (1, 1, 1, 4, 4) else [])]


def moe_ep_worker(rank: int, world: int) -> dict:
    out = {}
    for tp, cp, pp, dp, ep in EP_LAYOUTS[world]:
        groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT, ep=ep)
        layout = (tp, cp, pp, dp, ep)
        out[layout] = {name: collect_ep(moe_config(name, *layout), groups) for name in ep_variants(layout)}
    return out


#: the expert-parallel variant (8 experts divide over ep 2 and 4)
VARIANTS["moe_ep"] = (
    {},
    MoEConfig(
        num_experts=8,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=32,
        moe_expert_capacity_factor=1.0,
        moe_layer_freq=(0, 1, 1, 1),
    ),
)


@functools.cache
def ep_world_results(world: int) -> list[dict]:
    return run_in_pool(moe_ep_worker, world)


VARIANTS["moe_ep_dropless"] = ({}, dataclasses.replace(VARIANTS["moe_ep"][1], moe_expert_capacity_factor=None))


def check_like_one_process(results: list[dict], name: str, ref: dict, got: dict[str, torch.Tensor]) -> None:
    """Clipping fired in one process's run ``ref``; every rank's per-step losses and norms, and
    ``got`` (the parameters rebuilt from the ranks), equal ``ref``'s within float64's tolerance."""
    assert all(n > 0.05 for n in ref["norms"]), "clipping (clip_grad=0.05) must fire in this test"
    for res in results:
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), **TOL["float64"])
        torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), **TOL["float64"])
    want = {key: real_rows(t, spec) for key, (t, spec, _) in ref["params"].items()}
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL["float64"], msg=lambda m, key=key: f"{name} {key}: {m}")
