"""The mixture-of-experts options (a section of the configuration schema, :mod:`ptdp.config.fields`),
with Megatron-Core's flag names. Without ``num_experts`` the model is dense and the others must
keep their defaults (:mod:`ptdp.config.rules.moe`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ptdp.config.fields import opt

ScoreFunction = Literal["softmax", "sigmoid"]
LoadBalancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"]
DropPolicy = Literal["probs", "position"]


@dataclass(frozen=True)
class MoEConfig:
    """Which layers are mixtures of experts, how tokens are routed, balanced and dropped."""

    num_experts: int | None = opt(
        None,
        "--num-experts",
        "routed experts E per MoE layer (default: none, a dense model)",
        "moe",
        plan=True,
        metavar="E",
    )
    """Routed experts per MoE layer; None: a dense model."""
    moe_router_topk: int = opt(
        2, "--moe-router-topk", "experts each token is routed to (k)", "moe", plan=True, metavar="K"
    )
    """Experts each token is routed to, ``1 <= k <= E``."""
    moe_ffn_hidden_size: int | None = opt(
        None,
        "--moe-ffn-hidden-size",
        "inner width of each expert's MLP (default: the dense ffn)",
        "moe",
        plan=True,
        metavar="F",
    )
    """Inner width of an expert's MLP (GELU or SwiGLU as the dense MLP); None: ``ffn_hidden_size``."""
    moe_shared_expert_intermediate_size: int | None = opt(
        None,
        "--moe-shared-expert-intermediate-size",
        "inner width of the shared experts' MLP that every token passes through (default or 0: none)",
        "moe",
        plan=True,
        metavar="S",
    )
    """Inner width of the shared expert(s), one dense MLP every token of an MoE layer also passes
    through (added to the routed output); None or 0: none."""
    moe_layer_freq: tuple[int, ...] = opt(
        (1,),
        "--moe-layer-freq",
        "which layers are MoE: N = every N-th layer (layer i when i % N == 0), or one 0/1 per layer "
        "as a comma list or Megatron's form [0]*3+[1]*5",
        "moe",
        plan=True,
        metavar="N|LIST",
    )
    """One integer ``N``: layer ``i`` (0-based) is MoE when ``i % N == 0``; else one 0 (dense) or 1
    (MoE) per layer."""
    moe_router_score_function: ScoreFunction = opt(
        "softmax", "--moe-router-score-function", "router scores: softmax or sigmoid of the logits", "moe", plan=True
    )
    """How the router turns logits into scores (module :mod:`ptdp.engine.moe.router`)."""
    moe_router_pre_softmax: bool = opt(
        False,
        "--moe-router-pre-softmax",
        "softmax over all experts before the top-k (default: top-k logits, then softmax over them)",
        "moe",
        plan=True,
    )
    """softmax only: the probabilities of the top-k are the softmax over all ``E`` experts; else
    the softmax over the ``k`` selected logits."""
    moe_router_topk_scaling_factor: float | None = opt(
        None, "--moe-router-topk-scaling-factor", "multiply the top-k probabilities by this", "moe", plan=True
    )
    """Factor applied to the routing probabilities (DeepSeek-V3: 2.5); None: 1."""
    moe_router_num_groups: int | None = opt(
        None, "--moe-router-num-groups", "group-limited routing: experts split into this many groups", "moe", plan=True
    )
    """Group-limited routing (DeepSeek-V3): the experts form this many equal groups."""
    moe_router_group_topk: int | None = opt(
        None, "--moe-router-group-topk", "group-limited routing: groups each token may use", "moe", plan=True
    )
    """Group-limited routing: each token picks its experts from this many groups, those whose
    best ``k / group_topk`` scores sum highest."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = opt(
        None,
        "--moe-router-dtype",
        "dtype of the router's logits and scores (default: fp32, fp64 for float64 parameters)",
        "moe",
        plan=True,
    )
    """The router GEMM, scores, top-k and losses run in this dtype whatever the compute dtype;
    None: fp32, or fp64 when the parameters are float64."""
    moe_router_load_balancing_type: LoadBalancing = opt(
        "aux_loss",
        "--moe-router-load-balancing-type",
        "auxiliary balancing loss (with --moe-aux-loss-coeff): per micro-batch, per sequence, "
        "with the previous step's global-batch counts, or none",
        "moe",
        plan=True,
    )
    """Which auxiliary load-balancing loss ``--moe-aux-loss-coeff`` weights (docs/training.md,
    Mixture of experts)."""
    moe_aux_loss_coeff: float = opt(0.0, "--moe-aux-loss-coeff", "weight of the load-balancing loss", "moe", plan=True)
    """Weight of the load-balancing loss; 0: none."""
    moe_z_loss_coeff: float | None = opt(
        None,
        "--moe-z-loss-coeff",
        "weight of the router z-loss (mean squared logsumexp of the logits)",
        "moe",
        plan=True,
    )
    """Weight of the router z-loss (Zoph et al. 2022, arXiv:2202.08906, eq. 5); None: none."""
    moe_router_enable_expert_bias: bool = opt(
        False,
        "--moe-router-enable-expert-bias",
        "aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice only, "
        "updated after each step toward the mean load",
        "moe",
        plan=True,
    )
    """Aux-loss-free balancing (Wang et al. 2024, arXiv:2408.15664): a bias per expert added to the
    scores when choosing the top-k (not to the weights), moved by ``bias_update_rate x
    sign(mean load - load)`` after each step, the loads counted over the global batch."""
    moe_router_bias_update_rate: float = opt(
        1e-3, "--moe-router-bias-update-rate", "step of the expert-bias update", "moe", plan=True
    )
    """The expert bias's step per optimizer step."""
    moe_expert_capacity_factor: float | None = opt(
        None,
        "--moe-expert-capacity-factor",
        "capacity of each expert in tokens per micro-batch: factor x b s k / E (default: dropless)",
        "moe",
        plan=True,
        metavar="CF",
    )
    """Each expert takes at most ``ceil(CF * b * s * k / E)`` tokens of a micro-batch (all its ``b
    s`` tokens, whatever the layout); the rest of its assignments are dropped. None: dropless."""
    moe_token_drop_policy: DropPolicy = opt(
        "probs",
        "--moe-token-drop-policy",
        "with a capacity: keep each expert's highest-probability tokens, or its earliest",
        "moe",
        plan=True,
    )
    """Which assignments an over-full expert keeps: the highest probabilities (ties: the earlier
    token) or the earliest tokens (position in the micro-batch, sequence-major)."""
    moe_pad_expert_input_to_capacity: bool = opt(
        False,
        "--moe-pad-expert-input-to-capacity",
        "with a capacity: pad each expert's input to it (fixed shapes, no host synchronisation)",
        "moe",
        plan=True,
    )
    """Pad every expert's input to its capacity (zeros), so the dispatch has fixed sizes."""
    moe_router_force_load_balancing: bool = opt(
        False,
        "--moe-router-force-load-balancing",
        "route by a fixed balanced assignment instead of the scores (benchmark mode)",
        "moe",
        plan=True,
    )
    """Benchmark mode: token ``t`` of a micro-batch goes to experts ``(t k + j) mod E`` for ``j <
    k``, weighted by the router's probabilities of those experts."""
    moe_grouped_gemm: bool = opt(
        False,
        "--moe-grouped-gemm",
        "run a rank's experts as one grouped GEMM (torch._grouped_mm) where the dtype and device "
        "support it, else one GEMM per expert",
        "moe",
        plan=True,
    )
    """The experts of a rank as one ``torch._grouped_mm`` where supported; else a loop."""

    @property
    def enabled(self) -> bool:
        """The model has MoE layers."""
        return self.num_experts is not None

    def moe_layers(self, num_layers: int) -> tuple[bool, ...]:
        """For each of the model's layers, whether it is an MoE layer (all False when dense)."""
        if not self.enabled:
            return (False,) * num_layers
        if len(self.moe_layer_freq) == 1 and num_layers != 1:
            every = self.moe_layer_freq[0]
            return tuple(i % every == 0 for i in range(num_layers))
        return tuple(bool(x) for x in self.moe_layer_freq)

    def expert_ffn(self, dense_ffn: int) -> int:
        """Inner width of one routed expert."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else dense_ffn

    @property
    def shared_ffn(self) -> int:
        """Inner width of the shared expert, 0 without one."""
        return self.moe_shared_expert_intermediate_size or 0

    def router_dtype(self, params_dtype: str) -> str:
        """``fp32`` or ``fp64``: :attr:`moe_router_dtype`, else fp64 for float64 parameters."""
        if self.moe_router_dtype is not None:
            return self.moe_router_dtype
        return "fp64" if params_dtype == "float64" else "fp32"
