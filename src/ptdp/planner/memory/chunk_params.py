"""The parameters of a model chunk on one tp rank, in ptdp's order (``GPTModel.parameters()``),
with the watch group that allocates each one's gradient bucket and the ZeRO-3 unit that gathers it
(:mod:`ptdp.planner.memory.transients` replays the engine's buckets and units over them), and the model
chunks of a pipeline rank. Pure arithmetic (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ptdp.config.model import ModelConfig
from ptdp.layout.pipeline.placement import virtual_stage
from ptdp.layout.vocab import padded_vocab_size
from ptdp.planner.inputs.moe_model import moe_of

#: watch groups: the chunk's non-layer parameters (allocated when its backward starts), the word
#: embedding read by the lookup alone, the learned position table (when backward reaches the sum of
#: the lookups), and layer k (>= 0)
REST, LOOKUP, POSITIONS = -1, -2, -3
#: ZeRO-3 units besides the layers (which are their own index); the embeddings' unit is gathered
#: for forward only (backward's lookups read the ids, not the tables)
EMBED_UNIT, HEAD_UNIT, TIED_UNIT = -1, -2, -3


@dataclass(frozen=True)
class Chunk:
    """Where a model chunk sits: whether it is the model's first (looks up) and last (projects);
    ``shared_table``: the rank runs both (the V placement's rank 0), so a tied table is one
    parameter, held by the first chunk and read by the last."""

    layers: int
    first: bool
    last: bool
    shared_table: bool = False


def layer_param_sizes(model: ModelConfig, tp: int, experts: bool = False) -> tuple[int, ...]:
    """Elements of each parameter of one transformer layer on one tp rank, in ptdp's order
    (sums to :func:`ptdp.planner.memory.params.layer_param_count`; an MoE layer's as
    :func:`_layer_params` says)."""
    return tuple(n for n, _ in _layer_params(model, tp, experts=experts))


def _mlp_parts(model: ModelConfig, tp: int, experts: bool) -> list[tuple[str, int, int]]:
    """(module, weight, bias) elements of a layer's MLP in the dense gradient buffer: ``fc1`` and
    ``fc2``; for a planned model whose layers are mostly MoE layers, the MoE layer's (ptdp's order):
    the router ``E h``, with ``experts`` the routed experts (ep = etp = 1: every one, stacked;
    otherwise they have their own buffer) and the shared expert's ``fc1`` and ``fc2`` (width ``S``
    over tp)."""
    h, ffn, halves = model.hidden_size, model.ffn, 2 if model.swiglu else 1
    biased = set(model.linears_with_bias)
    moe = moe_of(model)
    layers = moe.moe_layers(model.num_layers) if moe is not None else ()
    if 2 * sum(layers) < len(layers) or not layers:
        return [
            ("fc1", halves * ffn * h // tp, halves * ffn // tp if "fc1" in biased else 0),
            ("fc2", ffn * h // tp, h if "fc2" in biased else 0),
        ]
    assert moe is not None
    e, f, s = moe.num_experts or 0, moe.expert_ffn(ffn), moe.shared_ffn or 0
    bias = model.add_bias_linear
    parts = [("router", e * h, 0)]
    if experts:
        parts += [("efc1", e * halves * f * h, 0), ("efc2", e * h * f, 0)]
        parts += [("efc1b", e * halves * f, 0), ("efc2b", e * h, 0)] if bias else []
    if s:
        parts += [
            ("fc1", halves * s * h // tp, halves * s // tp if bias else 0),
            ("fc2", s * h // tp, h if bias else 0),
        ]
    return parts


@lru_cache(maxsize=256)
def _layer_params(model: ModelConfig, tp: int, main_grad: bool = False, experts: bool = False) -> list[tuple[int, int]]:
    """(elements, place in the order a layer's backward completes the gradients) of each
    parameter of one layer, in ptdp's order: ``fc2`` bias and weight (row-parallel), ``fc1``,
    ``ln2`` weight and bias, ``proj``, the key and query norms (``qk_layernorm``), ``qkv``,
    ``ln1``; a column-parallel linear (``qkv``, ``fc1``) completes its bias first at tp = 1 and
    its weight first at tp > 1 (its own autograd function); with ``main_grad`` (16-bit weights)
    every linear completes its weight first (it adds the weight's gradient into the float32
    ``main_grad`` itself). An MoE layer's MLP as :func:`_mlp_parts` (``experts``: the routed
    experts in this buffer), its experts' and shared expert's gradients first, the router's after."""
    h, a, d = model.hidden_size, model.num_attention_heads, model.head_dim
    q, kv = a * d, model.kv_heads * d
    biased = set(model.linears_with_bias)
    qk_norms = (
        [("q_norm", d, 0 if model.uses_rmsnorm else d), ("k_norm", d, 0 if model.uses_rmsnorm else d)]
        if model.qk_layernorm
        else []
    )
    parts: list[tuple[str, str, int]] = []  # (module, weight or bias, elements), ptdp's order
    for name, weight, bias in (
        ("ln1", h, 0 if model.uses_rmsnorm else h),
        ("qkv", (q + 2 * kv) * h // tp, (q + 2 * kv) // tp if "qkv" in biased else 0),
        *qk_norms,
        ("proj", q * h // tp, h if "proj" in biased else 0),
        ("ln2", h, 0 if model.uses_rmsnorm else h),
        *_mlp_parts(model, tp, experts),
    ):
        parts += [(name, "weight", weight)] + ([(name, "bias", bias)] if bias else [])
    weight_first = {"ln1", "ln2", "q_norm", "k_norm"} | ({"qkv", "fc1"} if tp > 1 else set())
    if main_grad:  # 16-bit weights: each linear adds its weight's gradient into main_grad itself, first
        weight_first |= {"qkv", "proj", "fc1", "fc2"}
    modules = (
        "efc2b",
        "efc2",
        "fc2",
        "efc1b",
        "efc1",
        "fc1",
        "router",
        "ln2",
        "proj",
        "k_norm",
        "q_norm",
        "qkv",
        "ln1",
    )
    ready = sorted(
        parts,
        key=lambda part: (modules.index(part[0]), (part[1] == "bias") == (part[0] in weight_first)),
    )
    return [(n, ready.index((name, kind, n))) for name, kind, n in parts]


def chunk_params(
    model: ModelConfig, tp: int, chunk: Chunk, divisible_by: int, experts: bool = False
) -> tuple[tuple[int, int, int], ...]:
    """(elements, watch group, unit) of each parameter of ``chunk`` on one tp rank, in ptdp's order
    (``experts``: an MoE layer's routed experts in this buffer, :func:`_mlp_parts`)."""
    h = model.hidden_size
    table = padded_vocab_size(model.vocab_size, divisible_by, tp) // tp * h
    tied_one = chunk.first and chunk.last and model.tied  # one table looked up and projected
    out: list[tuple[int, int, int]] = []
    if chunk.first and model.has_position_table:
        out.append((model.seq_length * h, POSITIONS, TIED_UNIT if tied_one else EMBED_UNIT))
    if chunk.first:
        alone = not model.tied or not chunk.last  # only the lookup reads it
        out.append((table, LOOKUP if alone else REST, TIED_UNIT if tied_one else EMBED_UNIT))
    elif chunk.last and model.tied and not chunk.shared_table:  # a copy of its own
        out.append((table, REST, HEAD_UNIT))
    sizes = layer_param_sizes(model, tp, experts)
    for k in range(chunk.layers):
        out += [(n, k, k) for n in sizes]
    if chunk.last:
        head = TIED_UNIT if tied_one else HEAD_UNIT
        out += [(n, REST, head) for n in ((h,) if model.uses_rmsnorm else (h, h))]
        if not model.tied:
            out.append((table, REST, head))
    return tuple(out)


def stage_chunks(
    num_layers: int, pp: int, v: int, pp_rank: int, stage_layers: int, placement: str = "looped"
) -> tuple[Chunk, ...]:
    """The model chunks of pipeline rank ``pp_rank`` holding ``stage_layers`` layers: ``v`` chunks
    of an even share each (the last chunks one layer fewer where they do not divide), the chunk of
    virtual stage 0 looking up, that of the last projecting (:mod:`ptdp.layout.pipeline.placement`;
    on the V placement both are rank 0's, the last projecting with the first's tied table)."""
    per, extra = divmod(stage_layers, v)
    stages = [virtual_stage(pp_rank, c, pp, placement) for c in range(v)]
    last = pp * v - 1
    return tuple(
        Chunk(per + (c < extra), first=k == 0, last=k == last, shared_table=0 in stages and last in stages and v > 1)
        for c, k in enumerate(stages)
    )
