"""What a zero-bubble schedule keeps from a microbatch's B to its W, measured on ptdp's own model:
the planner's :func:`~ptdp.planner.memory.activations.wgrad_kept_bytes` against the bytes the
deferred weight-gradient closures of a 2-layer float32 stage hold after B (every storage they reach,
once, parameters excluded)."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from ptdp.config.model import ModelConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.tensor_parallel.sharding import initialize_parameters
from ptdp.planner.memory.activations import wgrad_kept_bytes


def _held_bytes(roots: list, exclude: set[int], depth: int = 6) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` (closures, their cells and
    the objects they hold; modules not followed), less those in ``exclude``."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [(root, 0) for root in roots]
    while stack:
        obj, level = stack.pop()
        if id(obj) in seen or level > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = obj.untyped_storage().data_ptr()
            if key not in exclude:
                storages[key] = obj.untyped_storage().nbytes()
            continue
        if isinstance(obj, (torch.nn.Module, type, types.ModuleType, str, int, float)):
            continue
        stack += [(ref, level + 1) for ref in gc.get_referents(obj)]
    return sum(storages.values())


LAYERS, B, S, H = 2, 2, 16, 32


def _config(**kw) -> ModelConfig:
    """The stage's model: 2 layers, h = 32, ffn = 64, s = 16, float32."""
    return ModelConfig(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=S,
        vocab_size=303,
        make_vocab_size_divisible_by=8,
        params_dtype="float32",
        **kw,
    )


def _deferred(cfg: ModelConfig, moe=None):
    """A layers-only stage of ``cfg`` after a forward and a backward of b = 2 that deferred its
    weight gradients: the model and the (closure, parameter) pairs."""
    tp = ParallelGroups.single_process().tp
    model = GPTModel(cfg, tp, layer_ids=range(LAYERS), pre_process=False, post_process=False, defer_wgrad=True, moe=moe)
    initialize_parameters(model, seed=1, std=0.02, num_layers=LAYERS, tp_rank=0, tp_size=1)
    y = model(torch.randn(S, B, H, requires_grad=True))
    with model.wgrad_queue.defer():
        y.backward(torch.randn_like(y))
    return model, model.wgrad_queue.take()


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("recompute", [{}, {"recompute_granularity": "full", "recompute_num_layers": 1}])
def test_w_holds_what_the_planner_counts(swiglu, recompute):
    """Each linear's input and output gradient, all tokens: b = 2, s = 16, h = 32, ffn = 64, 4 bytes
    a value; with full recompute the tensors B recomputed, the same bytes."""
    cfg = _config(swiglu=swiglu, **recompute)
    model, jobs = _deferred(cfg)
    assert len(jobs) == 4 * LAYERS
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert _held_bytes([job for job, _ in jobs], params) == LAYERS * wgrad_kept_bytes(cfg, 1, B, precision="fp32")


def test_moe_layers_w_holds_the_experts_and_shared_experts_tensors():
    """MoE layers (4 experts, top-2, dropless, a shared expert): each layer's W closures hold the
    attention's, the shared expert's and the routed experts' inputs and output gradients, ``k T``
    rows for the experts at ep 1; the planner counts exactly those."""
    from ptdp.config.moe import MoEConfig
    from ptdp.planner.inputs.moe_model import moe_model

    cfg = _config(swiglu=True)
    moe = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=40)
    model, jobs = _deferred(cfg, moe)
    assert len(jobs) == 6 * LAYERS  # QKV, projection, shared fc1 and fc2, experts' fc1 and fc2
    assert sum(hasattr(p, "ptdp_expert") for _, p in jobs) == 2 * LAYERS
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    planned = moe_model(cfg, moe)
    want = LAYERS * wgrad_kept_bytes(planned, 1, B, precision="fp32")
    assert _held_bytes([job for job, _ in jobs], params) == want
