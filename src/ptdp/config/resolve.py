"""Check a request against every rule and fill in what it leaves open, before any process exists.

:func:`resolve` reports every broken rule at once in one :class:`~ptdp.errors.ConfigError`
(its ``violations`` hold them as data) and returns the config with the data-parallel size, the
schedule, the MLP width, the decay length and the recompute defaults filled in, and the pipeline
split stored (:attr:`~ptdp.config.schema.Config.pipeline`). It never touches torch.distributed.
"""

from __future__ import annotations

import dataclasses

from ptdp.config.model import ModelConfig, concrete_params_dtype
from ptdp.config.parallel import ParallelConfig
from ptdp.config.rules.axes import (
    context_parallel_model_violations,
    context_parallel_violations,
    sequence_parallel_violations,
)
from ptdp.config.rules.dp_sharding import (
    data_parallel_violations,
    grad_reduce_violations,
    sharded_params_violations,
    sharding_violations,
)
from ptdp.config.rules.fp8 import fp8_violations
from ptdp.config.rules.layout import layout_violations, schedule_violations, untrained_schedule_violations
from ptdp.config.rules.moe import moe_violations
from ptdp.config.rules.run_options import checkpoint_violations, launch_violations, profile_violations, train_violations
from ptdp.config.rules.shape import llama_option_violations, model_option_violations, recompute_violations
from ptdp.config.rules.values import finite_violations, positive_violations
from ptdp.config.schema import Config
from ptdp.errors import V, Violation, raise_violations

DEFAULT_LOCAL_WORKERS = 8
"""Workers ``ptdp train`` starts on a machine without GPUs when neither ``--nproc-per-node`` nor
``--dp`` says (if tp x cp x pp divides it); with GPUs the default is their number."""


def resolve(config: Config, world_size: int, *, cuda: bool = False) -> Config:
    """Check every rule for ``world_size`` processes and return the config with dp filled in and
    ``params_dtype`` concrete (``auto``: bfloat16 if ``cuda``, the workers training on CUDA GPUs,
    else float32; :func:`ptdp.config.model.concrete_params_dtype`).

    Raises:
        ConfigError: listing every broken rule with its values. Never touches torch.distributed.
    """
    dtype = concrete_params_dtype(config.model.params_dtype, cuda=cuda)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, params_dtype=dtype))
    p, m, t = config.parallel, config.model, config.train
    sizes = positive_violations(_sizes(config, world_size))
    if any("world_size" not in v.values for v in sizes):  # a world size made of a bad size: that one says it
        sizes = [v for v in sizes if "world_size" not in v.values]
    raise_violations(sizes + finite_violations(_floats(config)))
    errors: list[Violation] = []
    dp = _resolve_dp(p, world_size, errors)
    errors += layout_violations(
        m,
        tp=p.tp,
        pp=p.pp,
        dp=dp,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        split=p.pipeline_layer_split,
        first=p.decoder_first_pipeline_num_layers,
        last=p.decoder_last_pipeline_num_layers,
        embedding=p.account_for_embedding_in_pipeline_split,
        loss=p.account_for_loss_in_pipeline_split,
    )
    errors += llama_option_violations(m, p.tp)
    errors += train_violations(t) + profile_violations(t, world_size)
    if not errors:
        errors += schedule_violations(p, m.num_layers, t.global_batch_size // (t.micro_batch_size * dp))
    split = None if errors else p.pipeline_split(m.num_layers)
    errors += recompute_violations(m, None if split is None else split.chunk_layers)
    errors += sequence_parallel_violations(m, p.tp, p.sequence_parallel)
    errors += data_parallel_violations(p) + grad_reduce_violations(p, m.params_dtype)
    errors += context_parallel_violations(m.seq_length, p.context_parallel_size)
    errors += context_parallel_model_violations(m, p.context_parallel_size, p.tp, p.sequence_parallel)
    errors += sharding_violations(p) + sharded_params_violations(p)
    errors += checkpoint_violations(config.checkpoint)
    errors += launch_violations(config.launch)
    errors += model_option_violations(m)
    errors += moe_violations(
        config.moe,
        num_layers=m.num_layers,
        ffn=m.ffn,
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        etp=p.etp,
        world_size=world_size,
        sequence_parallel=p.sequence_parallel,
        dispatcher=p.moe_token_dispatcher_type,
        linear_biases=m.add_bias_linear,
    )
    errors += _moe_not_yet(config) + untrained_schedule_violations(p, m.tied) + fp8_violations(config.fp8)
    if not 0 < config.data.valid_fraction < 1:
        errors.append(V("option", f"valid_fraction={config.data.valid_fraction} must be in (0, 1)"))
    if config.data.eod_token is not None and (config.data.tokenizer_model is None or not config.data.eod_token):
        if config.data.tokenizer_model is None:
            what = "needs --tokenizer-model (ptdp's own tokenizer ends documents with <|endoftext|>)"
        else:
            what = "is empty: name the tokenizer's end-of-document token"
        errors.append(V("option", f"eod_token={config.data.eod_token!r} {what}"))
    if p.distributed_timeout_minutes <= 0:
        errors.append(V("option", f"distributed_timeout_minutes={p.distributed_timeout_minutes} must be > 0"))
    raise_violations(errors)
    return dataclasses.replace(
        config,
        parallel=dataclasses.replace(
            p,
            data_parallel_size=dp,
            pipeline_schedule=p.schedule,
            use_distributed_optimizer=p.sharding_strategy != "no_shard",
        ),
        model=dataclasses.replace(m, ffn_hidden_size=m.ffn, **_recompute_defaults(m)),
        pipeline_split=split,
    )


def _moe_not_yet(config: Config) -> list[Violation]:
    """The MoE settings ``ptdp train`` does not run yet, each named."""
    if not config.moe.enabled:
        return []
    missing = [
        (config.model.compile, "--compile", ""),
        (
            config.parallel.moe_token_dispatcher_type == "flex",
            "--moe-token-dispatcher-type flex",
            " (alltoall or allgather; ptdp plan plans flex)",
        ),
    ]
    return [
        V("moe", f"{what} with --num-experts: ptdp train does not run it yet{hint}") for on, what, hint in missing if on
    ]


def _sizes(config: Config, world_size: int) -> dict[str, object]:
    p, m, t = config.parallel, config.model, config.train
    sizes: dict[str, object] = {
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "context_parallel_size": p.context_parallel_size,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "ffn_hidden_size": m.ffn,
        "seq_length": m.seq_length,
        "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "train_iters": t.train_iters,
        "log_interval": t.log_interval,
        "eval_interval": t.eval_interval,
        "world_size": world_size,
    }
    if p.data_parallel_size is not None:
        sizes["data_parallel_size"] = p.data_parallel_size
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(p, name) is not None:
            sizes[name] = getattr(p, name)
    return sizes


def _floats(config: Config) -> dict[str, object]:
    t, m = config.train, config.model
    return {
        "lr": t.lr,
        "min_lr": t.min_lr,
        "weight_decay": t.weight_decay,
        "adam_beta1": t.adam_beta1,
        "adam_beta2": t.adam_beta2,
        "adam_eps": t.adam_eps,
        "clip_grad": t.clip_grad,
        "init_method_std": m.init_method_std,
        "layernorm_epsilon": m.layernorm_epsilon,
        "rotary_base": m.rotary_base,
        "hidden_dropout": m.hidden_dropout,
        "attention_dropout": m.attention_dropout,
        "valid_fraction": config.data.valid_fraction,
        "distributed_timeout_minutes": config.parallel.distributed_timeout_minutes,
    }


def _resolve_dp(p: ParallelConfig, world_size: int, errors: list[Violation]) -> int:
    """dp = world_size / (tp * cp * pp) (rule: world_size = tp * cp * pp * dp); cp is left out of
    the messages when it is 1."""
    tp, pp, cp = p.tp, p.pp, p.cp if isinstance(p.cp, int) and p.cp >= 1 else 1
    names, values = ("tp*pp", f"{tp}*{pp}") if cp == 1 else ("tp*cp*pp", f"{tp}*{cp}*{pp}")
    rule = "world_size = tp * pp * dp" if cp == 1 else "world_size = tp * cp * pp * dp"
    model_parallel = tp * cp * pp
    if p.data_parallel_size is None:
        if world_size % model_parallel != 0:
            errors.append(
                V(
                    "world size",
                    f"world_size={world_size} is not divisible by {names}={values}={model_parallel} (rule: {rule})",
                )
            )
            return 1
        return world_size // model_parallel
    dp = p.data_parallel_size
    if model_parallel * dp != world_size:
        errors.append(
            V(
                "world size",
                f"world_size={world_size} != {names}*dp = {values}*{dp} = {model_parallel * dp} (rule: {rule})",
            )
        )
    return dp


def local_world_size(config: Config, gpus: int | None = None) -> int:
    """Workers ``ptdp train`` starts on this machine: ``--nproc-per-node``, else tp x cp x pp x dp
    when dp is given, else the machine's default (``gpus`` with GPUs, else
    :data:`DEFAULT_LOCAL_WORKERS`) when tp x cp x pp divides it, else tp x cp x pp.

    ``gpus``: the GPUs this process sees (``torch.cuda.device_count()``), None without CUDA; each
    worker drives one of them.

    Raises:
        ConfigError: a bad ``--nproc-per-node``, or more workers than ``gpus`` (naming both).
    """
    launch, p = config.launch, config.parallel
    raise_violations(launch_violations(launch))
    nproc = _requested_workers(config, gpus if gpus else DEFAULT_LOCAL_WORKERS)
    if gpus is not None and nproc > gpus:
        why = (
            "--nproc-per-node"
            if launch.nproc_per_node is not None
            else "tp x cp x pp x dp"
            if p.data_parallel_size is not None
            else "tp x cp x pp"
        )
        raise_violations(
            [
                V(
                    "workers <= gpus",
                    f"{nproc} local workers ({why}) but this machine shows only "
                    f"{gpus} GPU(s) (torch.cuda.device_count(), which CUDA_VISIBLE_DEVICES limits): each "
                    f"worker needs a GPU of its own; ask for at most {gpus} workers (--nproc-per-node, a "
                    f"smaller layout) or use torchrun across machines",
                    workers=nproc,
                    gpus=gpus,
                )
            ]
        )
    return nproc


def _requested_workers(config: Config, default: int) -> int:
    launch, p = config.launch, config.parallel
    if launch.nproc_per_node is not None:
        return launch.nproc_per_node
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if p.data_parallel_size is not None:
        return model_parallel * p.data_parallel_size
    if model_parallel > 0 and default % model_parallel == 0:
        return default
    return model_parallel


def _recompute_defaults(m: ModelConfig) -> dict:
    """Full recompute without a method or count: uniform, one layer per group."""
    if m.recompute_granularity != "full":
        return {}
    method = m.recompute_method or "uniform"
    return {
        "recompute_method": method,
        "recompute_num_layers": m.recompute_num_layers or (1 if method == "uniform" else None),
    }


__all__ = ["local_world_size", "resolve"]
