"""A ``ptdp plan`` request from its option values: the model, the cluster, the batch, the
choices fixed and what the run does that ``ptdp train`` does not (:mod:`ptdp.planner.run_options`),
each checked (``ConfigError`` naming the rule) before any search. The values are those of ``ptdp plan``'s flags by destination
(:mod:`ptdp.planner.inputs.plan_flags`), from its command line or from :func:`ptdp.plan`'s keywords.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.rules.moe import moe_violations
from ptdp.errors import ConfigError
from ptdp.layout.pipeline.partition import stage_layer_counts, virtual_stages
from ptdp.planner.candidate import MOE_RECOMPUTE_MODULES, OP_SAC, RECOMPUTE_MODULES
from ptdp.planner.inputs.hardware import CATALOG, Cluster, GiB, GPUType, get_gpu, load_catalog, runs_flash_attention
from ptdp.planner.inputs.hf_config import hf_model_name, is_config_path, load_hf_config
from ptdp.planner.inputs.models import (
    MOE_PRESETS,
    PRESETS,
    PUBLISHED_BATCH,
    get_model,
    gpt,
    preset_name,
    published_batch,
    token_budget_batch,
)
from ptdp.planner.inputs.moe_model import MoEModel, moe_of, with_moe, with_mtp
from ptdp.planner.inputs.plan_flags import plan_precision
from ptdp.planner.memory.fp8 import check_fp8_flags, check_fp8_param_gather, fp8_precision, fp8_recipe_planned
from ptdp.planner.report.explain import distance_from_best, explain_experts, explain_pick
from ptdp.planner.run_options import run_option_constants
from ptdp.planner.search.checks import (
    check_fixed_choices,
    check_model,
    check_output_path,
    check_request,
    check_stage_layers,
    ineffective_flag_notes,
)
from ptdp.planner.search.layouts import Fixed, SearchResult, search
from ptdp.planner.splits import layout_split
from ptdp.planner.time.constants import DEFAULT_CONSTANTS, PerfConstants

#: The model flags ``ptdp plan`` shares with ``ptdp train``: they change the preset's shape.
_SHAPE_FLAGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "vocab_size",
    "seq_length",
    "num_query_groups",
    "kv_channels",
    "qk_layernorm",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "kv_repeated",
    "add_bias_linear",
)


def model_from_args(
    args: argparse.Namespace, gpu: GPUType | None = None, base: ModelConfig | None = None
) -> tuple[ModelConfig, list[str]]:
    """The model ``--model`` names (a preset, or a Hugging Face config.json file or folder), or
    ``base``, with any shape flags applied, or a GPT from the flags alone
    (:func:`~ptdp.planner.inputs.models.gpt`); and notes on what a config holds that the planner
    does not model. Attention kernel: ``--use-flash-attn`` / ``--no-use-flash-attn`` when given, else
    the model's, made flash on H100/H200-class ``gpu``
    (:func:`~ptdp.planner.inputs.hardware.runs_flash_attention`).
    """
    overrides = {name: getattr(args, name) for name in _SHAPE_FLAGS if getattr(args, name) is not None}
    notes: list[str] = []
    if base is not None:
        model = base
    elif args.model and is_config_path(args.model):
        model, notes = load_hf_config(args.model, seq_length=args.seq_length)
    elif args.model and (args.model.endswith(".json") or "/" in args.model):
        raise ConfigError(
            f"--model {args.model}: no such file or folder (a Hugging Face config.json, or a preset "
            "name such as llama3-8b)"
        )
    elif args.model:
        model = get_model(args.model)
    else:
        missing = [
            f"--{f.replace('_', '-')}"
            for f in ("num_layers", "hidden_size", "num_attention_heads")
            if f not in overrides
        ]
        if missing:
            raise ConfigError(f"give --model NAME or the model shape: missing {', '.join(missing)}")
        model = gpt(**overrides)
    flash = getattr(args, "use_flash_attn", None)
    if flash is None:
        flash = model.flash_attention or (gpu is not None and runs_flash_attention(gpu))
    model, moe_notes = with_moe_flags(dataclasses.replace(model, **overrides, use_flash_attn=flash), args)
    return model, [*notes, *moe_notes]


def with_moe_flags(model: ModelConfig, args: argparse.Namespace) -> tuple[ModelConfig, list[str]]:
    """``model`` with the MoE flags given (``--num-experts`` makes a dense model an MoE one) and
    ``--moe-load-imbalance``, checked by ``ptdp train``'s MoE rules (those of the model alone; the
    layout's are the search's); and a note naming what ``ptdp train`` does not build of it.
    ConfigError naming the rule."""
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(MoEConfig) if getattr(args, f.name, None) is not None
    }
    if isinstance(model, MoEModel):
        model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, **given))
    elif given:
        model = with_moe(model, MoEConfig(**given))
    moe = model.moe if isinstance(model, MoEModel) else MoEConfig(**given)
    broken = moe_violations(
        moe, num_layers=model.num_layers, ffn=model.ffn, tp=1, pp=1, ep=1, etp=1, world_size=1, sequence_parallel=True
    )
    if broken:
        raise ConfigError("; ".join(v.message for v in broken))
    mtp = getattr(args, "mtp_num_layers", None)
    if mtp is not None:
        if mtp < 0:
            raise ConfigError(f"--mtp-num-layers {mtp} must be >= 0")
        base = model if isinstance(model, MoEModel) else with_moe(model, MoEConfig(), mtp_layers=0)
        model = with_mtp(base, mtp)  # type: ignore[arg-type]
    rho = getattr(args, "moe_load_imbalance", None)
    if rho is not None:
        if not isinstance(model, MoEModel) or not model.moe.enabled:
            raise ConfigError(f"--moe-load-imbalance {rho:g} needs a mixture-of-experts model (--num-experts)")
        experts = model.moe.num_experts or 1
        if not 1.0 <= rho <= experts:
            raise ConfigError(
                f"--moe-load-imbalance {rho:g} must be in [1, {experts}] (the busiest expert rank's tokens over "
                f"the balanced share; no rank receives more than every token, E = {experts} shares)"
            )
        model = dataclasses.replace(model, load_imbalance=rho)
    notes = []
    if isinstance(model, MoEModel) and model.plan_only:
        notes.append(
            f"{' and '.join(model.plan_only)} planned (FLOPs, parameters, activations, memory): ptdp train "
            "does not build them yet"
        )
    return model, notes


def model_name(args: argparse.Namespace, base: ModelConfig | None = None) -> str:
    """The name :func:`model_from_args`'s model is reported under: a preset's (its first name),
    ``hf:FOLDER`` for a Hugging Face config, else ``custom`` (``base``: a preset's when it is one)."""
    if base is not None:
        return next((name for name, preset in {**PRESETS, **MOE_PRESETS}.items() if preset == base), "custom")
    if args.model and is_config_path(args.model):
        return hf_model_name(args.model)
    return preset_name(args.model) if args.model else "custom"


def _hardware(args: argparse.Namespace):
    """The GPU and performance constants: a calibrated profile, or a catalog GPU with the defaults."""
    if args.hardware_profile:
        from ptdp.planner.time.profile import load_profile

        if getattr(args, "gpu_power_limit", None) is not None:
            raise ConfigError("--gpu-power-limit applies to a catalog GPU, not to a measured --hardware-profile")

        try:
            return load_profile(args.hardware_profile)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    try:
        catalog = load_catalog(args.gpu_catalog) if args.gpu_catalog else CATALOG
    except (OSError, ValueError) as e:
        raise ConfigError(f"--gpu-catalog {args.gpu_catalog}: {e}") from None
    gpu = get_gpu(args.gpu, catalog)
    watts = getattr(args, "gpu_power_limit", None)
    if watts is not None:
        if not watts > 0:  # 0 would mean the datasheet's rating; NaN compares false
            raise ConfigError(f"--gpu-power-limit {watts:.10g} must be a positive number of watts")
        try:
            gpu = dataclasses.replace(gpu, power_limit=watts)
        except ValueError as e:
            raise ConfigError(f"--gpu-power-limit {watts:.10g}: {e}") from None
    return gpu, DEFAULT_CONSTANTS


def _apply_topology(gpu, args: argparse.Namespace):
    """The GPU as installed in ``--topology FILE``'s node (see :mod:`ptdp.planner.inputs.node_links`)."""
    if not args.topology:
        return gpu, []
    from ptdp.planner.inputs.node_links import gpu_for_topology
    from ptdp.topology.nvsmi import parse_nvidia_smi_topo

    try:
        text = Path(args.topology).read_text(encoding="utf-8", errors="replace")
        gpu, notes = gpu_for_topology(gpu, parse_nvidia_smi_topo(text, source=args.topology))
    except OSError as e:
        raise ConfigError(f"--topology {args.topology}: {e.strerror or e}") from None
    except ValueError as e:  # TopologyError included
        raise ConfigError(f"--topology {args.topology}: {e}") from None
    if args.gpus_per_node is not None and args.gpus_per_node != gpu.gpus_per_node:
        raise ConfigError(
            f"--gpus-per-node={args.gpus_per_node} contradicts --topology {args.topology}, "
            f"which has {gpu.gpus_per_node} GPUs per node"
        )
    return gpu, notes


#: The flags that place layers on stages, which a Megatron-Core layout replaces
SPLIT_FLAGS = (
    ("--pipeline-layer-split", "pipeline_layer_split"),
    ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
    ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
    ("--account-for-embedding-in-pipeline-split", "account_for_embedding_in_pipeline_split"),
    ("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split"),
    ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"),
)


def layout_as_split(args: argparse.Namespace, model: ModelConfig) -> tuple[argparse.Namespace, list[str]]:
    """``args`` with Megatron-Core's ``--pipeline-model-parallel-layout`` (planner only) replaced by
    the flags that plan it (:func:`~ptdp.planner.splits.layout_split`: v, the embedding and the loss
    counted as layers, or at v = 1 the split), and a note where an uneven interleaved layout is
    planned as the nearest even one. ConfigError for a layout without
    ``--pipeline-model-parallel-size``, with the other flags that place layers, or breaking a rule."""
    text = getattr(args, "pipeline_model_parallel_layout", None)
    if text is None:
        return args, []
    given = [flag for flag, dest in SPLIT_FLAGS if getattr(args, dest, None) is not None]
    if given:
        raise ConfigError(f"--pipeline-model-parallel-layout places the layers itself: drop {', '.join(given)}")
    pp = args.pipeline_model_parallel_size
    if pp is None:
        raise ConfigError(
            "--pipeline-model-parallel-layout needs --pipeline-model-parallel-size (its segments are the "
            "pp x v model chunks)"
        )
    mtp = model.mtp_layers if isinstance(model, MoEModel) else 0
    try:
        v, split, (embedding, loss), nearest = layout_split(
            text, model.num_layers, mtp, pp, args.virtual_pipeline_model_parallel_size
        )
    except ValueError as e:
        raise ConfigError(f"--pipeline-model-parallel-layout {text}: {e}") from None
    out = argparse.Namespace(**vars(args))
    out.virtual_pipeline_model_parallel_size = v
    out.pipeline_layer_split = split
    out.account_for_embedding_in_pipeline_split = True if embedding else None
    out.account_for_loss_in_pipeline_split = True if loss else None
    if nearest is None:
        return out, []
    return out, [
        f"--pipeline-model-parallel-layout {text} planned as {nearest}: the planner splits interleaved model "
        "chunks evenly (the nearest such layout, fewest layers moved)"
    ]


def fixed_from_args(args: argparse.Namespace) -> Fixed:
    """The settings the flags fix (each :class:`Fixed` field is a flag's destination). ConfigError
    when --data-parallel-sharding-strategy contradicts --use-distributed-optimizer."""
    strategy, dopt = args.data_parallel_sharding_strategy, args.use_distributed_optimizer
    if strategy is not None and dopt is not None and dopt != (strategy != "no_shard"):
        raise ConfigError(
            f"--data-parallel-sharding-strategy {strategy} contradicts "
            f"--{'' if dopt else 'no-'}use-distributed-optimizer (which means "
            f"{'optim' if dopt else 'no_shard'}): give one"
        )
    return Fixed(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Fixed)})


def _recompute_modules(fixed: Fixed, model: ModelConfig) -> Fixed:
    """``--recompute-modules``: selective recompute of those modules (ConfigError for another
    granularity, an unknown module, or an MoE / MLA one of a model without MoE layers / MLA)."""
    modules = tuple(dict.fromkeys(fixed.recompute_modules or ()))
    has = {
        "moe_act": moe_of(model) is not None,
        "moe": moe_of(model) is not None,
        "shared_experts": moe_of(model) is not None and moe_of(model).shared_ffn > 0,  # type: ignore[union-attr]
        "mla_up_proj": isinstance(model, MoEModel) and model.mla is not None,
    }
    missing = [m for m in modules if m in MOE_RECOMPUTE_MODULES and not has[m]]
    if missing:
        raise ConfigError(
            f"--recompute-modules {' '.join(missing)}: the model has no "
            + ", ".join(
                {
                    "moe_act": "MoE layers",
                    "moe": "MoE layers",
                    "shared_experts": "shared expert",
                    "mla_up_proj": "multi-head latent attention",
                }[m]
                for m in missing
            )
        )
    known = (*RECOMPUTE_MODULES, *MOE_RECOMPUTE_MODULES)
    unknown = [m for m in modules if m not in known]
    if unknown:
        raise ConfigError(f"--recompute-modules {' '.join(unknown)}: unknown (known: {', '.join(known)})")
    if fixed.recompute_granularity not in (None, "selective"):
        raise ConfigError(
            f"--recompute-modules chooses what selective recompute runs again: it needs "
            f"--recompute-granularity selective, not {fixed.recompute_granularity}"
        )
    return dataclasses.replace(fixed, recompute_granularity="selective", recompute_modules=modules)


def _op_sac(fixed: Fixed) -> Fixed:
    """``--selective-ac-option op``: the recompute planned is torchtitan's per-op checkpointing
    (:data:`~ptdp.planner.candidate.OP_SAC`); ConfigError unless the granularity is selective."""
    if fixed.recompute_modules is not None:
        raise ConfigError("--selective-ac-option op (torchtitan's) and --recompute-modules (Megatron-Core's): give one")
    if fixed.recompute_granularity not in (None, "selective"):
        raise ConfigError(
            f"--selective-ac-option op is a kind of selective checkpointing: it needs "
            f"--recompute-granularity selective, not {fixed.recompute_granularity}"
        )
    return dataclasses.replace(fixed, recompute_granularity=OP_SAC)


def _counted_chunks_as_v(fixed: Fixed, num_layers: int) -> Fixed:
    """With the embedding and/or loss counted as layers and pp fixed,
    ``--num-layers-per-virtual-pipeline-stage N`` means ``v = (layers + counted) / (pp N)``, as
    ``ptdp train`` reads it (the flags the report prints can be given back); ``fixed`` unchanged
    otherwise."""
    counted, per_chunk, pp = fixed.accounting, fixed.num_layers_per_virtual_pipeline_stage, fixed.pp
    if counted and any(counted) and per_chunk and pp and fixed.virtual_pipeline_model_parallel_size is None:
        if (num_layers + sum(counted)) % (pp * per_chunk) == 0:
            v = virtual_stages(num_layers, pp, per_chunk, sum(counted))
            return dataclasses.replace(
                fixed, virtual_pipeline_model_parallel_size=v, num_layers_per_virtual_pipeline_stage=None
            )
    return fixed


def _explanation(
    result: SearchResult, free: SearchResult | None, gpus_per_node: int = 8, *, experts: bool = True
) -> list[str]:
    """Why the best plan beats the runner-up (with ``experts``, where their exchanges run and why,
    :func:`~ptdp.planner.report.explain.explain_experts`) and, when the user fixed choices (``free``:
    the search with nothing fixed), how far the best plan under them is from the best found."""
    lines = explain_pick(result.plans)
    if experts:
        lines += explain_experts(result.plans, result.rejected, gpus_per_node)
    if free is not None:
        lines += distance_from_best(result.plans[0] if result.plans else None, free.plans[0] if free.plans else None)
    return lines


@dataclasses.dataclass
class PlanRequest:
    """A ``ptdp plan`` search request, checked: what :func:`prepare` builds from the flags."""

    name: str
    """The model's name in reports (a preset's, ``hf:FOLDER``, or ``custom``)."""
    model: ModelConfig
    cluster: Cluster
    global_batch_size: int
    fixed: Fixed
    precision: str
    constants: PerfConstants
    overhead: float | None
    notes: list[str]
    global_batch_source: str = "--global-batch-size"
    """Where ``global_batch_size`` came from: the flag, or the preset's published batch."""

    def search(self, *, fixed: Fixed | None = None) -> SearchResult:
        return search(
            self.model,
            self.cluster,
            self.global_batch_size,
            fixed=self.fixed if fixed is None else fixed,
            precision=self.precision,
            constants=self.constants,
            overhead_bytes=self.overhead,
        )

    def explanation(self, result: SearchResult) -> list[str]:
        """:func:`_explanation`, with the free search run when choices are fixed."""
        unfixed = Fixed(fp8_recipe=self.fixed.fp8_recipe)  # the recipe is the request's, as its precision
        free = self.search(fixed=unfixed) if self.fixed != unfixed else None
        return _explanation(result, free, self.cluster.gpus_per_node, experts=moe_of(self.model) is not None)


def prepare(args: argparse.Namespace, model: ModelConfig | None = None) -> PlanRequest:
    """Check the flags of a search and build its model, cluster and fixed choices (``model``: use
    this one instead of ``--model``, the shape flags applied to it). Raises ConfigError naming the rule."""
    if args.gpus is None:
        if args.global_batch_size is None:
            raise ConfigError(
                "ptdp plan needs --gpus N and --global-batch-size B, or --validate CSV, or --calibrate "
                "(B defaults to a preset's published batch)"
            )
        raise ConfigError("ptdp plan needs --gpus N (or --validate CSV, or --calibrate)")
    if args.plot:
        check_output_path(args.plot, "--plot", (".png", ".pdf", ".svg"))
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={args.gpus_per_node} must be a positive integer")
    gpu, constants = _hardware(args)
    gpu, notes = _apply_topology(gpu, args)
    if gpu.power_fraction() < 1.0:
        notes.append(
            f"{gpu.name} planned at a {gpu.power_limit:g} W power limit: {gpu.power_fraction():.3f} of its "
            "datasheet tensor-core peaks (--gpu-power-limit)"
        )
    try:
        per_node = gpu.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
        cluster = Cluster(gpu, args.gpus, per_node)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    base = model
    model, model_notes = model_from_args(args, gpu, base=base)
    name = model_name(args, base=base)  # after model_from_args, which names a bad --model
    notes = [*model_notes, *notes]
    check_model(model)
    global_batch_size, batch_source = global_batch(args.global_batch_size, name, model)
    if args.global_batch_size is None:
        notes.insert(0, f"global batch size {global_batch_size}: {batch_source} (--global-batch-size to change)")
    args, layout_notes = layout_as_split(args, model)
    notes += layout_notes
    if args.pipeline_layer_split is not None:
        stage_layer_counts(model.num_layers, len(args.pipeline_layer_split), args.pipeline_layer_split)
    fixed = _counted_chunks_as_v(fixed_from_args(args), model.num_layers)
    if fixed.recompute_modules is not None:
        fixed = _recompute_modules(fixed, model)
    if getattr(args, "selective_ac_option", None):
        fixed = _op_sac(fixed)
    check_stage_layers(model.num_layers, fixed)
    check_expert_choices(model, fixed, args)
    if getattr(args, "moe_flex_dispatcher_backend", None) and fixed.moe_token_dispatcher_type is None:
        fixed = dataclasses.replace(fixed, moe_token_dispatcher_type="flex")
    overhead = None if args.memory_overhead_gib is None else args.memory_overhead_gib * GiB
    check_request(cluster, global_batch_size, fixed, top=args.top, overhead_bytes=overhead)
    check_fixed_choices(model, global_batch_size, fixed)
    notes += ineffective_flag_notes(model, fixed)
    precision = plan_precision(args) or ("bf16" if "bf16" in gpu.peak_flops else sorted(gpu.peak_flops)[0])
    if precision not in gpu.peak_flops:
        raise ConfigError(f"{gpu.name} has no peak FLOP/s for {precision}; known: {', '.join(sorted(gpu.peak_flops))}")
    if getattr(args, "fp8_format", None) is not None:
        precision = fp8_precision(gpu, precision)
    if fixed.fp8_param_gather:
        check_fp8_param_gather(precision)
    fp8_options = ("fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")
    check_fp8_flags({name: getattr(args, name, None) for name in fp8_options}, precision)
    recipe, fp8_notes = fp8_recipe_planned(
        model, precision, getattr(args, "fp8_recipe", None), param_gather=bool(fixed.fp8_param_gather)
    )
    fixed = dataclasses.replace(fixed, fp8_recipe=recipe)
    notes += fp8_notes
    check_optimizer_dtypes(fixed, precision)
    if fixed.grad_reduce_in_bf16 and precision not in ("bf16", "fp8"):
        raise ConfigError(
            f"--grad-reduce-in-bf16 needs bf16 parameters (--bf16, or --fp8 with bf16 weights), "
            f"not {precision}: a bf16 gradient buffer holds the gradients of bf16 parameters"
        )
    constants, run_notes = run_option_constants(args, constants, model, fixed, gpu)
    notes += run_notes
    return PlanRequest(
        name, model, cluster, global_batch_size, fixed, precision, constants, overhead, notes, batch_source
    )


def check_expert_choices(model: ModelConfig, fixed: Fixed, args: argparse.Namespace) -> None:
    """ConfigError for fixed expert choices that no layout of ``model`` can run, by ``ptdp train``'s
    MoE rules that do not depend on the rest of the layout (``E % ep``, ``F % etp``, linear biases
    at etp > 1, sequence parallelism at a fixed tp > 1, ep, etp or a dispatcher without experts),
    and for the MoE options only ``ptdp plan`` has given for a dense model."""
    ep, etp = fixed.expert_model_parallel_size or 1, fixed.expert_tensor_parallel_size or 1
    moe = model.moe if isinstance(model, MoEModel) else MoEConfig()
    broken = [
        v.message
        for v in moe_violations(
            moe,
            num_layers=model.num_layers,
            ffn=model.ffn,
            tp=fixed.tp or 1,
            pp=1,
            ep=ep,
            etp=etp,
            world_size=ep * etp,
            sequence_parallel=fixed.sequence_parallel is not False,
            dispatcher=fixed.moe_token_dispatcher_type or "alltoall",
            linear_biases=model.add_bias_linear,
        )
    ]
    if not moe.enabled:
        planner_only = [
            flag
            for flag, dest in (
                ("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm"),
                ("--moe-flex-dispatcher-backend", "moe_flex_dispatcher_backend"),
            )
            if getattr(args, dest, None)
        ]
        if planner_only:
            broken.append(f"{', '.join(planner_only)} needs a mixture-of-experts model (--num-experts)")
    if broken:
        raise ConfigError("; ".join(broken))


def check_optimizer_dtypes(fixed: Fixed, precision: str) -> None:
    """ConfigError for ``--main-params-dtype`` / ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` without
    ``--use-precision-aware-optimizer``, or the precision-aware optimizer with fp32 parameters (as
    Megatron-Core refuses them)."""
    given = [
        f"--{name.replace('_', '-')} {value}"
        for name, value in (
            ("main_params_dtype", fixed.main_params_dtype),
            ("exp_avg_dtype", fixed.exp_avg_dtype),
            ("exp_avg_sq_dtype", fixed.exp_avg_sq_dtype),
        )
        if value is not None
    ]
    if given and not fixed.use_precision_aware_optimizer:
        raise ConfigError(f"{', '.join(given)} needs --use-precision-aware-optimizer")
    if fixed.use_precision_aware_optimizer and precision == "fp32":
        raise ConfigError(
            "--use-precision-aware-optimizer needs 16-bit parameters (--bf16, --fp16 or --fp8), not fp32: "
            "the optimizer keeps main parameters beside them"
        )


def global_batch(given: int | None, name: str, model: ModelConfig) -> tuple[int, str]:
    """(``--global-batch-size``, else the batch the preset ``model`` was published with, else for a
    preset without one 4M tokens per step; where it came from). ConfigError naming the flag for
    other models and a preset whose shape flags changed."""
    if given is not None:
        return given, "--global-batch-size"
    published = published_batch(name, model)
    if published is not None:
        return published[0], f"{name}'s published batch, {published[1]}"
    need = "ptdp plan needs --global-batch-size B"
    if name in PUBLISHED_BATCH:
        raise ConfigError(
            f"{need}: {name}'s published batch ({PUBLISHED_BATCH[name][0]}) is for its own "
            "shape, which the shape flags change"
        )
    if name in PRESETS or name in MOE_PRESETS:
        return token_budget_batch(name, model)
    raise ConfigError(f"{need} (or --validate CSV, or --calibrate)")
