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
from ptdp.engine.moe.experts import ExpertParam
from ptdp.engine.tensor_parallel.sharding import unshard
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
    # the Switch loss with the previous step's counts over the global batch
    "moe_global": (
        {},
        MoEConfig(
            num_experts=4,
            moe_router_topk=2,
            moe_router_load_balancing_type="global_aux_loss",
            moe_aux_loss_coeff=0.05,
        ),
    ),
    # the forced balanced assignment, softmax before the top-k
    "moe_forced": (
        {},
        MoEConfig(num_experts=4, moe_router_topk=1, moe_router_force_load_balancing=True, moe_router_pre_softmax=True),
    ),
}


#: a variant's name may add ``:<sharding strategy>`` (over dp x cp, experts over edp), ``:bf16``,
#: ``:allgather`` (the dispatcher), ``:interleaved`` (1F1B over two chunks of one layer per stage)
#: ``:pad`` (expert inputs padded to the capacity), ``:starve`` (a capacity so small that some
#: ranks receive no rows) or ``:postval`` (--enable-optimizer-post-validation)
SHARDING = {"optim", "optim_grads", "optim_grads_params"}
#: ``:<recipe>``: FP8 GEMMs (emulated, float64 compute) in every linear and expert, fp8_cases' options
FP8 = {"tensorwise", "delayed", "rowwise", "blockwise"}
OPTIONS = SHARDING | FP8 | {"bf16", "allgather", "interleaved", "pad", "starve", "postval"}


def moe_config(name: str, tp: int, cp: int, pp: int, dp: int, ep: int = 1, etp: int = 1) -> Config:
    """The tiny MoE model of ``name`` at this layout: 4 layers, h 32, 4 heads, s 16, b 2, B 8
    (4 / dp micro-batches per pipeline), float64, clipping active."""
    base, *options = name.split(":")
    assert set(options) <= OPTIONS, options
    model_overrides, moe = VARIANTS[base]
    if "bf16" in options:
        model_overrides = {**model_overrides, "params_dtype": "bfloat16"}
    if "pad" in options:
        moe = dataclasses.replace(moe, moe_pad_expert_input_to_capacity=True)
    if "starve" in options:
        moe = dataclasses.replace(moe, moe_expert_capacity_factor=0.05, moe_token_drop_policy="position")
    sharding = [o for o in options if o in SHARDING]
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
        enable_optimizer_post_validation="postval" in options,
    )
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        context_parallel_size=cp,
        sequence_parallel=tp > 1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type="allgather" if "allgather" in options else "alltoall",
        **(
            {"pipeline_schedule": "interleaved-1f1b", "num_layers_per_virtual_pipeline_stage": 2 // pp}
            if "interleaved" in options
            else {}
        ),
        **({"data_parallel_sharding_strategy": sharding[0], "ddp_bucket_size": 500} if sharding else {}),
    )
    from helpers.fp8_cases import RECIPES

    fp8 = [RECIPES[o] for o in options if o in FP8]
    config = Config(model=model, moe=moe, parallel=par, train=train, **({"fp8": fp8[0]} if fp8 else {}))
    return resolve(config, tp * cp * pp * dp)


#: the variants each layout runs (besides "moe", run everywhere): every one at two layouts or more
RUNS = {
    (2, 1, 1, 1): ["moe_capacity_shared", "moe_forced", "moe_capacity_shared:pad", "moe:blockwise"],
    (1, 2, 1, 1): ["moe_capacity_shared", "moe_bias", "moe:rowwise"],
    (1, 1, 2, 1): ["moe_llama_sigmoid", "moe_bias"],
    (1, 1, 1, 2): ["moe_llama_sigmoid", "moe_forced", "moe_global", "moe_forced:optim_grads_params"],
    (2, 1, 2, 1): ["moe_capacity_shared", "moe_bias", "moe_llama_sigmoid", "moe_global"],
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
    """One process of ``name`` (without sharding, synchronous optimizer steps: the same arithmetic)."""
    kept = [o for o in name.split(":") if o not in OPTIONS - FP8 - {"bf16", "starve"}]  # the same arithmetic
    if kept != name.split(":"):
        return reference(":".join(kept))
    return train_and_collect(moe_config(name, 1, 1, 1, 1), ParallelGroups.single_process())


#: world size -> layouts (tp, cp, pp, dp, ep) with experts split over ep ranks (parallel folding:
#: the ep group spans tp, then cp, then dp ranks)
EP_LAYOUTS: dict[int, list[tuple[int, ...]]] = {
    2: [(1, 1, 1, 2, 2), (1, 1, 1, 2, 1, 2)],
    4: [
        (1, 1, 1, 4, 4),
        (2, 1, 1, 2, 2),
        (1, 2, 1, 2, 2),
        (1, 1, 2, 2, 2),
        (1, 1, 1, 4, 2),
        (1, 1, 1, 4, 2, 2),
        (2, 1, 1, 2, 1, 2),
    ],
}


def collect_ep(cfg: Config, groups: ParallelGroups, stage=None, steps: range = range(3)) -> dict:
    """Train ``steps`` (of ``stage``, default a new one); losses, norms, the expert biases and every
    parameter: dense ones with their spec, experts with this rank's ep rank (their slice of the
    global experts)."""
    from helpers.layout_cases import rank_microbatches
    from ptdp.engine.model.model_chunks import global_named_parameters
    from ptdp.engine.stage import build_stage
    from ptdp.engine.step import train_step

    stage = build_stage(cfg, groups) if stage is None else stage
    losses, norms, comm, moe = [], [], None, []
    for step in steps:
        groups.stats.reset()
        result = train_step(stage, rank_microbatches(step, cfg, groups.dp.rank, groups.dp.size), step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        moe.append(result.result().moe)
        comm = comm or groups.stats.as_dict()
    stage.wait_for_params()  # optim_grads_params: every parameter whole
    params = {}
    ep_rank = groups.ep.rank if groups.ep is not None else 0
    etp_rank = groups.etp.rank if groups.etp is not None else 0
    for name, p in global_named_parameters(stage.model):
        if hasattr(p, "ptdp_expert"):
            params[name] = (p.detach().clone(), p.ptdp_expert, (ep_rank, etp_rank))
        else:
            params[name] = (p.detach().clone(), p.ptdp_global, groups.tp.rank)
    from ptdp.run.planner_report import measure_stage

    buffers = {n: b.clone() for n, b in stage.model.named_buffers() if n.endswith(("expert_bias", "global_counts"))}
    out = {"losses": losses, "norms": norms, "params": params, "comm": comm, "buffers": buffers, "moe": moe}
    return out | {"measured": measure_stage(stage)}


#: the variants each expert-parallel layout runs; every sharding strategy where edp > 1, and 16-bit
#: parameters (float32 main parameters over both buffers)
EP_RUNS = {
    (1, 1, 1, 2, 2): ["moe_ep", "moe_llama_sigmoid", "moe_ep:tensorwise", "moe_ep:rowwise", "moe_forced:optim_grads"],
    (1, 1, 1, 4, 4): ["moe_ep", "moe_ep_dropless", "moe_ep:allgather"],
    (2, 1, 1, 2, 2): ["moe_ep", "moe_ep:optim_grads_params", "moe_ep:tensorwise", "moe_llama_sigmoid"],
    (1, 2, 1, 2, 2): ["moe_ep", "moe_ep:optim", "moe_ep:pad", "moe_ep:postval"],
    (1, 1, 2, 2, 2): ["moe_ep", "moe_llama_sigmoid", "moe_ep:bf16", "moe_ep:interleaved", "moe_ep:postval:optim_grads"],
    (1, 1, 1, 4, 2): ["moe_ep:optim_grads", "moe_ep:bf16:optim", "moe_ep:postval"],
    (1, 1, 1, 2, 1, 2): ["moe_ep_swiglu", "moe_ep_swiglu:pad", "moe_ep_swiglu:blockwise", "moe_ep_swiglu:delayed"],
    (1, 1, 1, 4, 2, 2): ["moe_ep_swiglu", "moe_ep_swiglu:pad:allgather"],
    (2, 1, 1, 2, 1, 2): [
        "moe_ep_swiglu:optim",
        "moe_ep_swiglu:allgather",
        "moe_ep_swiglu:starve",  # the second tp rank's tokens all dropped: no rows on it
        "moe_ep_swiglu:starve:allgather",
        "moe_ep_swiglu:rowwise:allgather",
    ],
}


def ep_variants(layout: tuple[int, ...]) -> list[str]:
    return EP_RUNS[layout]


def moe_ep_worker(rank: int, world: int) -> dict:
    out = {}
    for layout in EP_LAYOUTS[world]:
        tp, cp, pp, dp, ep, *etp = layout
        layout_ = ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp)
        groups = ParallelGroups.build(layout_, PG_TIMEOUT, ep=ep, etp=etp[0] if etp else 1)
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
#: Llama-like (SwiGLU, no biases): what etp > 1 splits
VARIANTS["moe_ep_swiglu"] = (LLAMA_OPTIONS, VARIANTS["moe_ep"][1])
VARIANTS["moe_ep_bias"] = (
    LLAMA_OPTIONS,
    dataclasses.replace(
        VARIANTS["moe_ep"][1],
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.05,
        moe_router_load_balancing_type="global_aux_loss",
    ),
)


def _unshard_experts(shards: list[torch.Tensor], spec: ExpertParam) -> torch.Tensor:
    """An ep rank's ``[E / ep, ...]`` experts whole from their etp shards."""
    return torch.stack([unshard([s[e] for s in shards], spec.expert) for e in range(shards[0].shape[0])])


def ep_full_parameters(results: list[dict], name: str) -> dict[str, torch.Tensor]:
    """Dense parameters from their tp shards, experts from their ep slices of etp shards; replicas
    bitwise equal."""
    parts: dict[str, dict] = {}
    kinds = {}
    for res in results:
        for key, (tensor, spec, index) in res[name]["params"].items():
            kinds[key] = spec
            seen = parts.setdefault(key, {})
            if index in seen:
                torch.testing.assert_close(tensor, seen[index], rtol=0, atol=0, msg=f"{name} {key}: replicas differ")
            else:
                seen[index] = tensor
    out = {}
    for key, by_index in parts.items():
        ordered = [by_index[i] for i in sorted(by_index)]
        spec = kinds[key]
        if isinstance(spec, ExpertParam):  # ordered by (ep rank, etp rank)
            etp = len({i[1] for i in by_index})
            slices = [ordered[i : i + etp] for i in range(0, len(ordered), etp)]
            out[key] = torch.cat([_unshard_experts(shards, spec) for shards in slices])
        else:
            out[key] = real_rows(unshard(ordered, kinds[key]), kinds[key])
    return out


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
