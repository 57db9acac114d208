"""The planner's mixture-of-experts model: a :class:`~ptdp.config.model.ModelConfig` (attention,
norms, the dense layers' MLP, embeddings) with its :class:`~ptdp.config.moe.MoEConfig` (which layers
are MoE, the experts, routing), and what ``ptdp plan`` plans that ``ptdp train`` does not build yet:
multi-head latent attention (:class:`MLA`, DeepSeek-V2/V3) and multi-token-prediction layers.

MLA (DeepSeek-V2, arXiv:2405.04434, §2.1; V3, arXiv:2412.19437, §2.1), per layer: queries through a
rank-``q_lora`` down projection ``[q_lora, h]``, its RMSNorm and an up projection ``[a (dn + dr),
q_lora]`` (or one ``[a (dn + dr), h]`` without ``q_lora``); keys and values through one down projection
``[kv_lora + dr, h]`` (the latent and a rotary key shared by the heads), its RMSNorm and an up
projection ``[a (dn + dv), kv_lora]``; the output ``[h, a dv]``. Attention scores use ``dn + dr``
channels per head, the context ``dv``. Over tp (Megatron-Core's split): the down projections and
their norms replicated, the up projections by heads, the output by rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.schema import Config


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention's widths (module docstring); ``q_lora_rank`` None: queries
    projected directly."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        """Channels of a query or key head: ``dn + dr``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def weight_shapes(self, hidden: int, heads: int, tp: int = 1) -> dict[str, tuple[int, int]]:
        """The attention's weight matrices on one of ``tp`` ranks, ``[out, in]`` by name."""
        a, q = heads // tp, self.qk_head_dim
        shapes: dict[str, tuple[int, int]] = {}
        if self.q_lora_rank:
            shapes["q_down"] = (self.q_lora_rank, hidden)
            shapes["q_up"] = (a * q, self.q_lora_rank)
        else:
            shapes["q"] = (a * q, hidden)
        shapes["kv_down"] = (self.kv_lora_rank + self.qk_rope_head_dim, hidden)
        shapes["kv_up"] = (a * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        shapes["out"] = (hidden, a * self.v_head_dim)
        return shapes

    def param_count(self, hidden: int, heads: int, tp: int = 1) -> int:
        """The attention's parameters on one of ``tp`` ranks: its weights and the two latent
        RMSNorms (replicated; the layer's own norms are not counted here)."""
        weights = sum(o * i for o, i in self.weight_shapes(hidden, heads, tp).values())
        return weights + (self.q_lora_rank or 0) + self.kv_lora_rank

    def forward_gemms(self, hidden: int, heads: int, seq: int, tp: int, micro_batch_size: int):
        """Forward GEMMs ``(M, N, K, batch)`` on one tp rank for one micro-batch: the weight GEMMs
        of :meth:`weight_shapes` over ``T = b s`` tokens, then scores ``(s, s, dn + dr)`` and context
        ``(s, dv, s)`` for each of the ``b a / tp`` heads."""
        tokens, heads_here = micro_batch_size * seq, micro_batch_size * heads // tp
        gemms = [(tokens, o, i, 1) for o, i in self.weight_shapes(hidden, heads, tp).values()]
        gemms.append((seq, seq, self.qk_head_dim, heads_here))
        gemms.append((seq, self.v_head_dim, seq, heads_here))
        return tuple(gemms)

    def saved_widths(self, hidden: int, heads: int, tp: int = 1) -> int:
        """Elements per token MLA keeps for backward beyond the layer's input norm on one tp rank:
        the inputs of the up projections and their norms (the latents, twice each), the query, key
        and value heads given to the attention kernel, its output, and the rotary key."""
        a = heads // tp
        latents = 2 * ((self.q_lora_rank or 0) + self.kv_lora_rank) + self.qk_rope_head_dim
        return latents + a * (2 * self.qk_head_dim + 2 * self.v_head_dim)


@dataclass(frozen=True)
class MoEModel(ModelConfig):
    """A model with mixture-of-experts layers as the planner plans it: the dense fields of
    :class:`~ptdp.config.model.ModelConfig` (``ffn_hidden_size``: the dense layers' MLP), ``moe``,
    and the plan-only ``mla`` (None: the attention of ``ModelConfig``) and ``mtp_layers``: the last
    ``mtp_layers`` of the ``num_layers`` are multi-token-prediction modules (DeepSeek-V3 §2.2), each
    planned as a layer (on the last pipeline stage, as Megatron-Core places it) plus a ``[h, 2h]``
    projection, two norms and the output layer and loss once more; and ``load_imbalance``
    ``rho >= 1``: the tokens the busiest expert rank receives over the mean (``--moe-load-imbalance``;
    1.0, balanced, as NVIDIA's published runs force it)."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLA | None = None
    mtp_layers: int = 0
    load_imbalance: float = 1.0

    def __hash__(self) -> int:  # computed once: the planner's caches hash the model on every call
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def expert_load(self) -> float:
        """Rows the busiest expert rank receives over the balanced share: ``rho``, at most the
        capacity factor when one is given, exactly it with inputs padded to the capacity."""
        cf = self.moe.moe_expert_capacity_factor
        if cf is None:
            return self.load_imbalance
        return cf if self.moe.moe_pad_expert_input_to_capacity else min(self.load_imbalance, cf)

    @property
    def kept_share(self) -> float:
        """The expert inputs' rows over the ``k T`` assignments routed: 1 dropless; with a capacity
        factor below 1 at most it (dropped assignments are not sent), with padding exactly it
        (never more than every token, ``E / k``)."""
        cf = self.moe.moe_expert_capacity_factor
        if cf is None:
            return 1.0
        cf = min(cf, (self.moe.num_experts or 1) / self.moe.moe_router_topk)
        return cf if self.moe.moe_pad_expert_input_to_capacity else min(1.0, cf)

    def busiest_load(self, ep: int) -> float:
        """Rows the busiest expert rank of ``ep`` computes over the balanced share of the ``k T``
        routed: :attr:`expert_load` (the imbalance within the capacity), at most every row of the ep
        group (``ep`` times its share of what is kept); at ep 1 (one rank holds every expert) or
        with forced balancing, what is kept (:attr:`kept_share`)."""
        if ep == 1 or self.moe.moe_router_force_load_balancing:
            return self.kept_share
        return min(self.expert_load, ep * self.kept_share)

    @property
    def main_layers(self) -> int:
        """The model's own layers (``num_layers`` without the multi-token-prediction modules)."""
        return self.num_layers - self.mtp_layers

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The MoE layers' indices."""
        return tuple(i for i, is_moe in enumerate(self.moe.moe_layers(self.num_layers)) if is_moe)

    @property
    def plan_only(self) -> tuple[str, ...]:
        """What ``ptdp train`` does not build of this model."""
        return tuple(
            name
            for name, used in (
                ("multi-head latent attention", self.mla is not None),
                ("multi-token prediction", self.mtp_layers > 0),
            )
            if used
        )


def with_mtp(model: MoEModel, n: int) -> MoEModel:
    """``model`` with ``n`` multi-token-prediction modules after its main layers (each an MoE layer
    when the model has MoE layers, else dense). Raises ValueError for ``n < 0``."""
    if n < 0:
        raise ValueError(f"mtp layers {n} must be >= 0")
    main, moe = model.main_layers, model.moe
    freq = moe.moe_layers(model.num_layers)[:main] if moe.enabled else ()
    if moe.enabled:
        moe = replace(moe, moe_layer_freq=tuple(int(x) for x in freq) + (1,) * n)
    return replace(model, num_layers=main + n, mtp_layers=n, moe=moe)


def moe_layer_share(model: ModelConfig) -> float:
    """The share of ``model``'s layers that are MoE layers (0 for a dense model)."""
    return len(model.moe_layer_ids) / model.num_layers if isinstance(model, MoEModel) else 0.0


def moe_of(model: ModelConfig) -> MoEConfig | None:
    """The model's MoE options, None for a dense model."""
    return model.moe if isinstance(model, MoEModel) and model.moe.enabled else None


def moe_model(dense: ModelConfig, moe: MoEConfig, **plan_only) -> MoEModel:
    """``dense``'s fields (attention, norms, the dense layers' MLP) with ``moe`` and the plan-only
    fields of :class:`MoEModel`."""
    fields = {f: getattr(dense, f) for f in ModelConfig.__dataclass_fields__}
    return MoEModel(**fields, moe=moe, **plan_only)


def with_moe(model: ModelConfig, moe: MoEConfig | None, **plan_only) -> ModelConfig:
    """``model`` with ``moe`` (a :class:`MoEModel`, :func:`moe_model`), or its dense fields alone when
    ``moe`` is None or disabled and nothing plan-only is given."""
    if (moe is None or not moe.enabled) and not plan_only:
        return ModelConfig(**{f: getattr(model, f) for f in ModelConfig.__dataclass_fields__})
    return moe_model(model, moe or MoEConfig(), **plan_only)


def planned_model(config: Config) -> ModelConfig:
    """The model of a ``ptdp train`` config as the planner plans it: its ``ModelConfig`` with its MoE
    options (:func:`with_moe`)."""
    return with_moe(config.model, config.moe)
