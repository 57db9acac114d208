"""FP8 weight GEMMs: the weights' FP8 copies, and the checks of ``ptdp plan --fp8-format``.

``ptdp train --fp8-format`` runs the forward, input-gradient and weight-gradient GEMMs of each
layer's QKV, projection, fc1 and fc2 in FP8 (Micikevicius et al., "FP8 Formats for Deep
Learning", arXiv:2209.05433; e4m3, or hybrid: e5m2 output gradients) under ``--fp8-recipe``
(:data:`~ptdp.planner.candidate.FP8_RECIPES`); the embedding, output layer, norms, attention,
main weights, gradients and optimizer state keep their dtypes. Each of those weights has an FP8
copy and its transpose, kept from their first use until the step ends (:data:`FP8_WEIGHT_COPY_BYTES`,
every layer of the stage). What the layers keep for backward: :mod:`ptdp.planner.memory.activations`;
the GEMMs' time: :mod:`ptdp.planner.time.flops`.

Precision "fp8" without a recipe plans Transformer Engine's FP8 as Megatron-Core runs it (delayed
scaling; the published runs). With ``--fp8-param-gather`` (Megatron-LM's flag; Transformer
Engine's ``fp8_model_init``; planner only) those weights are FP8 tensors themselves: 1 byte each,
no copy, the transpose made when backward needs it (``keep_fp8_transpose_cache`` off), the fp32
main parameters in the optimizer as before; the parameter all-gathers (distributed optimizer,
ZeRO-3) move those weights in 1 byte. Under ZeRO-3, whose shards are float32, both apply to the
gathered layers only.
"""

from __future__ import annotations

from ptdp.config.model import ModelConfig
from ptdp.errors import ConfigError
from ptdp.planner.inputs.moe_model import moe_layer_share, moe_of
from ptdp.planner.memory.moe_params import mlp_param_count

#: Bytes per weight of an FP8 GEMM held besides the bf16 weight: the FP8 weight (1) and its
#: transpose (1).
FP8_WEIGHT_COPY_BYTES = 2.0


def check_fp8_param_gather(precision: str) -> None:
    """ConfigError for ``--fp8-param-gather`` without ``--fp8``."""
    if precision != "fp8":
        raise ConfigError(
            f"--fp8-param-gather keeps the FP8 GEMMs' weights in FP8: it needs --fp8 (the precision is {precision})"
        )


def fp8_precision(gpu, precision: str) -> str:
    """``"fp8"`` for ``--fp8`` on ``gpu`` (a :class:`~ptdp.planner.inputs.hardware.GPUType`) at the
    requested ``precision``; ConfigError when the GPU has no FP8 peak in the catalog (A100, V100)
    or the precision is not bf16 (FP8 training keeps bf16 activations and weights)."""
    if "fp8" not in gpu.peak_flops:
        raise ConfigError(
            f"--fp8: {gpu.name} has no FP8 tensor cores (its catalog peaks: "
            f"{', '.join(sorted(gpu.peak_flops))}); FP8 training needs an H100/H200-class GPU"
        )
    if precision != "bf16":
        raise ConfigError(
            f"--fp8 plans bf16 training with FP8 GEMMs; the requested precision is {precision} "
            f"(drop --fp16/--fp32 or give --bf16)"
        )
    return "fp8"


def fp8_recipe_planned(
    model: ModelConfig, precision: str, recipe: str | None, *, param_gather: bool = False
) -> tuple[str | None, list[str]]:
    """The recipe a plan models at ``precision`` for ``--fp8-recipe`` ``recipe`` (None: not given)
    and its notes: ``ptdp train``'s (default delayed, as it runs) for a dense model, and for a
    mixture of experts when ``recipe`` is given; None, Transformer Engine's FP8 as Megatron-Core runs
    it, for a mixture of experts without one (the published runs) or FP8 weights
    (``--fp8-param-gather``); None without FP8."""
    if precision != "fp8":
        return None, []
    if not param_gather and (moe_of(model) is None or recipe is not None):
        notes = []
        if moe_of(model) is not None:
            notes.append(
                f"FP8 experts planned as ptdp train runs them ({recipe}): forward and input-gradient GEMMs in "
                "FP8 with per-token activation scales, weight gradients and kept inputs in bf16"
            )
        if recipe == "blockwise":
            notes.append(
                "blockwise FP8 is planned emulated, as the float32 (TF32) GEMMs of the dequantised "
                "operands with their dequantisation passes: ptdp train uses a kernel for its 1x128 and "
                "128x128 tile scales only where its torch has one (cuBLAS 12.9 on Hopper)"
            )
        return recipe or "delayed", notes
    why = (
        "--fp8-param-gather"
        if param_gather
        else "a mixture of experts (as the published runs; --fp8-recipe plans ptdp train's FP8 experts)"
    )
    note = f"FP8 planned as Transformer Engine runs it under Megatron-Core (delayed scaling) for {why}"
    return None, [f"{note}; --fp8-recipe {recipe} not modelled" if recipe else note]


def check_fp8_flags(given: dict[str, object], precision: str) -> None:
    """ConfigError for FP8 options (``given``: flag name to value, None when not given) without
    ``--fp8-format``, as ``ptdp train`` refuses them."""
    named = [f"--{name.replace('_', '-')} {value}" for name, value in given.items() if value is not None]
    if named and precision != "fp8":
        raise ConfigError(
            f"{', '.join(named)} without --fp8-format: no GEMM runs in FP8 (give --fp8-format e4m3 or hybrid)"
        )


def layer_fp8_weights(model: ModelConfig, tp: int, *, ep: int = 1, etp: int = 1, experts: bool = False) -> float:
    """Weights of one layer's FP8 GEMMs on one tp rank: QKV ``(a + 2 kv) d h / t``, projection
    ``a d h / t``, fc1 ``n ffn h / t`` (n = 2 for SwiGLU), fc2 ``ffn h / t``. With ``experts`` (``ptdp
    train``'s FP8 of a planned MoE model, the mean over its layers) an MoE layer's MLP is the shared
    expert's (width ``S`` over tp) and the rank's ``E / ep`` experts' ``(n + 1) F h / etp``."""
    h, a = model.hidden_size, model.num_attention_heads
    d, kv = model.head_dim, model.kv_heads
    attention = ((a + 2 * kv) * d * h + a * d * h) // tp
    dense = mlp_param_count(model, model.ffn, tp, ())
    moe = moe_of(model)
    if not experts or moe is None:
        return attention + dense
    routed = (moe.num_experts or 0) // ep * mlp_param_count(model, moe.expert_ffn(model.ffn), etp, ())
    shared = mlp_param_count(model, moe.shared_ffn or 0, tp, ())
    share = moe_layer_share(model)
    return attention + (1.0 - share) * dense + share * (routed + shared)


def fp8_weight_copy_bytes(
    model: ModelConfig,
    tp: int,
    layers: int,
    fp8: bool,
    *,
    param_gather: bool = False,
    shard: int = 1,
    ep: int = 1,
    etp: int = 1,
    experts: bool = False,
) -> float:
    """Bytes the FP8 GEMMs' weights add on one tp rank of a stage of ``layers`` layers beyond their
    own (0 without ``fp8``): the FP8 copies, or with ``param_gather`` (FP8 weights) minus the byte
    each saves, over ``shard`` ranks when the weights are sharded; ``experts``: an MoE model's
    experts' copies as ``ptdp train`` keeps them (:func:`layer_fp8_weights`)."""
    if not fp8:
        return 0.0
    weights = layers * layer_fp8_weights(model, tp, ep=ep, etp=etp, experts=experts)
    return -weights / shard if param_gather else FP8_WEIGHT_COPY_BYTES * weights
