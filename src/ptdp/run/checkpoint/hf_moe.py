"""Hugging Face interop of MoE layers: the router and experts of ``MixtralForCausalLM`` and
``Qwen3MoeForCausalLM`` layers against ptdp's :class:`~ptdp.engine.moe.layer.MoELayer`, and the
routing both families can express.

ptdp stores one MoE layer i as ``layers.i.mlp.router`` ``[E, h]`` (Hugging Face's ``gate``) and
the stacked experts ``layers.i.mlp.experts.fc1_weight`` ``[E, 2, f, h]`` (each expert's gate,
then up rows) and ``fc2_weight`` ``[E, h, f]`` (``down``). Hugging Face folders hold them per expert,
as ``save_pretrained`` writes them (:class:`ExpertNames`: Mixtral's ``block_sparse_moe.experts.e.w1
/ w3 / w2``, Qwen3-MoE's ``mlp.experts.e.gate_proj / up_proj / down_proj``); an import also takes
the fused form of transformers' modules (``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` ``[E, 2
f, h]`` with gate rows first, ``mlp.experts.down_proj`` ``[E, h, f]``), which is ptdp's stacking.

Routing (both families): a softmax over the E router logits, the top k, their probabilities
renormalised to sum 1 (ptdp's default: a softmax over the k chosen logits, the same numbers) or,
Qwen3-MoE's ``norm_topk_prob=false``, not renormalised (ptdp's ``--moe-router-pre-softmax``).
Both run every token through its experts (dropless): a checkpoint trained with a capacity
exports as the dropless model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ptdp.config.moe import MoEConfig
from ptdp.run.checkpoint.folders import CheckpointError


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's per-expert tensors of layer i are: ``model.layers.i.<block>.gate.weight``
    (the router) and ``model.layers.i.<block>.experts.<e>.<gate | up | down>.weight``."""

    block: str
    gate: str
    up: str
    down: str


MIXTRAL = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN3_MOE = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


def routing_problems(moe: MoEConfig, *, renormalised_only: bool) -> list[str]:
    """The MoE options neither family has, each named with its value (``renormalised_only``:
    Mixtral, which always renormalises the top-k probabilities)."""
    found = {
        "moe_router_score_function": (moe.moe_router_score_function, moe.moe_router_score_function != "softmax"),
        "moe_router_topk_scaling_factor": (
            moe.moe_router_topk_scaling_factor,
            moe.moe_router_topk_scaling_factor not in (None, 1.0),
        ),
        "moe_router_num_groups": (moe.moe_router_num_groups, moe.moe_router_num_groups is not None),
        "moe_router_enable_expert_bias": (moe.moe_router_enable_expert_bias, moe.moe_router_enable_expert_bias),
        "moe_router_force_load_balancing": (moe.moe_router_force_load_balancing, moe.moe_router_force_load_balancing),
        "moe_shared_expert_intermediate_size": (moe.moe_shared_expert_intermediate_size, moe.shared_ffn > 0),
        "moe_router_pre_softmax": (moe.moe_router_pre_softmax, renormalised_only and moe.moe_router_pre_softmax),
    }
    return [f"{name}={value!r}" for name, (value, refused) in found.items() if refused]


def moe_layer_freq(layers: list[bool]) -> tuple[int, ...]:
    """``--moe-layer-freq`` for these MoE (True) and dense layers: ``(1,)`` when all are MoE."""
    return (1,) if all(layers) else tuple(int(on) for on in layers)


def experts_to_hf(names: ExpertNames, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ptdp's stored MoE layer ``i`` -> the family's per-expert tensors (Raises CheckpointError for
    expert biases, which neither family has)."""
    if f"layers.{i}.mlp.experts.fc1_bias" in tensors:
        raise CheckpointError("the experts have biases: Mixtral and Qwen3-MoE experts have none")
    pre = f"model.layers.{i}.{names.block}."
    fc1, fc2 = tensors[f"layers.{i}.mlp.experts.fc1_weight"], tensors[f"layers.{i}.mlp.experts.fc2_weight"]
    fc1 = fc1.reshape(fc1.shape[0], -1, fc1.shape[-1])  # stored [E, 2, f, h]: [gate | up] per expert
    f = fc2.shape[-1]
    hf = {pre + "gate.weight": tensors[f"layers.{i}.mlp.router"]}
    for e in range(fc1.shape[0]):
        hf[f"{pre}experts.{e}.{names.gate}.weight"] = fc1[e, :f]
        hf[f"{pre}experts.{e}.{names.up}.weight"] = fc1[e, f:]
        hf[f"{pre}experts.{e}.{names.down}.weight"] = fc2[e]
    return hf


def experts_from_hf(
    names: ExpertNames,
    i: int,
    take: Callable[..., torch.Tensor],
    has: Callable[[str], bool],
    *,
    experts: int,
    ffn: int,
    hidden: int,
) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts as ptdp stores them, from the per-expert tensors or the
    fused ones (module docstring). ``take(name, *shape)`` returns a tensor, checking its shape;
    ``has(name)``: the folder holds it."""
    e, f, h = experts, ffn, hidden
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
    if has(fused):
        pre = f"model.layers.{i}.mlp."
        fc1, fc2 = take(fused, e, 2 * f, h), take(pre + "experts.down_proj", e, h, f)
    else:
        pre = f"model.layers.{i}.{names.block}."
        gate = [take(f"{pre}experts.{j}.{names.gate}.weight", f, h) for j in range(e)]
        up = [take(f"{pre}experts.{j}.{names.up}.weight", f, h) for j in range(e)]
        fc1 = torch.cat((torch.stack(gate), torch.stack(up)), dim=1)
        fc2 = torch.stack([take(f"{pre}experts.{j}.{names.down}.weight", h, f) for j in range(e)])
    return {
        f"layers.{i}.mlp.router": take(pre + "gate.weight", e, h),
        f"layers.{i}.mlp.experts.fc1_weight": fc1.contiguous().view(e, 2, f, h),
        f"layers.{i}.mlp.experts.fc2_weight": fc2.contiguous(),
    }
