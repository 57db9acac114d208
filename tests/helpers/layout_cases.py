"""A tiny GPT trained a few steps at a given layout, for equivalence and communication tests."""

from __future__ import annotations

import dataclasses
import functools

import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from ptdp.config.fp8 import FP8Config
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.engine.tensor_parallel.sharding import unshard
from ptdp.layout.grid import ParallelLayout
from ptdp.run.planner_report import measure_stage

VOCAB = 303  # odd: tp never divides it before padding
STEPS = 3


def tiny_config(
    tp: int,
    pp: int,
    dp: int,
    dtype: str,
    *,
    train_overrides=None,
    parallel_overrides=None,
    moe: MoEConfig | None = None,
    fp8: FP8Config | None = None,
    **model_overrides,
) -> Config:
    model = ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=8,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=8,
        params_dtype=dtype,
    )
    model = dataclasses.replace(model, **model_overrides)
    train = TrainConfig(
        micro_batch_size=2,
        global_batch_size=8,
        train_iters=STEPS,
        lr=3e-3,
        min_lr=3e-4,
        lr_warmup_iters=1,
        clip_grad=0.05,
        weight_decay=0.1,
        # Adam divides by sqrt(v) + eps: with eps = 1e-8, float32 rounding noise in near-zero
        # gradients (which differs between layouts by summation order) becomes updates of order
        # 1e-5, as large as float32-vs-float64 of one layout. eps = 1e-6 keeps that noise near 2e-7
        # so a 1e-5 tolerance tests the parallel code, not rounding. float64 keeps the default.
        adam_eps=1e-6 if dtype == "float32" else 1e-8,
    )
    train = dataclasses.replace(train, **(train_overrides or {}))
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        **(parallel_overrides or {}),
    )
    config = Config(model=model, parallel=par, train=train, moe=moe or MoEConfig(), fp8=fp8 or FP8Config())
    return resolve(config, tp * par.context_parallel_size * pp * dp)


def global_batch(step: int, cfg: Config) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (cfg.train.global_batch_size, cfg.model.seq_length + 1), generator=gen)


def rank_microbatches(step: int, cfg: Config, dp_rank: int, dp_size: int):
    data = global_batch(step, cfg)
    per_rank = data.shape[0] // dp_size
    mine = data[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    b = cfg.train.micro_batch_size
    return [(mine[i : i + b, :-1], mine[i : i + b, 1:]) for i in range(0, per_rank, b)]


def train_and_collect(cfg: Config, groups: ParallelGroups, record_comm_step: int | None = None, collect=None) -> dict:
    """Train STEPS steps; return losses, norms, local parameters with their specs, comm counts (and
    what ``collect(stage)`` returns, under its keys)."""
    stage = build_stage(cfg, groups)
    losses, norms, comm, moe = [], [], None, []
    for step in range(STEPS):
        mbs = rank_microbatches(step, cfg, groups.dp.rank, groups.dp.size)
        groups.stats.reset()
        result = train_step(stage, mbs, step)
        if step == record_comm_step:
            comm = groups.stats.as_dict()
        losses.append(result.loss)
        norms.append(result.grad_norm)
        moe.append(result.result().moe)
    stage.wait_for_params()
    params = {
        name: (p.detach().clone(), p.ptdp_global, getattr(p, "ptdp_tied_copy", False))
        for name, p in global_named_parameters(stage.model)
    }
    c = groups.coords
    extra = collect(stage) if collect is not None else {}
    return extra | {
        "buffers": {
            n: b.clone() for n, b in stage.model.named_buffers() if n.endswith(("expert_bias", "global_counts"))
        },
        "moe": moe,
        "losses": losses,
        "norms": norms,
        "params": params,
        "comm": comm,
        "measured": measure_stage(stage),
        "coords": (c.tp_rank, c.dp_rank, c.pp_rank),
        "grad_numel": stage.grads.data.numel(),
    }


LLAMA_OPTIONS = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "num_query_groups": 2,
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
}

#: Named variants of the tiny model: (dtype, model, parallel and train overrides). Parallel
#: overrides apply only where pp > 1 (the single-process reference has one stage).
VARIANTS = {
    "float64": ("float64", {}, {}, {}),
    "float32": ("float32", {}, {}, {}),
    "untied": ("float64", {"untie_embeddings_and_output_weights": True}, {}, {}),
    "uneven": ("float64", {"num_layers": 5}, {"pipeline_layer_split": (3, 2)}, {}),
    # Megatron's first/last stage counts at pp = 4 (1, 3, 3, 1) and the same split given explicitly;
    # the first stage's count alone (1, 2, 2, 2)
    "first_last": (
        "float64",
        {"num_layers": 8},
        {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 1},
        {},
    ),
    "first_last_explicit": ("float64", {"num_layers": 8}, {"pipeline_layer_split": (1, 3, 3, 1)}, {}),
    "first_only": ("float64", {"num_layers": 7}, {"decoder_first_pipeline_num_layers": 1}, {}),
    # the embedding and the loss counted as layers (Megatron's account-for flags): 6 layers + 2 in
    # chunks of 1 unit, interleaved (pp = 4: v = 2, rank 0's first chunk only the embedding, the last
    # rank's last chunk only the output layer + loss); the embedding alone, 7 + 1 over 4 stages: 1, 2, 2, 2
    "accounted_interleaved": (
        "float64",
        {"num_layers": 6},
        {
            "account_for_embedding_in_pipeline_split": True,
            "account_for_loss_in_pipeline_split": True,
            "num_layers_per_virtual_pipeline_stage": 1,
        },
        {},
    ),
    "accounted_embedding": ("float64", {"num_layers": 7}, {"account_for_embedding_in_pipeline_split": True}, {}),
    # one microbatch per pipeline when dp = 2 (fewer microbatches than stages)
    "one_microbatch": ("float64", {}, {}, {"global_batch_size": 4}),
    # bf16 weights with float32 main parameters and gradients: compared loosely
    "bfloat16": ("bfloat16", {}, {}, {}),
    "gpipe": ("float64", {}, {"pipeline_schedule": "gpipe"}, {}),
    # 8 layers in 2 chunks per rank: pp=2 holds layers {0,1},{4,5} / {2,3},{6,7}; pp=4 one per chunk
    "interleaved": ("float64", {"num_layers": 8}, {"pipeline_schedule": "interleaved-1f1b"}, {}),
    # more microbatches than stages (8 at dp = 1, 4 at dp = 2): the steady state of interleaving,
    # where grouping transfers as the action list places them deadlocks on NCCL
    "interleaved_m8": (
        "float64",
        {"num_layers": 8},
        {"pipeline_schedule": "interleaved-1f1b"},
        {"micro_batch_size": 1},
    ),
    # zero-bubble schedules: B and W apart, the linear layers' weight gradients deferred to W; ZB-H2
    # with full recompute (B recomputes, W reuses what B kept) and the distributed optimizer
    "zb_h1": ("float64", {}, {"pipeline_schedule": "zb-h1"}, {}),
    "zb_h2": (
        "float64",
        {"recompute_granularity": "full", "recompute_num_layers": 1},
        {"pipeline_schedule": "zb-h2"},
        {},
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 901},
    ),
    # the V placement: two chunks per rank, rank 0 running the first and the last stage (one tied
    # embedding); ZB-V with the distributed optimizer's overlapped buckets, DualPipeV (whole and
    # split backwards, 8 microbatches at dp = 1) with full recompute and an untied output layer
    "zb_v": (
        "float64",
        {"num_layers": 8},
        {"pipeline_schedule": "zb-v"},
        {},
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 901},
    ),
    "dualpipev": (
        "float64",
        {
            "num_layers": 8,
            "recompute_granularity": "full",
            "recompute_num_layers": 1,
            "untie_embeddings_and_output_weights": True,
        },
        {"pipeline_schedule": "dualpipev"},
        {"micro_batch_size": 1},
    ),
    # zero-bubble schedules with gradients sharded (ZeRO-2) and parameters too (ZeRO-3): each
    # chunk's buckets reduce-scattered once, from the W completing its gradients
    "zb_h1_zero2": (
        "float64",
        {},
        {"pipeline_schedule": "zb-h1"},
        {},
        {"data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": True, "ddp_bucket_size": 901},
    ),
    "zb_v_zero3": (
        "float64",
        {"num_layers": 8, "untie_embeddings_and_output_weights": True},
        {"pipeline_schedule": "zb-v"},
        {},
        {"data_parallel_sharding_strategy": "optim_grads_params", "ddp_bucket_size": 901},
    ),
    # data-parallel engine (applied at every layout, dp = 1 included): small buckets reduced during
    # backward; the distributed optimizer with buckets that need padding; accumulation of 4-8
    # microbatches (16 for the dp = 1 reference)
    "dp_overlap": ("float64", {}, {}, {}, {"overlap_grad_reduce": True, "ddp_bucket_size": 700}),
    "dp_distopt": ("float64", {}, {}, {}, {"use_distributed_optimizer": True, "ddp_bucket_size": 901}),
    "dp_distopt_overlap": (
        "float64",
        {},
        {},
        {},
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 2000},
    ),
    # parameter all-gathers finished by the next forward's pre-hooks (tied embedding: pp = 2)
    "dp_distopt_overlap_gather": (
        "float64",
        {},
        {},
        {},
        {
            "use_distributed_optimizer": True,
            "overlap_param_gather": True,
            "overlap_grad_reduce": True,
            "ddp_bucket_size": 1500,
        },
    ),
    "dp_accumulate": (
        "float64",
        {},
        {},
        {"micro_batch_size": 1, "global_batch_size": 16},
        {"overlap_grad_reduce": True, "ddp_bucket_size": 5000},
    ),
    # optimizer post-validation (Qi et al. 2024, §4): every rank updates before the global norm is
    # known, then rolls back and redoes the update clipped (clipping fires at every step); with the
    # distributed optimizer and overlapped gathers, with sharded parameters; ZB-H1 without clipping
    # (updates kept)
    "postval": ("float64", {}, {}, {"enable_optimizer_post_validation": True}),
    "postval_distopt": (
        "float64",
        {},
        {},
        {"enable_optimizer_post_validation": True},
        {
            "use_distributed_optimizer": True,
            "overlap_param_gather": True,
            "overlap_grad_reduce": True,
            "ddp_bucket_size": 1500,
        },
    ),
    "postval_zero3": (
        "float64",
        {},
        {},
        {"enable_optimizer_post_validation": True},
        {"data_parallel_sharding_strategy": "optim_grads_params", "ddp_bucket_size": 901},
    ),
    "postval_zb_unclipped": (
        "float64",
        {},
        {"pipeline_schedule": "zb-h1"},
        {"enable_optimizer_post_validation": True, "clip_grad": 100.0},
        {"use_distributed_optimizer": True, "ddp_bucket_size": 901},
    ),
    "dp_distopt_bf16": ("bfloat16", {}, {}, {}, {"use_distributed_optimizer": True, "ddp_bucket_size": 901}),
    # --grad-reduce-in-bf16: bf16 gradient buckets reduced during backward, the distributed optimizer
    "dp_bf16_grads": (
        "bfloat16",
        {},
        {},
        {},
        {
            "grad_reduce_in_bf16": True,
            "use_distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "ddp_bucket_size": 901,
        },
    ),
    # Llama-like: RMSNorm, SwiGLU, rotary positions, 2 query groups of 2 heads, no linear biases,
    # untied output layer; at tp = 4 (2 groups cannot be split over 4 ranks) 8 heads in 4 groups
    "llama": ("float64", LLAMA_OPTIONS, {}, {}),
    "llama_tp4": ("float64", LLAMA_OPTIONS | {"num_attention_heads": 8, "num_query_groups": 4}, {}, {}),
    # sequence parallelism (tp > 1 only: the tp = 1 reference runs without it): the GPT; the
    # Llama-like model with full recompute of groups of 2 layers; the GPT with the distributed
    # optimizer reducing small buckets during backward (the tp sum then acts on gradient shards)
    "sp": ("float64", {}, {}, {}, {"sequence_parallel": True}),
    "sp_llama": (
        "float64",
        LLAMA_OPTIONS | {"recompute_granularity": "full", "recompute_num_layers": 2},
        {},
        {},
        {"sequence_parallel": True},
    ),
    "sp_distopt": (
        "float64",
        {},
        {},
        {},
        {
            "sequence_parallel": True,
            "use_distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "ddp_bucket_size": 901,
        },
    ),
    # Qwen3's heads: 12 channels each (h / a = 8) and query/key norms whose gradients sum over tp;
    # without and with sequence parallelism (tp = 2 only)
    "qk_norm": ("float64", LLAMA_OPTIONS | {"kv_channels": 12, "qk_layernorm": True}, {}, {}),
    "sp_qk_norm": (
        "float64",
        LLAMA_OPTIONS | {"kv_channels": 12, "qk_layernorm": True},
        {},
        {},
        {"sequence_parallel": True},
    ),
    # the vocabulary (303) padded to a multiple of 64 * tp: at tp = 4 (512 rows, 128 per rank) the
    # last tp rank holds padding only; untied, and (sp_pad_rank) tied with sequence parallelism and
    # the distributed optimizer: every rank still takes part in every collective with equal shapes
    "pad_rank": ("float64", {"make_vocab_size_divisible_by": 64, "untie_embeddings_and_output_weights": True}, {}, {}),
    "sp_pad_rank": (
        "float64",
        {"make_vocab_size_divisible_by": 64},
        {},
        {},
        {"sequence_parallel": True, "use_distributed_optimizer": True, "ddp_bucket_size": 901},
    ),
}
DP_LAYOUTS = {(1, 1, 4), (2, 2, 2), (1, 2, 2)}
DP_VARIANTS = ["dp_overlap", "dp_distopt", "dp_distopt_overlap", "dp_distopt_overlap_gather", "dp_accumulate"]
POSTVAL_VARIANTS = ["postval", "postval_distopt", "postval_zero3", "postval_zb_unclipped"]
SCHEDULE_LAYOUTS = {(1, 2, 1), (1, 4, 1), (2, 2, 2), (1, 2, 2)}
SCHEDULE_VARIANTS = ["gpipe", "interleaved", "interleaved_m8", "zb_h1", "zb_h2", "zb_v", "dualpipev"]
#: zero-bubble schedules with sharded gradients, where dp > 1
ZB_SHARDED_VARIANTS = ["zb_h1_zero2", "zb_v_zero3"]


def llama_variant(tp: int) -> str:
    """The Llama-like variant every layout runs: 2 query groups where tp divides them."""
    return "llama" if 2 % tp == 0 else "llama_tp4"


def variant_config(name: str, tp: int, pp: int, dp: int) -> Config:
    dtype, model, parallel, train, *always = VARIANTS[name] + ({},)
    parallel = dict(parallel) if pp > 1 else {}
    parallel.update(always[0])
    if tp == 1:  # sequence parallelism needs tp > 1; the reference is the same model without it
        parallel.pop("sequence_parallel", None)
    if parallel.get("pipeline_schedule") == "interleaved-1f1b":
        parallel["num_layers_per_virtual_pipeline_stage"] = model["num_layers"] // (2 * pp)
    return tiny_config(tp, pp, dp, dtype, train_overrides=train, parallel_overrides=parallel, **model)


def layout_worker(rank: int, world: int, tp: int, pp: int, dp: int, variants: list[str], record_comm: bool) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), PG_TIMEOUT)
    return {
        name: train_and_collect(variant_config(name, tp, pp, dp), groups, 0 if record_comm else None)
        for name in variants
    }


@functools.cache
def reference(variant: str) -> dict:
    """The single-process run of ``variant``, with synchronous optimizer steps (a post-validated
    variant is compared with the step it must equal)."""
    cfg = variant_config(variant, 1, 1, 1)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, enable_optimizer_post_validation=False))
    return train_and_collect(cfg, ParallelGroups.single_process())


@functools.cache
def parallel_run(tp: int, pp: int, dp: int) -> list[dict]:
    """Every rank's results of the variants at this layout (one job per layout on the session's
    workers, :func:`helpers.dist_helpers.run_in_pool`; cached)."""
    variants = ["float64", "float32", llama_variant(tp)]
    if (tp, pp, dp) in EXTRA_VARIANT_LAYOUTS:
        variants += EXTRA_VARIANTS + ["bfloat16"]
    if (tp, pp, dp) in SCHEDULE_LAYOUTS:
        variants += SCHEDULE_VARIANTS + (ZB_SHARDED_VARIANTS if dp > 1 else [])
    if (tp, pp, dp) in DP_LAYOUTS:
        variants += DP_VARIANTS + POSTVAL_VARIANTS + ["dp_distopt_bf16", "dp_bf16_grads"]
    if (tp, pp, dp) in SP_LAYOUTS:
        variants = (variants if (tp, pp, dp) in LAYOUTS else []) + sp_variants(tp, dp)
    variants += PAD_RANK_VARIANTS.get((tp, pp, dp), [])
    if (tp, pp, dp) in QK_NORM_LAYOUTS:
        variants += QK_NORM_VARIANTS
    return run_in_pool(layout_worker, tp * pp * dp, tp, pp, dp, variants, (tp, pp, dp) == (2, 2, 2))


EXTRA_VARIANT_LAYOUTS = {(2, 2, 1), (1, 2, 2)}
EXTRA_VARIANTS = ["untied", "uneven", "one_microbatch"]
#: every (tp, pp, dp) of tests/dist/test_layout_equivalence.py (one job each)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 4, 1), (4, 1, 1)]
#: Qwen3's heads run in the spawns of (2,1,1) and (2,2,2)
QK_NORM_LAYOUTS = {(2, 1, 1), (2, 2, 2)}
QK_NORM_VARIANTS = ["qk_norm", "sp_qk_norm"]
#: a tp rank holding vocabulary padding only (tp = 4): without and with sequence parallelism
PAD_RANK_VARIANTS = {(4, 1, 1): ["pad_rank"], (4, 1, 2): ["sp_pad_rank"]}
#: sequence parallelism runs in the spawns of (2,1,1) and (2,2,2), and in one of its own at (4,1,2)
SP_LAYOUTS = {(2, 1, 1), (2, 2, 2), (4, 1, 2)}


def sp_variants(tp: int, dp: int) -> list[str]:
    """The sequence-parallel variants a layout runs: the Llama-like one at tp = 2 (its 2 query
    groups), the distributed optimizer where dp > 1."""
    return ["sp"] + (["sp_llama"] if tp == 2 else []) + (["sp_distopt"] if dp > 1 else [])


#: Tolerances of the layout-equivalence comparisons (relative and absolute), by dtype.
TOL = {"float64": dict(rtol=1e-9, atol=1e-12), "float32": dict(rtol=1e-5, atol=1e-5)}


def full_parameters(results: list[dict], variant: str) -> dict[str, torch.Tensor]:
    """Global tensors (padding rows cut) rebuilt from tp shards; asserts all copies are bitwise equal."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    specs = {}
    for res in results:
        tp_rank = res[variant]["coords"][0]
        for name, (tensor, spec, _tied_copy) in res[variant]["params"].items():
            specs[name] = spec
            by_rank = shards.setdefault(name, {})
            if tp_rank in by_rank:  # another dp replica, or the tied copy on the last stage
                torch.testing.assert_close(tensor, by_rank[tp_rank], rtol=0, atol=0, msg=f"{name}: copies differ")
            else:
                by_rank[tp_rank] = tensor
    return {name: real_rows(unshard([r[k] for k in sorted(r)], specs[name]), specs[name]) for name, r in shards.items()}


def real_rows(tensor: torch.Tensor, spec) -> torch.Tensor:
    return tensor[: spec.real_rows] if spec.real_rows is not None else tensor
