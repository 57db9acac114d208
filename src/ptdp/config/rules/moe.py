"""The rules of mixture-of-experts options and of the expert grid (``etp x ep x edp x pp`` over the
``tp x cp x dp x pp`` ranks, Megatron-Core's parallel folding):

- ``1 <= moe_router_topk <= num_experts``; ``num_experts % ep == 0``; ``world % (etp ep pp) == 0``;
  the expert width and the shared expert's width divisible by etp and tp respectively
- ``moe_layer_freq``: one positive integer, or one 0/1 per layer with at least one 1
- group-limited routing: both sizes given, ``num_experts % num_groups == 0``,
  ``1 <= group_topk <= num_groups``, ``topk % group_topk == 0`` and ``topk / group_topk`` at most a
  group's experts
- ``--moe-router-pre-softmax`` with the softmax score function; a capacity factor > 0, needed by
  padding; coefficients and the bias update rate >= 0
- with tp > 1, sequence parallelism (each tp rank routes its own tokens; Megatron-Core's rule)
- ep or etp > 1, the allgather dispatcher and every other MoE option need ``--num-experts``; the
  drop policy needs a capacity factor, the bias update rate the expert bias
"""

from __future__ import annotations

import math

from ptdp.config.moe import MoEConfig
from ptdp.errors import V, Violation

_DEFAULTS = MoEConfig()


def moe_violations(
    moe: MoEConfig,
    *,
    num_layers: int,
    ffn: int,
    tp: int,
    pp: int,
    ep: int,
    etp: int,
    world_size: int,
    sequence_parallel: bool,
    dispatcher: str = "alltoall",
    linear_biases: bool = False,
) -> list[Violation]:
    """Every broken MoE rule (module docstring), each naming its numbers; ``linear_biases``: the
    model's linear layers have biases (the experts too), which ``ptdp train`` does not split over
    etp yet."""
    out: list[Violation] = []
    for name, value in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            out.append(V("positive", f"{name}={value!r} must be a positive integer", **{name: value}))
    if out:
        return out
    if not moe.enabled:
        given = [
            f"{name}={getattr(moe, name)!r}"
            for name in MoEConfig.__dataclass_fields__
            if name != "num_experts" and getattr(moe, name) != getattr(_DEFAULTS, name)
        ]
        if ep > 1:
            given.insert(0, f"expert_model_parallel_size={ep}")
        if etp > 1:
            given.insert(0, f"expert_tensor_parallel_size={etp}")
        if dispatcher != "alltoall":
            given.append(f"moe_token_dispatcher_type={dispatcher!r}")
        if given:
            verb = "need" if len(given) > 1 else "needs"
            out.append(V("moe", f"{', '.join(given)} {verb} --num-experts (the model is dense without it)"))
        return out
    e, k = moe.num_experts, moe.moe_router_topk
    if not isinstance(e, int) or e < 1:
        return [V("moe", f"num_experts={e!r} must be a positive integer", num_experts=e)]
    if not 1 <= k <= e:
        out.append(V("moe", f"moe_router_topk={k} must be in [1, num_experts={e}]", moe_router_topk=k, num_experts=e))
    if e % ep:
        out.append(
            V(
                "moe",
                f"num_experts={e} is not divisible by expert_model_parallel_size={ep} (rule: E % ep == 0)",
                num_experts=e,
                ep=ep,
            )
        )
    if world_size % (etp * ep * pp):
        out.append(
            V(
                "moe",
                f"world_size={world_size} is not divisible by etp x ep x pp = {etp} x {ep} x {pp} "
                "(rule: the expert grid etp x ep x edp x pp covers the same ranks)",
                world_size=world_size,
            )
        )
    expert_ffn = moe.expert_ffn(ffn)
    if expert_ffn < 1 or expert_ffn % etp:
        out.append(
            V(
                "moe",
                f"moe_ffn_hidden_size={expert_ffn} must be a positive multiple of expert_tensor_parallel_size={etp}",
            )
        )
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None and (shared < 0 or shared % tp):
        out.append(
            V(
                "moe",
                f"moe_shared_expert_intermediate_size={shared} must be 0 or a positive multiple of "
                f"tensor_model_parallel_size={tp} (the shared expert is split as the dense MLP)",
            )
        )
    if etp > 1 and linear_biases:
        out.append(
            V(
                "moe",
                f"expert_tensor_parallel_size={etp} with linear biases with --num-experts: ptdp train does "
                "not run it yet (--disable-bias-linear removes them)",
            )
        )
    out += _layer_freq_violations(moe.moe_layer_freq, num_layers)
    out += _routing_violations(moe)
    if tp > 1 and not sequence_parallel:
        out.append(
            V(
                "moe",
                f"MoE with tensor_model_parallel_size={tp} needs --sequence-parallel (each tp rank routes "
                "its own share of the tokens)",
            )
        )
    return out


def _layer_freq_violations(freq: tuple[int, ...], num_layers: int) -> list[Violation]:
    if len(freq) == 1 and num_layers != 1:
        if freq[0] < 1:
            return [V("moe", f"moe_layer_freq={freq[0]} must be a positive integer (every N-th layer is MoE)")]
        return []
    if len(freq) != num_layers or any(x not in (0, 1) for x in freq):
        return [
            V(
                "moe",
                f"moe_layer_freq={list(freq)} must be one integer or one 0/1 per layer (num_layers={num_layers}, "
                f"{len(freq)} given)",
            )
        ]
    if not any(freq):
        return [V("moe", f"moe_layer_freq={list(freq)} makes no layer an MoE layer (without --num-experts: dense)")]
    return []


def _routing_violations(moe: MoEConfig) -> list[Violation]:
    out: list[Violation] = []
    e, k = moe.num_experts or 1, moe.moe_router_topk
    groups, group_k = moe.moe_router_num_groups, moe.moe_router_group_topk
    if (groups is None) != (group_k is None):
        out.append(V("moe", "group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk"))
    elif groups is not None and group_k is not None:
        if groups < 1 or e % groups:
            out.append(V("moe", f"num_experts={e} is not divisible by moe_router_num_groups={groups}"))
        elif not 1 <= group_k <= groups:
            out.append(V("moe", f"moe_router_group_topk={group_k} must be in [1, moe_router_num_groups={groups}]"))
        elif k % group_k or k // group_k > e // groups:
            out.append(
                V(
                    "moe",
                    f"moe_router_topk={k} must be a multiple of moe_router_group_topk={group_k} with k / "
                    f"group_topk <= {e // groups} experts per group",
                )
            )
    if moe.moe_router_pre_softmax and moe.moe_router_score_function != "softmax":
        out.append(V("moe", "--moe-router-pre-softmax needs --moe-router-score-function softmax"))
    cf = moe.moe_expert_capacity_factor
    if cf is not None and not (math.isfinite(cf) and cf > 0):
        out.append(V("moe", f"moe_expert_capacity_factor={cf} must be > 0 (or unset: dropless)"))
    if moe.moe_pad_expert_input_to_capacity and cf is None:
        out.append(V("moe", "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"))
    if moe.moe_token_drop_policy != _DEFAULTS.moe_token_drop_policy and cf is None:
        out.append(V("moe", f"--moe-token-drop-policy {moe.moe_token_drop_policy} needs --moe-expert-capacity-factor"))
    rate = moe.moe_router_bias_update_rate
    if rate != _DEFAULTS.moe_router_bias_update_rate and not moe.moe_router_enable_expert_bias:
        out.append(V("moe", f"moe_router_bias_update_rate={rate} needs --moe-router-enable-expert-bias"))
    for name in (
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_router_bias_update_rate",
        "moe_router_topk_scaling_factor",
    ):
        value = getattr(moe, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            out.append(V("moe", f"{name}={value} must be a finite number >= 0"))
    if moe.moe_router_topk_scaling_factor == 0:
        out.append(V("moe", "moe_router_topk_scaling_factor=0 would zero every expert's output"))
    return out
